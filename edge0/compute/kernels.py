"""Edge0's CPU kernels (csrc/, built by `pip install -e .` where a C++ compiler and CMake exist):
loading the extension, its pin to the MLX version it was built against, and the notice when absent.

The extension is optional: without it every product runs on MLX's own kernels.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from contextlib import contextmanager, suppress

from .machine import allowed_cores, machine_cores
from ..errors import Edge0Error

# Compute threads of the kernels, the calling thread included. On a 2-core machine a streamed decode step's
# products take one thread, leaving the other core to the I/O workers and to the Python that builds the
# next layer's graph (docs/DESIGN.md §15); where every expert is resident they take both, the stream keeping one core
# to itself (_place); a node of at least SPREAD_ROWS token rows (a prompt chunk's products
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
    # ASCII digits: str.isdigit() alone takes '²', on which int() raises
    if not (env.isascii() and env.isdigit() and len(env) <= 9) or int(env) < 1:
        raise Edge0Error(f"EDGE0_KERNEL_THREADS={env}: expected a whole number of at least 1")
    return int(env)


def default_threads(resident: bool = False) -> int:
    """Decode threads; resident: every expert in memory (no I/O pool to leave a core to)."""
    cores = machine_cores()
    if cores <= 2:
        return _env_threads() or (cores if resident else DEFAULT_THREADS_2_CORES)
    return _env_threads() or min(cores - 1, MAX_DEFAULT_THREADS)


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
    env = os.environ.get("EDGE0_KERNEL_ISA", "").strip()
    if env:  # checked before the module is taken: every later load() refuses it too
        _set_isa(_kernels, env, f"EDGE0_KERNEL_ISA={env}")
    _ext = _kernels
    set_num_threads(default_threads(), default_prompt_threads())
    return _ext


# The kernels' code paths, narrowest first. The products (qmv.cpp) choose theirs at run time; the dense ops (dense.cpp)
# are built once per instruction set the machine runs. A path set here runs each on its widest built path no wider
# than it, so a wider machine runs (and tests) what a narrower one would: $EDGE0_KERNEL_ISA, default the widest.
ISAS = ("portable", "avx2", "avx512")


def _built(ext) -> list[str]:
    have = set(ext.impls()) | set(ext.dense_impls())
    return [i for i in ISAS if i in have]


def _set_isa(ext, name: str, what: str) -> None:
    built = _built(ext)
    if name not in built:
        raise Edge0Error(f"{what}: this build's kernels run {', '.join(built)}")
    level = ISAS.index(name)
    for have, choose in ((ext.impls(), ext.set_impl), (ext.dense_impls(), ext.set_dense_impl)):
        choose(max((i for i in have if ISAS.index(i) <= level), key=ISAS.index))


def isas() -> list[str]:
    """The code paths this build runs, narrowest first ([] without the extension)."""
    return _built(_ext) if load() is not None else []


def isa() -> str | None:
    """The code path in use: the wider of the products' and the dense ops' (None without the extension)."""
    if load() is None:
        return None
    return max(_ext.impl(), _ext.dense_impl(), key=ISAS.index)


def set_isa(name: str) -> None:
    """Run the products and the dense ops on their widest built paths no wider than `name`, one of isas()."""
    if load() is None:
        raise Edge0Error(f"the CPU kernels are {reason()}")
    _set_isa(_ext, name, f"kernel path {name}")


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
        _place(max(1, int(n)))


# Where the threads of a decode step run. A step keeps busy the thread that builds its graph, MLX's stream thread
# (which runs the nodes, the step's critical path) and the kernels' n - 1 pool workers. Where they outnumber the
# cores (two decode threads on two cores), the host's scheduler moves the graph-building thread onto the stream's
# core now and then: the stream then shares its core, and waits for a worker that thread has preempted. There the
# stream keeps one core to itself, the workers run on the others, and so does a thread while it builds graphs
# (graph_thread); elsewhere every thread runs anywhere.
_off_stream: tuple[int, ...] | None = None  # the cores off the stream's, where it keeps one


def _place(decode: int) -> None:
    """The stream's and the workers' cores for `decode` threads (a call into the stream's thread, only where they
    change: none at all where nothing is ever placed)."""
    global _off_stream
    cores = allowed_cores()
    keep = decode + 1 > len(cores) >= 2
    off = cores[:-1] if keep else None
    if off != _off_stream:
        _ext.place_threads([cores[-1]] if keep else [], list(off or ()))  # (empty: any core)
        _off_stream = off


@contextmanager
def graph_thread():
    """The calling thread runs off the stream's core while inside (a generation: it builds the graphs), where the
    stream keeps one; as before after."""
    cores = _off_stream
    if cores is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    tid = threading.get_native_id()  # the same thread at exit, even where a generator is closed from another
    try:
        before = os.sched_getaffinity(tid)
        os.sched_setaffinity(tid, cores)
    except OSError:  # (cores taken from the process since: it runs where it may)
        yield
        return
    try:
        yield
    finally:
        with suppress(OSError):  # (a thread gone since)
            os.sched_setaffinity(tid, before)


# Syncs on the critical path (a staged layer's routed ids, a step's token): the host spins for the values up to
# SPIN_US before it sleeps, and the stream is held awake up to HOLD_US after each graph for the next one
# (_kernels.host_eval, _kernels.queue): a sleeping thread's wake-up costs ~0.1 ms on a VM, against 0.1-0.3 ms of
# compute between two syncs on the built-in model; the gap between two graphs of a staged step is 0.1-0.4 ms.
SPIN_US = 1000
HOLD_US = 500


def _flat(arrays) -> list:
    return [a for x in arrays for a in (x if isinstance(x, (list, tuple)) else (x,))]


def host_eval(*arrays, hold: bool = True) -> None:
    """mx.eval of values the host needs now, on the critical path: with the extension the calling thread spins for
    them up to SPIN_US (yielding its core at every turn) before it sleeps as mx.eval does, and the stream is then held
    awake for the next graph (queue; hold=False where the next graph is queued by mx.async_eval, which releases no
    hold: it would wait behind it); without the extension, mx.eval. arrays: arrays or lists of arrays."""
    ext = load()
    if ext is None:
        import mlx.core as mx

        mx.eval(_flat(arrays))
        return
    ext.host_eval(_flat(arrays), SPIN_US, HOLD_US if hold else 0)


def queue(*arrays) -> None:
    """mx.async_eval of a graph the host builds on from (a staged layer's experts), the stream then held awake up
    to HOLD_US for the next graph, so that queueing it wakes no thread; mx.async_eval without the extension."""
    ext = load()
    if ext is None:
        import mlx.core as mx

        mx.async_eval(_flat(arrays))
        return
    ext.queue(_flat(arrays), HOLD_US)
