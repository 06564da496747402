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


def run_json(*argv: str, env: dict | None = None, timeout: float = 600) -> dict:
    """`python -m edge0.run ARGV --json` in its own process: its one JSON object (exit 0 asserted)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "edge0.run", *argv, "--json"], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])
