"""`edge0 serve --record-routes DIR`: every finished request's routing, one trace per request, DIR/<its id>.npz.

The serving cycle (cycle.py) tells the recorder which job is admitted next (start: its prompt and first step run
alone) and whose rows a batched step holds (follow: the batch's jobs, in row order); every MoE layer's routing of a
row goes to that job (model/traced.py's sink). When a job finishes, its rows (evaluated by then) become a trace
(io/routetrace.py, Edge0's NPZ) on the worker, written atomically by a thread of its own, so no other request waits
for the disk; the job is answered once its file is written (jobs.py). The prompt cache is off: rows start at a
sequence's first token.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import Edge0Error
from ..io.routetrace import write_trace
from ..log import log
from ..model.traced import TracedRouting, trace_of


def record_dir(path: str) -> Path:
    """--record-routes DIR, checked before the model loads: a new directory (its parent must exist) or an empty
    one, made here, that takes files."""
    d = Path(path)
    what = f"--record-routes {path}"
    if d.is_symlink() or (d.exists() and not d.is_dir()):
        kind = "a symbolic link" if d.is_symlink() else "exists and is not a directory"
        raise Edge0Error(f"{what}: {kind}; name a new or empty directory (one trace a request)")
    if d.is_dir() and any(d.iterdir()):
        raise Edge0Error(f"{what}: a directory that is not empty; name a new or empty one (no file is written over)")
    try:
        d.mkdir(exist_ok=True)
        tempfile.TemporaryFile(dir=d).close()  # a real file made and dropped: os.access says yes to root on read-only
    except OSError as e:
        raise Edge0Error(f"{what}: cannot make or write it ({e.strerror or e})") from None
    return d


def recorder(engine, directory: Path | None, loop) -> "Quiet":
    """The serving cycles' hook: a RouteRecorder into `directory` (record_dir's), else one that records nothing."""
    return RouteRecorder(engine, directory, loop) if directory is not None else Quiet()


class Quiet:
    """A serving cycle's hook that records nothing (without --record-routes)."""

    def follow(self, rows) -> None:
        pass

    def start(self, job) -> None:
        pass

    def finish(self, job, fig, rows: int | None = None) -> None:
        pass

    def saved(self, job) -> None:
        return None

    def close(self) -> None:
        pass


class RouteRecorder(Quiet):
    """The hooks of --record-routes DIR on the engine's model (its prompt cache turned off)."""

    def __init__(self, engine, directory: Path, loop: asyncio.AbstractEventLoop):
        self.engine, self.dir, self.loop = engine, Path(directory), loop
        self.traced = TracedRouting(engine.store.model, record=True, what=f"--record-routes {directory}",
                                    sink=self._add)
        engine.prompt_cache = None  # a trace's rows are the sequence's from its first token: every one is computed
        self.current = None  # the job being admitted (its calls are one row), else None: a batched step
        self.rows = lambda: []  # the jobs of a batched step's rows, in order
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-routes")

    def follow(self, rows) -> None:
        self.rows = rows

    def start(self, job) -> None:
        """Worker: job's sequence is admitted next (None: the batch's steps follow)."""
        self.current = job
        if job is not None:
            job.routes = [[] for _ in self.traced.layers]

    def _add(self, layer: int, inds, scores) -> None:
        """Worker, as a step's graph is built: the layer's (B, T, K) routing, row r to the r-th job."""
        jobs = [self.current] if self.current is not None else self.rows()
        b = math.prod(inds.shape[:-2])
        if b != len(jobs):
            raise Edge0Error(f"--record-routes: a step of {b} rows for {len(jobs)} requests")
        for r, job in enumerate(jobs):
            job.routes[layer].append((inds, scores, r, b))

    def finish(self, job, fig, rows: int | None = None) -> None:
        """Worker: the finished job's trace handed to the writer (its rows evaluated here, where MLX runs). rows: the
        tokens its taken steps fed (a batch's step built ahead computed its row past them, for nothing)."""
        calls, job.routes = job.routes, None
        if not isinstance(calls, list):
            return
        per = [(np.concatenate([np.array(i).reshape(b, -1, i.shape[-1])[r] for i, _, r, b in layer])[:rows],
                np.concatenate([np.array(s.astype(mx.float32)).reshape(b, -1, s.shape[-1])[r]
                                for _, s, r, b in layer])[:rows]) for layer in calls]
        trace = trace_of(per, list(self.traced.blocks), prompt_tokens=len(job.req.prompt),
                         tokens=list(job.req.prompt) + list(fig.tokens),
                         num_experts=self.engine.store.manifest.num_experts)
        job.routes = self.writer.submit(self._write, job.id or f"request-{job.seq}", trace)

    def _write(self, name: str, trace) -> None:
        path = self.dir / f"{name}.npz"
        if path.exists():
            raise Edge0Error(f"{path}: exists (no file is written over)")
        write_trace(path, trace)

    def saved(self, job) -> "asyncio.Future | None":
        """Loop: the job's trace write, or None where it has none; a failed write is logged (the answer stands)."""
        fut = getattr(job, "routes", None)
        if not isinstance(fut, Future):
            return None
        fut.add_done_callback(lambda f: f.exception() and log.error(
            f"--record-routes: the trace of {job.id or job.seq} was not written ({f.exception()})"))
        return asyncio.wrap_future(fut, loop=self.loop)

    def close(self) -> None:
        """Every pending trace written; the model's hooks removed."""
        self.writer.shutdown(wait=True)
        self.traced.detach()
