"""The I/O scheduler: one-token-ahead reads into idle slot banks, filled by a worker pool.

The rule of the pipeline, written once:
  Layer L owns one bank of S slots (default 2K). During step s, as soon as a prediction of layer L's
  experts for step s+1 exists (next-router or a head: at layer L-1 of step s; repeat: at layer L), the
  scheduler plans the fill: predicted experts already held are kept, the others go into the least
  recently used slots that no pending graph reads (`Bank.write_buffers` checks it per slot) and no read
  is filling. It takes the write buffers on this thread and submits the reads to the pool. Workers only
  read bytes and widen scales; they return records. At layer L of step s+1 the scheduler runs the event
  loop until that fill has landed (a stall if it has not), then reads any routed expert the prediction
  missed, also through the pool; a routed expert whose slot is still filling is waited for.

Plans are plain dataclasses; only the scheduler, on the loop's thread, changes them.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .trace import NULL, now_us

IO_WORKERS = 2  # pool threads; MLX's CPU backend leaves about one core free (docs/DESIGN.md §15)
QUEUE_DEPTH = 64  # most fills in flight before planning waits for the oldest


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed, else asyncio's default loop."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


@dataclass
class Fill:
    """One bundle read planned into one slot."""

    layer: int  # MoE layer
    expert: int  # expert id
    slot: int  # slot of the bank
    queued_us: float  # when it was submitted


@dataclass
class ReadRecord:
    """What a worker reports back for one fill."""

    fill: Fill
    start_us: float
    end_us: float
    nbytes: int
    cold: float  # fraction of the bundle's pages not in the page cache before the read
    thread: str


@dataclass
class LayerPlan:
    """The fill of one layer's bank for one step."""

    layer: int
    step: int  # the decode step this bank serves
    predicted: np.ndarray  # expert ids the prediction named
    cache: object = None  # the SlotCache filled
    fills: list[Fill] = field(default_factory=list)
    future: asyncio.Future | None = None  # done when every fill has landed
    demand: bool = False  # on-demand reads of misses (not a prediction)


@dataclass
class SchedStats:
    """Counters of one generation, reported in --json and reproduced by `trace summarize`."""

    loads: int = 0  # bundles read by the scheduler (prefetch and on-demand)
    demand_loads: int = 0  # of those, read on demand after a misprediction
    bytes: int = 0
    cold_bytes: float = 0.0
    stall_s: float = 0.0  # time the graph-building thread waited on the pool
    predicted: int = 0  # routed experts that the prediction had named (hits)
    routed: int = 0  # routed experts at layers that had a prediction

    @property
    def recall(self) -> float:
        return self.predicted / self.routed if self.routed else 0.0

    @property
    def cold_fraction(self) -> float:
        return self.cold_bytes / self.bytes if self.bytes else 0.0


class Scheduler:
    """Plans, submits and collects the fills of every prefetching layer; drives its own event loop."""

    def __init__(self, reader, *, workers: int = IO_WORKERS, queue_depth: int = QUEUE_DEPTH, trace=NULL):
        self.reader = reader
        self.loop = new_loop()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edge0-io")
        # misses the step is waiting for never queue behind reads for the next step
        self.demand_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-io-demand")
        self.queue_depth = queue_depth
        self.trace = trace
        self.step = 0  # decode step now being built
        self.plans: dict[tuple[int, int], LayerPlan] = {}  # (layer, step) -> plan
        self.stats = SchedStats()
        self.in_flight = 0

    # -- planning (graph-building thread) ---------------------------------------------------------

    def prefetch(self, layer: int, cache, ids: np.ndarray) -> None:
        """Plan and submit the fill of layer's `cache` with the experts predicted for step + 1."""
        key = (layer, self.step + 1)
        if key in self.plans or len(ids) > cache.bank.slots:  # a multi-token step's union does not fit: skip
            return
        plan = LayerPlan(layer, self.step + 1, ids, cache)
        if self._submit(plan, cache, ids, count=False) is not None:
            self.plans[key] = plan

    def demand(self, layer: int, cache, ids: np.ndarray) -> np.ndarray | None:
        """Make `cache` hold `ids` now (misses read through the pool, waited for); returns their slots, or
        None when the bank cannot take them now (the caller reads them the exact way)."""
        plan = LayerPlan(layer, self.step, ids, cache, demand=True)
        slots = self._submit(plan, cache, ids)
        if slots is None:
            return None
        if plan.future is not None:
            self._wait(plan, "demand")
        ahead = self.plans.get((layer, self.step + 1))  # the only other plan that fills this layer's bank
        if ahead is not None and ahead.future is not None and not ahead.future.done() \
                and cache.filling[slots].any():  # a routed expert's slot is still being filled: wait for it
            self._wait(ahead, "prefetch")
        return slots

    def _submit(self, plan: LayerPlan, cache, ids: np.ndarray, count: bool = True) -> np.ndarray | None:
        got = cache.assign(ids, count=count)
        if got is None:
            return None
        slots, fills = got
        if not fills:
            return slots
        t = now_us()
        plan.fills = [Fill(plan.layer, expert, slot, t) for slot, expert in fills]
        try:
            buffers = [cache.bank.write_buffers(f.slot) for f in plan.fills]  # the write rule is checked here
            while self.in_flight >= self.queue_depth:
                self._drain_one()
        except BaseException:
            cache.forget([f.slot for f in plan.fills])  # assigned, never to be read
            raise
        self.in_flight += 1
        cache.filling[[f.slot for f in plan.fills]] = True
        pool = self.demand_pool if plan.demand else self.pool
        plan.future = self.loop.run_in_executor(pool, _read_fills, self.reader, cache.bank, plan.fills, buffers)
        plan.future.add_done_callback(lambda fut, p=plan: self._collected(p, fut))
        return slots

    # -- collecting (the loop's callbacks, on this same thread) ---------------------------------

    def _collected(self, plan: LayerPlan, fut: asyncio.Future) -> None:
        self.in_flight -= 1
        slots = [f.slot for f in plan.fills]
        plan.cache.filling[slots] = False
        if fut.cancelled() or fut.exception() is not None:
            plan.cache.forget(slots)  # the worker stopped before committing: no slot of the plan holds its bundle
            return
        for r in fut.result():
            self.stats.loads += 1
            self.stats.demand_loads += plan.demand
            self.stats.bytes += r.nbytes
            self.stats.cold_bytes += r.cold * r.nbytes
            if self.trace.on:
                self.trace.span("read", "io", r.start_us, r.end_us, layer=r.fill.layer, expert=r.fill.expert,
                                bytes=r.nbytes, cold=r.cold, queued_us=r.fill.queued_us - self.trace.t0,
                                wait_ms=(r.start_us - r.fill.queued_us) / 1e3, demand=plan.demand, step=plan.step,
                                thread=r.thread)

    def _drain_one(self) -> None:
        pending = [p.future for p in self.plans.values() if p.future is not None and not p.future.done()]
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))

    def _wait(self, plan: LayerPlan, why: str) -> None:
        fut = plan.future
        t0 = now_us()
        waited = not fut.done()
        self.loop.run_until_complete(fut) if not fut.done() else None
        fut.result()  # re-raise a worker's Edge0Error here, on the main thread
        t1 = now_us()
        if waited:
            self.stats.stall_s += (t1 - t0) / 1e6
            if self.trace.on:
                self.trace.span("stall", "stall", t0, t1, layer=plan.layer, why=why)

    # -- consuming ---------------------------------------------------------------------------------

    def ready(self, layer: int) -> LayerPlan | None:
        """Before layer `layer` gathers in this step: wait for its prefetch, if one was planned."""
        plan = self.plans.pop((layer, self.step), None)
        if plan is not None and plan.future is not None:
            self._wait(plan, "prefetch")
        return plan

    def count(self, plan: LayerPlan | None, ids: np.ndarray) -> None:
        if plan is None:
            return
        hit = int(np.isin(ids, plan.predicted).sum())
        self.stats.predicted += hit
        self.stats.routed += len(ids)
        if self.trace.on:
            self.trace.instant("prediction", "predict", layer=plan.layer, step=plan.step, hits=hit, misses=len(ids) - hit)

    def next_step(self) -> None:
        """Called after a decode step has been evaluated."""
        self.loop.run_until_complete(_done())  # run completions that arrived meanwhile
        self.step += 1

    def cancel(self) -> None:
        """Abandon planned fills (a generation ended early); wait for reads in flight so no worker writes later.
        A failed read's error is dropped here (its slots were emptied): nobody consumes that plan."""
        futures = [p.future for p in self.plans.values() if p.future is not None]
        if futures:
            self.loop.run_until_complete(asyncio.wait(futures))
            for fut in futures:
                fut.cancelled() or fut.exception()  # retrieved: asyncio logs no "never retrieved" later
        self.plans.clear()

    def reset(self) -> None:
        """A new generation: nothing planned or in flight, step 0 (plans and decided routings are keyed by step)."""
        self.cancel()
        self.step = 0

    @property
    def pending(self) -> int:
        return sum(1 for p in self.plans.values() if p.future is not None and not p.future.done())

    def close(self) -> None:
        self.cancel()
        self.pool.shutdown(wait=True)
        self.demand_pool.shutdown(wait=True)
        self.loop.close()


async def _done() -> None:
    return None


def _read_fills(reader, bank, fills: list[Fill], buffers: list) -> list[ReadRecord]:
    """Worker thread: read each bundle into its slot's buffers, widen the landed slots. Bytes only."""
    import threading

    name = threading.current_thread().name
    records = []
    for f, bufs in zip(fills, buffers):
        t0 = time.perf_counter() * 1e6
        n, cold = reader.read_bundle(f.layer, f.expert, bufs)
        records.append(ReadRecord(f, t0, time.perf_counter() * 1e6, n, cold, name))
    bank.commit([f.slot for f in fills])
    return records
