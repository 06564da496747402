"""The I/O pool: the one owner of every expert read (exact, staged, hot, whole-layer prefill, prefetch).

One task per bundle (or per whole-layer read), so a layer's misses are read at a queue depth of up to
the pool's threads. Two classes of task: demand reads (a step is waiting for them) are always taken
first, and `reserved` threads never take a prefetch, so a demand read never queues behind reads for the
next step. Threads block in the kernel for most of a read, so more threads than cores is normal; the
default was sized by measurement (docs/results/pipeline.md).

Workers only read bytes into the buffers a task names, run its `commit` (numpy widening of a slot's bf16
pieces) and fill in the task's outcome (`record` or `error`, then `done`); they touch no other state.
The submitting thread reads outcomes once `done`. A task is a small object, not a Future: the pipeline
plans a few of them per layer per token, and their cost is on the graph-building thread. With a trace on,
each read is a span on its worker's lane, in every routing mode.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

IO_WORKERS = 8  # pool threads: 1 MiB cold reads gain up to about 8 in flight on the development disk
RESERVED = 2  # threads that only take demand reads


def now_us() -> float:
    return time.perf_counter() * 1e6


@dataclass
class ReadRecord:
    """What a worker hands back for one read."""

    nbytes: int
    cold: float  # fraction of the bytes that were not in the page cache before the read
    start_us: float
    end_us: float


class ReadTask:
    """One read: what to read, and (once `done`) how it went."""

    __slots__ = ("layer", "expert", "buffers", "commit", "demand", "step", "whole", "queued_us", "done", "record",
                 "error")

    def __init__(self, layer: int, expert: int, buffers: list, *, demand: bool, commit=None, step: int = -1,
                 whole: bool = False):
        self.layer, self.expert, self.buffers = layer, expert, buffers  # buffers: one per piece (per expert if whole)
        self.commit = commit  # () -> None after the bytes landed (worker thread, numpy only), or None
        self.demand, self.step, self.whole = demand, step, whole  # step: the decode step it serves (traces)
        self.queued_us = 0.0
        self.done = False  # set last, by the worker: record or error are final
        self.record: ReadRecord | None = None
        self.error: BaseException | None = None


@dataclass
class LoadStats:
    """Bundle reads the pool served (whole-layer reads apart), in every routing mode."""

    loads: int = 0
    demand_loads: int = 0  # of those, read for a step that was waiting for them
    bytes: int = 0
    cold_bytes: float = 0.0
    layer_reads: int = 0  # whole-layer prefill reads

    @property
    def cold_fraction(self) -> float:
        return self.cold_bytes / self.bytes if self.bytes else 0.0


class ReadPool:
    """Worker threads reading through one BundleReader; started at the first submit."""

    def __init__(self, reader, workers: int = IO_WORKERS, *, reserved: int = RESERVED, trace=None):
        if workers < 1:
            raise ValueError("an I/O pool needs at least one thread")
        self.reader = reader
        self.workers = workers
        self.reserved = min(reserved, workers - 1)  # with one thread, prefetches must run somewhere
        self.trace = trace  # None or a sched.trace.Trace-like hook with .on and .span
        self._demand: deque[ReadTask] = deque()
        self._prefetch: deque[ReadTask] = deque()
        self._cv = threading.Condition()  # the queues, the counters
        self._landed = threading.Condition()  # tasks becoming done
        self._prefetching = 0  # threads now running a prefetch read
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.waited_s = 0.0  # time callers waited on reads (`wait`): the graph-building thread's stalls
        self.stats = LoadStats()  # updated by the workers, under the pool's lock

    def configure(self, *, workers: int | None = None, trace=None) -> None:
        """Set the thread count (more threads start at the next submit) and the trace hook."""
        if workers is not None:
            if workers < 1:
                raise ValueError("an I/O pool needs at least one thread")
            self.workers = workers
            self.reserved = min(RESERVED, workers - 1)
        if trace is not None:
            self.trace = trace

    # -- submitting and waiting (the graph-building thread) ------------------------------------------

    def submit(self, tasks: list[ReadTask]) -> list[ReadTask]:
        """Queue tasks (one lock, one wake-up per task); returns them."""
        t = now_us()
        with self._cv:
            if self._closed:
                raise RuntimeError("the I/O pool is closed")
            if len(self._threads) < self.workers:
                self._start_threads()
            for task in tasks:
                task.queued_us = t
                (self._demand if task.demand else self._prefetch).append(task)
            self._cv.notify(len(tasks))
        return tasks

    def read_bundles(self, layer: int, items: list[tuple[int, list]], *, commit=None, step: int = -1) -> None:
        """Demand-read (expert, buffers) items in parallel and wait for all of them; then raise the first error,
        so no read is still writing when the caller handles it. commit(i) runs after item i landed."""
        tasks = [ReadTask(layer, e, bufs, demand=True, step=step,
                          commit=None if commit is None else (lambda i=i: commit(i)))
                 for i, (e, bufs) in enumerate(items)]
        self.wait(self.submit(tasks), layer=layer, why="demand")

    def wait(self, tasks: list[ReadTask], *, layer: int, why: str) -> None:
        """Wait for reads the calling (graph-building) thread needs now: the time is a stall, counted in
        `waited_s` and drawn as a `stall` span on the caller's lane; then raise the first read's error."""
        if not all(t.done for t in tasks):
            t0 = now_us()
            self.finish(tasks)
            t1 = now_us()
            self.waited_s += (t1 - t0) / 1e6
            if self.trace is not None and self.trace.on:
                self.trace.span("stall", "stall", t0, t1, layer=layer, why=why)
        raise_first(tasks)

    def finish(self, tasks: list[ReadTask]) -> None:
        """Wait until every task is done (no error raised)."""
        with self._landed:
            self._landed.wait_for(lambda: all(t.done for t in tasks))

    def _start_threads(self) -> None:
        for i in range(len(self._threads), self.workers):
            t = threading.Thread(target=self._work, name=f"edge0-io-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    # -- workers ----------------------------------------------------------------------------------------

    def _take(self) -> ReadTask | None:
        with self._cv:
            while True:
                if self._demand:
                    return self._demand.popleft()
                if self._prefetch and self._prefetching < self.workers - self.reserved:
                    self._prefetching += 1
                    return self._prefetch.popleft()
                if self._closed:
                    return None
                self._cv.wait()

    def _work(self) -> None:
        name = threading.current_thread().name
        reader = self.reader
        while (task := self._take()) is not None:
            start = now_us()
            try:
                if task.whole:
                    n, cold = reader.read_layer_into(task.layer, task.buffers), 0.0
                else:
                    n, cold = reader.read_bundle(task.layer, task.expert, task.buffers)
                if task.commit is not None:
                    task.commit()
                task.record = ReadRecord(n, cold, start, now_us())
            except BaseException as e:  # handed to whoever waits for the task, on its own thread
                task.error = e
            self._finished(task, name)

    def _finished(self, task: ReadTask, name: str) -> None:
        r = task.record
        if r is not None and self.trace is not None and self.trace.on:
            self.trace.span("read", "io", r.start_us, r.end_us, thread=name, layer=task.layer, expert=task.expert,
                            bytes=r.nbytes, cold=r.cold, wait_ms=(r.start_us - task.queued_us) / 1e3,
                            demand=task.demand, step=task.step, whole_layer=task.whole)
        with self._cv:
            if not task.demand:
                self._prefetching -= 1
                self._cv.notify()
            if r is not None:
                st = self.stats
                if task.whole:
                    st.layer_reads += 1
                else:
                    st.loads += 1
                    st.demand_loads += task.demand
                    st.bytes += r.nbytes
                    st.cold_bytes += r.cold * r.nbytes
        task.buffers = task.commit = None  # the slot's views: not kept alive by a finished task
        with self._landed:
            task.done = True
            self._landed.notify_all()

    def close(self) -> None:
        """Finish the reads already queued, then stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []


def raise_first(tasks: list[ReadTask]) -> None:
    """Raise the first error among finished tasks, if any."""
    for t in tasks:
        if t.error is not None:
            raise t.error
