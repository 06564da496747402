"""Which kernel computes the quantized products and per-token dense ops of the graphs built now.

An engine chooses its `Kernel` once (`Kernel.choose("auto" | "mlx" | "edge0")`) and builds every graph
inside `with kernel.active():`, so the choice belongs to the engine, not to the process: two engines
on two threads may use different kernels. Outside any engine (tests, library use) the kernel named by
$EDGE0_KERNEL (default auto) is used.

Kernels: `mlx` (MLX's own), `edge0` (the CPU extension of csrc/: int8 activations, AVX-512 VNNI or
AVX2 nibble dot products, for MLX's affine 4-bit layout and 8-bit routers, float32 activations),
`auto` (edge0 on CPU when it is built, MLX's elsewhere).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import mlx.core as mx

from .choices import KERNELS
from ..errors import SettingError
from . import kernels


@dataclass(frozen=True)
class Kernel:
    """A resolved kernel choice."""

    name: str  # "edge0" or "mlx": what the products of graphs built under it run on
    ext: object = None  # the CPU extension module when name is "edge0"

    @classmethod
    def choose(cls, choice: str | None = None) -> "Kernel":
        """Resolve `choice` (None: $EDGE0_KERNEL, else auto); `edge0` raises when the extension cannot be used."""
        choice = choice or os.environ.get("EDGE0_KERNEL") or "auto"
        if choice not in KERNELS:
            raise SettingError(f"{{kernel.name}} {choice}: choose {', '.join(KERNELS)}")
        if choice == "edge0" and not kernels.available():
            raise SettingError(f"{{kernel.name}} edge0: the CPU kernels are {kernels.reason()}")
        if choice == "mlx" or (choice == "auto" and mx.default_device() != mx.cpu):
            return cls("mlx")
        ext = kernels.load()
        if ext is None:
            kernels.notice()
            return cls("mlx")
        return cls("edge0", ext)

    @property
    def edge0(self) -> bool:
        return self.ext is not None

    @contextmanager
    def active(self):
        """Graphs built inside use this kernel (on this thread or task)."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)


_active: ContextVar[Kernel | None] = ContextVar("edge0_kernel", default=None)
_from_env: dict[str, Kernel] = {}  # $EDGE0_KERNEL's resolution, per value (the extension loads once)


def current() -> Kernel:
    """The kernel of graphs built now: the active one, else the one $EDGE0_KERNEL names."""
    k = _active.get()
    if k is not None:
        return k
    choice = os.environ.get("EDGE0_KERNEL") or "auto"
    if choice not in _from_env:
        _from_env[choice] = Kernel.choose(choice)
    return _from_env[choice]


def remembered(owner, slot: str, arrays: tuple, extra: tuple, make):
    """make() kept on `owner` (a module) while `arrays` (by identity) and `extra` (the kernel's ext, an input's
    width and dtype) stay what they were: a module's kernel checks run once, not at every token, and a module whose
    arrays are replaced (an adapter's training step, load_weights) is checked again. The memo holds the arrays, so
    their ids cannot pass to new arrays while it stands."""
    key = (*map(id, arrays), *extra)
    memo = owner.__dict__.get(slot)
    if memo is not None and memo[0] == key:
        return memo[1]
    value = make()
    owner.__dict__[slot] = (key, value, arrays)
    return value
