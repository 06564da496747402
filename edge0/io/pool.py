"""The I/O pool: the one owner of every expert read (exact, staged, hot, whole-layer prefill, prefetch).

One task per bundle (or per whole-layer read), so a layer's misses are read at a queue depth of up to
the pool's threads. Three classes of task, taken in this order: demand reads (a step is waiting for
them), planned reads that are certain (a layer whose routing a head decided for the next step), and
speculative reads (a prediction that may be wrong: prefetch routing), at most SPECULATIVE of those at
once. `reserved` threads never take anything but demand reads, so a demand read never queues behind
reads for the next step. A planned read a step comes to wait for (`wait`) while it is still queued is promoted
to the front of the demand reads; `cancel` takes back planned reads that have not started. Threads block in
the kernel for most of a read, so more threads than cores is normal; the
default was sized by measurement (docs/lab/pipeline.md).

Workers only read bytes into the buffers a task names, commit its slots (`bank.commit`: numpy widening
of the slot's bf16 pieces, under MLX's kernels) and fill in the task's outcome (`record` or `error`, then
`done`); they touch no other state.
The submitting thread reads outcomes once `done`. A task is a small object, not a Future: the pipeline
plans a few of them per layer per token, and their cost is on the graph-building thread. With a trace on,
each read is a span on its worker's lane, in every routing mode.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

IO_WORKERS = 8  # pool threads: 1 MiB cold reads gain up to about 8 in flight on the development disk
RESERVED = 2  # threads that only take demand reads
SPECULATIVE = 2  # most speculative reads in flight: a guess must not take the disk from reads that are certain
INLINE_BYTES = 1 << 20  # a bundle this small and already in the page cache is read on the calling thread: a copy
# of a few microseconds costs less than handing it to a worker
SWITCH_INTERVAL = 0.0005  # s: Python's GIL hand-over; its 5 ms default makes the graph-building thread wait up to
# that long for the GIL whenever a worker holds it between two system calls


def now_us() -> float:
    return time.perf_counter() * 1e6


@dataclass
class ReadRecord:
    """What a worker hands back for one read."""

    nbytes: int
    cold: float  # fraction of the bytes that were not in the page cache before the read
    start_us: float
    end_us: float


class ReadGroup:
    """The reads of one plan, counted as they finish (under the pool's lock): whoever consumes the plan learns that all
    have landed, and whether one failed or was taken back, from two fields instead of a walk over its tasks."""

    __slots__ = ("left", "failed")

    def __init__(self, n: int):
        self.left = n  # tasks not done
        self.failed = False  # one finished with no record (failed, or taken back before it started)


class ReadTask:
    """One read: what to read, and (once `done`) how it went."""

    __slots__ = ("layer", "expert", "buffers", "commit", "demand", "speculative", "step", "whole", "queued_us", "done",
                 "record", "error", "promoted", "cached", "group")

    def __init__(self, layer: int, expert: int, buffers: list, *, demand: bool, commit=None, step: int = -1,
                 whole: bool = False, speculative: bool = False, group: ReadGroup | None = None):
        self.layer, self.expert, self.buffers = layer, expert, buffers  # buffers: one per piece (per expert if whole)
        self.commit = commit  # (bank, slots) whose bank.commit(slots) runs after the bytes landed, or None
        self.demand, self.step, self.whole = demand, step, whole  # step: the decode step it serves (traces)
        self.speculative = speculative and not demand  # a guess: read only with disk time to spare
        self.queued_us = 0.0
        self.promoted = False  # a planned read a step came to wait for while it was queued: queued as a demand read
        self.cached = False  # found whole in the page cache just before (`_inline`'s probe): not probed again
        self.done = False  # set last, by the worker: record or error are final
        self.record: ReadRecord | None = None
        self.error: BaseException | None = None
        self.group = group  # counted down once done


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
        self._speculative: deque[ReadTask] = deque()
        self._speculating = 0  # threads now running a speculative read
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
                (self._demand if task.demand else self._speculative if task.speculative else self._prefetch).append(task)
            self._cv.notify(len(tasks))
        return tasks

    def run(self, tasks: list[ReadTask]) -> list[ReadTask]:
        """Start tasks: those the calling thread does faster itself (a small bundle already in the page cache;
        a demand read alone) are read now, on this thread; the others are queued for the workers, first."""
        inline, queued = [], []
        for t in tasks:
            (inline if self._inline(t, len(tasks)) else queued).append(t)
        if queued:
            self.submit(queued)
        if inline:
            t0, here = now_us(), threading.current_thread()
            name = "main" if here is threading.main_thread() else here.name  # the trace's lane names
            landed: dict[int, tuple] = {}  # one commit per bank for the reads made here
            for t in inline:
                t.queued_us = t0
                if t.commit is not None:
                    bank, slots = t.commit
                    landed.setdefault(id(bank), (bank, []))[1].extend(slots)
                    t.commit = None
                self._execute(t, name, inline=True)
            for bank, slots in landed.values():
                bank.commit(slots)  # failed reads' slots too: the caller empties them
            if any(t.demand for t in inline):  # the caller was waiting for these: a stall, as `wait`
                self._stalled(t0, now_us(), inline[0].layer, "demand")
        return tasks

    def _inline(self, task: ReadTask, n: int) -> bool:
        """Read on the calling thread: a demand read whose whole set is smaller than INLINE_BYTES (a hand-over
        costs more than its transfer), or a small bundle already in the page cache."""
        if task.whole:
            return False
        small = self.reader.manifest.bundle_bytes <= INLINE_BYTES
        if task.demand and (n == 1 or n * self.reader.manifest.bundle_bytes <= INLINE_BYTES):
            return True
        task.cached = small and self.reader.cached(task.layer, task.expert)
        return task.cached

    def read_bundles(self, layer: int, items: list[tuple[int, list]], *, bank=None, slots=None, step: int = -1,
                     cached: list[bool] | None = None) -> None:
        """Demand-read (expert, buffers) items, in parallel where that pays, and wait for all of them; then raise
        the first error, so no read is still writing when the caller handles it. bank, slots: item i lands in
        bank slot slots[i] (committed once it has). cached: item i was just found whole in the page cache (not
        probed again)."""
        tasks = [ReadTask(layer, e, bufs, demand=True, step=step, commit=None if bank is None else (bank, [slots[i]]))
                 for i, (e, bufs) in enumerate(items)]
        for t, c in zip(tasks, cached or ()):
            t.cached = c
        self.wait(self.run(tasks), layer=layer, why="demand")

    def wait(self, tasks: list[ReadTask], *, layer: int, why: str) -> None:
        """Wait for reads the calling (graph-building) thread needs now: the time is a stall, counted in
        `waited_s` and drawn as a `stall` span on the caller's lane; then raise the first read's error."""
        pending = [t for t in tasks if not t.done]
        if pending:
            t0 = now_us()
            self._promote(pending)
            self.finish(tasks)
            self._stalled(t0, now_us(), layer, why)
        raise_first(tasks)

    def _promote(self, tasks: list[ReadTask]) -> None:
        """A step waits for these reads: those still queued as planned reads are taken next, as demand reads."""
        with self._cv:
            for t in tasks:
                for q in (self._prefetch, self._speculative):
                    if t in q:
                        q.remove(t)
                        t.promoted, t.speculative = True, False
                        self._demand.appendleft(t)
            self._cv.notify_all()

    def _stalled(self, t0: float, t1: float, layer: int, why: str) -> None:
        self.waited_s += (t1 - t0) / 1e6
        if self.trace is not None and self.trace.on:
            self.trace.span("stall", "stall", t0, t1, layer=layer, why=why)

    def finish(self, tasks: list[ReadTask]) -> None:
        """Wait until every task is done (no error raised)."""
        with self._landed:
            self._landed.wait_for(lambda: all(t.done for t in tasks))

    def _start_threads(self) -> None:
        if sys.getswitchinterval() > SWITCH_INTERVAL:
            sys.setswitchinterval(SWITCH_INTERVAL)
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
                if self._prefetching < self.workers - self.reserved:
                    if self._prefetch:
                        self._prefetching += 1
                        return self._prefetch.popleft()
                    if self._speculative and self._speculating < SPECULATIVE:
                        self._prefetching += 1
                        self._speculating += 1
                        return self._speculative.popleft()
                if self._closed:
                    return None
                self._cv.wait()

    def _work(self) -> None:
        name = threading.current_thread().name
        while (task := self._take()) is not None:
            self._execute(task, name)
            if not (task.demand or task.promoted):
                with self._cv:
                    self._prefetching -= 1
                    self._speculating -= task.speculative
                    self._cv.notify()

    def _execute(self, task: ReadTask, name: str, inline: bool = False) -> None:
        """Read, commit, record: on a worker, or inline on the thread that started the task."""
        start = now_us()
        try:
            if task.whole:
                n, cold = self.reader.read_layer_into(task.layer, task.buffers), 0.0
            else:
                n, cold = self.reader.read_bundle(task.layer, task.expert, task.buffers, cached=task.cached)
            if task.commit is not None:
                bank, slots = task.commit
                bank.commit(slots)
            task.record = ReadRecord(n, cold, start, now_us())
        except BaseException as e:  # handed to whoever waits for the task, on its own thread
            task.error = e
        self._finished(task, name, inline)

    def cancel(self, tasks: list[ReadTask]) -> None:
        """Take back planned reads that have not started: they are done at once, with neither record nor error
        (their buffers untouched). Running, finished and demand reads are left alone."""
        gone = []
        with self._cv:
            for t in tasks:
                for q in (self._prefetch, self._speculative):
                    if t in q:
                        q.remove(t)
                        gone.append(t)
        for t in gone:
            self._finished(t, "")

    def _finished(self, task: ReadTask, name: str, inline: bool = False) -> None:
        """Record a task's outcome and mark it done; `inline`: made by the thread that will wait for it, so
        nobody waits on `_landed` for it."""
        r = task.record
        if r is not None and self.trace is not None and self.trace.on:
            self.trace.span("read", "io", r.start_us, r.end_us, thread=name, layer=task.layer, expert=task.expert,
                            bytes=r.nbytes, cold=r.cold, wait_ms=(r.start_us - task.queued_us) / 1e3,
                            demand=task.demand, step=task.step, whole_layer=task.whole)
        with self._cv:
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
        group = task.group
        if inline and group is None:
            task.done = True
            return
        with self._landed:
            task.done = True
            if group is not None:
                group.left -= 1
                group.failed = group.failed or r is None
            if not inline:
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
