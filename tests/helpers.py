"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

_tokens: list = []  # kernels made current by use_kernel, undone after each test (conftest)


def use_kernel(name: str):
    """Make `name` the current kernel for the rest of the test; returns the Kernel."""
    from edge0.compute.kernel import Kernel, _active

    k = Kernel.choose(name)
    _tokens.append(_active.set(k))
    return k


def undo_kernels() -> None:
    from edge0.compute.kernel import _active

    while _tokens:
        _active.reset(_tokens.pop())
