"""What this machine offers the engine: the cores this process may run on, its memory, and the BLAS that MLX's
float32 matmuls call on the CPU. Probed here, below the engine's configuration, which bounds its values by them."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CORES: tuple[int, ...] | None = None


def allowed_cores() -> tuple[int, ...]:
    """The cores this process may run on, as the first call found them (later, the thread asking may be one that
    compute/kernels.py keeps off a core)."""
    global _CORES
    if _CORES is None:
        _CORES = (tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity")
                  else tuple(range(os.cpu_count() or 1)))
    return _CORES


def machine_cores() -> int:
    """How many cores this process may run on."""
    return len(allowed_cores())


def blas() -> str:
    """Which BLAS MLX's float32 matmuls call on the CPU: OpenBLAS where it is loaded into this process (preloaded:
    MLX's Linux CPU wheel links the reference BLAS), else that reference BLAS; MLX's own off Linux."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return "none (MLX on the GPU)"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "MLX's own BLAS"
    lib = next((line.split()[-1] for line in maps.splitlines() if "libopenblas" in line), None)
    if lib is not None:
        return f"OpenBLAS ({lib}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')})"
    return "reference BLAS (MLX's Linux CPU wheel)"


def memory_gib() -> float:
    """This machine's memory in GiB (inf where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return math.inf
