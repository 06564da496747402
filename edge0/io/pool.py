"""The I/O pool: the one owner of every expert read (exact, staged, hot, whole-layer prefill, prefetch).

One task per bundle (or per whole-layer read), so a layer's misses are read at a queue depth of up to
the pool's threads. Two classes of task: demand reads (a step is waiting for them) are always taken
first, and `reserved` threads never take a prefetch, so a demand read never queues behind reads for the
next step. Threads block in the kernel for most of a read, so more threads than cores is normal; the
default was sized by measurement (docs/results/pipeline.md).

Workers only read bytes into the buffers they are given and run the task's `commit` (numpy widening of
a slot's bf16 pieces); they return a `ReadRecord` through the task's Future and touch no other state.
With a trace on, each read is a span on its worker's lane, in every routing mode.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

IO_WORKERS = 8  # pool threads: 1 MiB cold reads gain up to about 8 in flight on the development disk
RESERVED = 2  # threads that only take demand reads


def now_us() -> float:
    return time.perf_counter() * 1e6


@dataclass
class ReadRecord:
    """What a worker hands back for one read."""

    layer: int
    expert: int  # the bundle's expert (the first one of a whole-layer read)
    nbytes: int
    cold: float  # fraction of the bytes that were not in the page cache before the read
    queued_us: float  # when it was submitted (perf_counter microseconds)
    start_us: float
    end_us: float
    demand: bool


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


@dataclass
class _Task:
    layer: int
    expert: int
    whole: bool  # a whole-layer read, not one bundle
    read: Callable[[], tuple[int, float]]  # () -> (bytes, cold fraction); runs on the worker
    commit: Callable[[], None] | None  # after the bytes landed (worker thread, numpy only)
    demand: bool
    step: int  # the decode step the read serves (traces)
    queued_us: float
    future: Future


class ReadPool:
    """Worker threads reading through one BundleReader; started at the first submit."""

    def __init__(self, reader, workers: int = IO_WORKERS, *, reserved: int = RESERVED, trace=None):
        if workers < 1:
            raise ValueError("an I/O pool needs at least one thread")
        self.reader = reader
        self.workers = workers
        self.reserved = min(reserved, workers - 1)  # with one thread, prefetches must run somewhere
        self.trace = trace  # None or a sched.trace.Trace-like hook with .on and .span
        self._demand: deque[_Task] = deque()
        self._prefetch: deque[_Task] = deque()
        self._cv = threading.Condition()
        self._prefetching = 0  # threads now running a prefetch read
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.waited_s = 0.0  # time callers waited on reads (`wait`): the graph-building thread's stalls
        self.stats = LoadStats()  # updated by the workers, under the pool's lock

    # -- submitting (any thread) --------------------------------------------------------------------

    def submit_bundle(self, layer: int, expert: int, buffers: list, *, demand: bool, commit=None,
                      step: int = -1) -> Future:
        """Read bundle (layer, expert) into `buffers`, then run `commit`; the Future gives a ReadRecord."""
        reader = self.reader
        return self._submit(_Task(layer, expert, False, lambda: reader.read_bundle(layer, expert, buffers), commit,
                                  demand, step, now_us(), Future()))

    def submit_layer(self, layer: int, buffers: list[list], *, commit=None) -> Future:
        """Read a whole layer (buffers[e] for expert e) in as few large reads as the reader makes, as one task."""
        reader = self.reader

        def read():
            n = reader.read_layer_into(layer, buffers)
            return n, 0.0

        return self._submit(_Task(layer, 0, True, read, commit, True, -1, now_us(), Future()))

    def read_bundles(self, layer: int, items: list[tuple[int, list]], *, commit=None, step: int = -1) -> list[ReadRecord]:
        """Demand-read (expert, buffers) items in parallel and wait for all of them; then raise the first error,
        so no read is still writing when the caller handles it. commit(i) runs after item i landed."""
        futures = [self.submit_bundle(layer, e, bufs, demand=True, step=step,
                                      commit=None if commit is None else (lambda i=i: commit(i)))
                   for i, (e, bufs) in enumerate(items)]
        return self.wait(futures, layer=layer, why="demand")

    def wait(self, futures: list[Future], *, layer: int, why: str) -> list[ReadRecord]:
        """Wait for reads the calling (graph-building) thread needs now: the time is a stall, counted in
        `waited_s` and drawn as a `stall` span on the caller's lane; then as wait_all."""
        if all(f.done() for f in futures):
            return wait_all(futures)
        t0 = now_us()
        try:
            return wait_all(futures)
        finally:
            t1 = now_us()
            self.waited_s += (t1 - t0) / 1e6
            if self.trace is not None and self.trace.on:
                self.trace.span("stall", "stall", t0, t1, layer=layer, why=why)

    def _submit(self, task: _Task) -> Future:
        with self._cv:
            if self._closed:
                raise RuntimeError("the I/O pool is closed")
            if len(self._threads) < self.workers:
                self._start_threads()
            (self._demand if task.demand else self._prefetch).append(task)
            self._cv.notify()
        return task.future

    def _start_threads(self) -> None:
        for i in range(len(self._threads), self.workers):
            t = threading.Thread(target=self._work, name=f"edge0-io-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    # -- workers ----------------------------------------------------------------------------------------

    def _take(self) -> _Task | None:
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
        while (task := self._take()) is not None:
            if not task.future.set_running_or_notify_cancel():
                self._done(task)
                continue
            start = now_us()
            try:
                n, cold = task.read()
                if task.commit is not None:
                    task.commit()
            except BaseException as e:  # handed to whoever waits on the Future, on its own thread
                self._done(task)
                task.future.set_exception(e)
                continue
            rec = ReadRecord(task.layer, task.expert, n, cold, task.queued_us, start, now_us(), task.demand)
            trace = self.trace
            if trace is not None and trace.on:
                trace.span("read", "io", rec.start_us, rec.end_us, thread=name, layer=rec.layer, expert=rec.expert,
                           bytes=n, cold=cold, wait_ms=(start - task.queued_us) / 1e3, demand=task.demand,
                           step=task.step, whole_layer=task.whole)
            self._count(task, n, cold)
            self._done(task)
            task.future.set_result(rec)

    def _count(self, task: _Task, n: int, cold: float) -> None:
        with self._cv:
            st = self.stats
            if task.whole:
                st.layer_reads += 1
                return
            st.loads += 1
            st.demand_loads += task.demand
            st.bytes += n
            st.cold_bytes += cold * n

    def _done(self, task: _Task) -> None:
        if not task.demand:
            with self._cv:
                self._prefetching -= 1
                self._cv.notify()

    def configure(self, *, workers: int | None = None, trace=None) -> None:
        """Set the thread count (before the first read; more threads start at the next one) and the trace hook."""
        if workers is not None:
            if workers < 1:
                raise ValueError("an I/O pool needs at least one thread")
            self.workers = workers
            self.reserved = min(RESERVED, workers - 1)
        if trace is not None:
            self.trace = trace

    def close(self) -> None:
        """Finish the reads already queued, then stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []


def wait_all(futures: list[Future]) -> list[ReadRecord]:
    """Wait for every Future, then raise the first one's error (if any), else return their records."""
    for f in futures:
        f.exception()  # waits, never raises the read's error
    for f in futures:
        if f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]
