"""Edge0's CPU kernels (csrc/, built by `pip install -e .` where a C++ compiler and CMake exist):
loading the extension, its pin to the MLX version it was built against, and the notice when absent.

The extension is optional: without it every product runs on MLX's own kernels.
"""

from __future__ import annotations

import importlib.util
import os

from ..config import machine_cores
from ..errors import Edge0Error

# Compute threads of the kernels, the calling thread included. On a 2-core machine a decode step's
# products take one thread, leaving the other core to the I/O workers and to the Python that builds the
# next layer's graph (docs/DESIGN.md §15); a node of at least SPREAD_ROWS token rows (a prompt chunk's products
# and attention, compute-bound, nothing to overlap; a served batch's step of several sequences) takes every
# core. EDGE0_KERNEL_THREADS sets both.
DEFAULT_THREADS_2_CORES = 1
MAX_DEFAULT_THREADS = 8

_ext = None  # the loaded module, once load() succeeded
_reason: str | None = None  # why it is unavailable, once load() failed
_noticed = False


def _env_threads() -> int | None:
    """$EDGE0_KERNEL_THREADS, when set: the thread count of decode steps and prompts alike."""
    env = os.environ.get("EDGE0_KERNEL_THREADS", "").strip()
    if not env:
        return None
    if not env.isdigit() or int(env) < 1:
        raise Edge0Error(f"EDGE0_KERNEL_THREADS={env}: expected a whole number of at least 1")
    return int(env)


def default_threads() -> int:
    """Decode threads."""
    cores = machine_cores()
    return _env_threads() or (DEFAULT_THREADS_2_CORES if cores <= 2 else min(cores - 1, MAX_DEFAULT_THREADS))


def default_prompt_threads() -> int:
    """Prompt threads: every core (up to MAX_DEFAULT_THREADS)."""
    return _env_threads() or min(machine_cores(), MAX_DEFAULT_THREADS)


def load():
    """The extension module, or None (see reason())."""
    global _ext, _reason
    if _ext is not None or _reason is not None:
        return _ext
    import mlx.core as mx  # libmlx must be loaded before the extension that links it

    if importlib.util.find_spec(f"{__package__}._kernels") is None:
        _reason = "not built"
        return None
    try:
        from . import _kernels
    except ImportError as e:
        _reason = f"cannot be loaded ({e}); rebuild: pip install -e ."
        return None
    built = _kernels.mlx_version()
    if built != mx.__version__:
        _reason = f"built against mlx {built} but mlx {mx.__version__} is installed; rebuild: pip install -e ."
        return None
    _kernels.set_num_threads(default_threads(), default_prompt_threads())
    _ext = _kernels
    return _ext


def available() -> bool:
    return load() is not None


def reason() -> str:
    """Why the extension cannot be used ('' when it can)."""
    load()
    return _reason or ""


def notice() -> None:
    """One line on stderr, once per process, saying MLX's kernels are used and why."""
    global _noticed
    if not _noticed and not available():
        _noticed = True
        from ..log import log

        log.info(f"CPU kernels {reason()}; using MLX's kernels")


def set_num_threads(n: int, prompt: int | None = None) -> None:
    """n threads for decode steps, prompt (n when None) for prompt chunks: an explicit thread count
    (--kernel-threads) holds for both."""
    if load() is not None:
        _ext.set_num_threads(max(1, int(n)), max(1, int(prompt or n)))



# How long host_eval's caller spins for the values before it sleeps: a layer's routed ids come 0.1-0.3 ms after the
# sync on the built-in model; a sleeping thread's wake-up costs ~0.1 ms on a VM.
SPIN_US = 1000


def host_eval(*arrays) -> None:
    """mx.eval of values the host needs now, on the critical path (a layer's routed ids, a step's token): with the
    extension the calling thread spins for them up to SPIN_US, yielding its core at every turn, before it sleeps as
    mx.eval does; without it, mx.eval. arrays: arrays or lists of arrays."""
    ext = load()
    flat = [a for x in arrays for a in (x if isinstance(x, (list, tuple)) else (x,))]
    if ext is None:
        import mlx.core as mx

        mx.eval(flat)
        return
    ext.host_eval(flat, SPIN_US)
