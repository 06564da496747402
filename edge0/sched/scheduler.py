"""The I/O scheduler: one-token-ahead fills of idle slots, read by the store's I/O pool.

The rule of the pipeline, written once:
  Layer L owns one bank of S slots (default 2K). During step s, as soon as a prediction of layer L's
  experts for step s+1 is on the host (a head or next-router, made at the MoE layer before L, or at the
  last layer for the first one; repeat: at layer L itself), the scheduler plans the fill: predicted
  experts already held stay; the others go into the least recently used slots (for a guess: those holding
  the experts its scores rank lowest) that no pending graph reads (the write rule, `Bank.write_buffers`), no
  read is filling and no plan has reserved for step s. A plan's
  slots stay reserved until its step consumes them. Each bundle is one task on the I/O pool (io/pool.py),
  so a layer's fills run at a queue depth of up to the pool's threads. At layer L of step s+1 the
  graph-building thread waits for that plan only if its reads have not landed (a stall), then reads what
  the prediction missed as demand reads, which the pool runs before any prefetch. A speculative plan (a
  guess the router may not follow: prefetch routing) is not waited for as a whole: once the layer has routed,
  its reads of experts the router chose are waited for, its reads not started yet of the others are taken
  back, and those already running land in the background (their slots stay `filling` until then).

Threads: the scheduler has its own event loop (sched/loop.py, the trace's `loop` lane), and one owner at a time. The
  graph-building thread hands the step's last predictions to it at the step's end, and the loop plans their fills,
  ends the step (`next_step`) and keeps the read-ahead gate's books while MLX evaluates it (pipeline/prefetch_runtime.py);
  the step's end settles that work before the scheduler is touched again. Inside a step, the fills a layer plans once
  it has read its bank are planned on the loop too (the next layer settles first), the pulled predictions made
  numpy there; consuming plans and demand reads (the trace's `sched` span) run on the graph-building thread, between
  graphs, their books (`consumed`, `looked_up`, a demand read's collection) on the loop after. Where no layer syncs
  inside a step (predicted routing, every layer routed by its head or holding its experts), decode builds step s+1
  while step s evaluates (decode/step.py): the step's end (`end_step`, its last fills) goes to the loop once the step
  is built, unsettled, the graph-building thread moving `step` on itself, and a fill's wait for its reads overlaps the
  step before's compute; a plan whose reads have landed is taken from its `ReadGroup`'s count (`take`). Workers read
  bytes into slots, widen bf16 scales, fill in their task's outcome; they never touch plans or caches. A planned read
  that cannot start now (too few free slots, QUEUE_DEPTH reads in flight) is dropped: the layer reads it on demand.

Plans are plain dataclasses; only this class changes them, on one thread at a time (the loop's or the graph's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..io.pool import ReadGroup, ReadTask
from .trace import NULL

QUEUE_DEPTH = 64  # most prefetch reads in flight; a plan beyond it is dropped (the layer reads on demand)


def _mark(flags: np.ndarray, slots: list[int], value: bool) -> None:
    """flags[slots] = value for a plan's few slots, one by one (a fancy index costs several times more after a wait
    for MLX)."""
    for s in slots:
        flags[s] = value


@dataclass
class LayerPlan:
    """The reads that make one layer's bank hold a set of experts for one step."""

    layer: int  # MoE layer
    step: int  # the decode step it serves
    predicted: np.ndarray  # expert ids (unique) the plan makes the bank hold
    cache: object  # the SlotCache filled
    slots: np.ndarray  # slot of each id of `predicted`
    fills: list[tuple[int, int]] = field(default_factory=list)  # (slot, expert) of each read
    tasks: list[ReadTask] = field(default_factory=list)  # one per fill, until collected
    demand: bool = False  # read for the step being built (misses), not ahead
    speculative: bool = False  # a guess: consumed without waiting for the reads the router did not choose
    clean: bool = True  # no slot it found holding was being filled then, no read of it emptied its slot (`take`)
    group: ReadGroup | None = None  # its reads counted down as they land (`take`: no walk over its tasks)
    table: object = None  # a decided routing's slot table (E,), made on the loop with the plan (pipeline/prefetch.py)


@dataclass
class SchedStats:
    """Counters of one generation, reported in --json and reproduced by `trace summarize`."""

    loads: int = 0  # bundles the scheduler read (prefetch and on demand); bytes: the pool's LoadStats
    demand_loads: int = 0  # of those, read for the step being built (the prediction missed them)
    stall_s: float = 0.0  # time the graph-building thread waited on reads
    predicted: int = 0  # routed experts that the prediction had named (hits)
    routed: int = 0  # routed experts at layers that had a prediction
    dropped: int = 0  # plans not made: too few free slots or too many reads in flight

    @property
    def recall(self) -> float:
        return self.predicted / self.routed if self.routed else 0.0


class Scheduler:
    """Plans, submits and collects the fills of every prefetching layer."""

    def __init__(self, pool, *, queue_depth: int = QUEUE_DEPTH, trace=NULL):
        self.pool = pool  # io.pool.ReadPool
        self.queue_depth = queue_depth
        self.trace = trace
        self.step = 0  # decode step now being built
        self.plans: dict[tuple[int, int], LayerPlan] = {}  # (layer, step) -> plan not consumed yet
        self.landing: list[LayerPlan] = []  # speculative plans consumed while some of their reads still run
        self.stats = SchedStats()
        self.in_flight = 0  # reads submitted and not yet collected

    # -- planning -------------------------------------------------------------------------------------

    def prefetch(self, layer: int, cache, ids: np.ndarray, step: int | None = None,
                 speculative: bool = True, rank: np.ndarray | None = None) -> LayerPlan | None:
        """Plan and submit the fill of layer's `cache` with experts `ids` (unique) for `step` (default the next).
        speculative: a prediction the router may not follow (its reads yield to certain ones, io/pool.py).
        rank: the predictor's score of every expert for that step: the fills replace the held experts it scores
        lowest (a guess's reads would otherwise evict the least recently used, which the router often wants)."""
        step = self.step + 1 if step is None else step
        key = (layer, step)
        if key in self.plans:
            return None
        self._harvest(layer)
        got = None
        if len(ids) <= cache.bank.slots and self.in_flight < self.queue_depth:
            got = cache.assign(ids, count=False, rank=rank)
        if got is None:  # a multi-token step's union that does not fit, or no free slots now
            self.stats.dropped += 1
            return None
        slots, filling = got[0].tolist(), cache.filling.item  # (a few slots: item by item, see demand_begin)
        plan = LayerPlan(layer, step, ids, cache, got[0], got[1], speculative=speculative,
                         clean=not any(filling(s) for s in slots))  # (its own fills' slots are not filling yet)
        self._submit(plan, demand=False)
        _mark(cache.reserved, slots, True)
        self.plans[key] = plan
        return plan

    def held(self, layer: int, cache, ids: np.ndarray, books: list) -> np.ndarray | None:
        """A layer routed by its own router, with the least work on the graph-building thread: where `cache` holds every
        one of `ids` (unique) whole (no read filling its slot) and this step's plan of `layer`, if any, is a guess,
        their slots; that plan is taken out of `plans`, and the books (`looked_up`) appended to `books` for the loop,
        ahead of any plan of the bank. None: `ready` and `demand_begin`'s way."""
        key = (layer, self.step)
        plan = self.plans.get(key)
        if plan is not None and not plan.speculative:
            return None
        at = cache.slot_of.item  # (one lookup per id: a fancy index costs more on a handful)
        slots = [at(k) for k in ids.tolist()]
        if min(slots) < 0 or (self.in_flight and any(cache.filling.item(s) for s in slots)):
            return None
        self.plans.pop(key, None)
        slots = np.array(slots, dtype=np.int64)
        books.append(partial(self.looked_up, layer, cache, ids, slots, plan))
        return slots

    def looked_up(self, layer: int, cache, ids: np.ndarray, slots: np.ndarray, plan: LayerPlan | None) -> None:
        """The books of a lookup `held` found whole (on the loop), as `ready`, `count` and `demand_begin` keep them: the
        guess planned for it released (its reads of experts not routed taken back), counted, the bank's recency."""
        if plan is not None:
            self._unreserve(plan)
            if plan.tasks:
                self.landing.append(plan)
        if self.landing:
            self._take_back(layer, ids)
        self._harvest(layer)
        self.count(plan, ids)
        cache._used(slots, len(slots))

    def demand(self, layer: int, cache, ids: np.ndarray) -> np.ndarray | None:
        """Make `cache` hold `ids` (unique) now: misses read on demand, in parallel, and waited for; returns
        their slots, or None when the bank cannot take them now (the caller reads them the exact way)."""
        got = self.demand_begin(layer, cache, ids)
        if got is None:
            return None
        slots, reads = got
        self.demand_end(reads)
        return slots

    def demand_begin(self, layer: int, cache, ids: np.ndarray) -> tuple[np.ndarray, LayerPlan | None] | None:
        """`demand` in two halves: this one assigns the slots of `ids` (unique) and returns them with the plan
        of the misses' reads (None when every one is held), not yet started; None when the bank cannot take
        them now. Between the halves the caller may build graphs on the held slots only; `demand_end` (or, on
        an error, `cache.forget` of the plan's slots) must follow."""
        if self.landing:
            self._take_back(layer, ids)
        self._harvest(layer)  # reads landed or taken back: their slots are free again
        got = cache.assign(ids)
        if got is None:
            return None
        slots, fills = got
        filling = cache.filling.item  # (item by item: on a few ids a fancy index and a reduction cost 10x more)
        if self.in_flight and any(filling(s) for s in slots.tolist()):  # a routed expert's slot is still being filled
            self._wait_filling(layer, cache, slots)
        return slots, LayerPlan(layer, self.step, ids, cache, slots, fills, demand=True) if fills else None

    def demand_end(self, reads: LayerPlan | None, books: list | None = None) -> None:
        """`demand`'s second half: read the misses in parallel and wait for them. books: where they all landed, their
        collection (slots no longer filling, counts) is appended there for the scheduler's loop, not made here."""
        if reads is None:
            return
        before = self.pool.waited_s
        self._submit(reads, demand=True)  # a read the pool makes on this thread is a stall too
        if books is not None:
            try:
                self.pool.wait(reads.tasks, layer=reads.layer, why="demand")
            except Exception:  # (a Ctrl-C goes on up: the generation's end waits for the reads)
                pass  # collected below: the failed slots emptied, the error raised
            else:
                self.stats.stall_s += self.pool.waited_s - before
                books.append(partial(self._collect, reads, None))
                return
        self.stats.stall_s += self.pool.waited_s - before
        self._collect(reads, "demand")

    def _submit(self, plan: LayerPlan, demand: bool) -> None:
        cache, bank = plan.cache, plan.cache.bank
        try:
            buffers = [bank.write_buffers(slot) for slot, _ in plan.fills]  # the write rule is checked here
        except BaseException:
            cache.forget([slot for slot, _ in plan.fills])  # assigned, never to be read
            raise
        _mark(cache.filling, [slot for slot, _ in plan.fills], True)
        plan.group = group = ReadGroup(len(plan.fills))
        plan.tasks = self.pool.run([ReadTask(plan.layer, expert, bufs, demand=demand, step=plan.step,
                                             speculative=plan.speculative, commit=(bank, [slot]), group=group)
                                    for (slot, expert), bufs in zip(plan.fills, buffers)])
        self.in_flight += len(plan.fills)

    # -- collecting -----------------------------------------------------------------------------------

    def _collect(self, plan: LayerPlan, why: str | None, only=None) -> None:
        """Apply a plan's reads, all of them or those filling the slots in `only` (waiting for them first, as a
        stall when `why` names one); a failed read empties its slot, as does a read taken back before it
        started, and the first error is raised once every read collected has stopped."""
        picked = [i for i, ((slot, _), t) in enumerate(zip(plan.fills, plan.tasks))
                  if t is not None and (only is None or slot in only)]
        if not picked:
            return
        tasks = [plan.tasks[i] for i in picked]
        if why is not None:
            before = self.pool.waited_s
            try:
                self.pool.wait(tasks, layer=plan.layer, why=why)
            except Exception:  # (a Ctrl-C goes on up: the generation's end waits for the reads)
                pass  # raised below, after the plan's slots are consistent
            self.stats.stall_s += self.pool.waited_s - before
        else:
            self.pool.finish(tasks)
        error = None
        for i in picked:
            slot, task = plan.fills[i][0], plan.tasks[i]
            plan.tasks[i] = None
            plan.cache.filling[slot] = False
            if task.error is not None or task.record is None:  # failed, or taken back: the slot holds no bundle
                plan.cache.forget([slot])
                plan.clean = False
                error = error or task.error
                continue
            self.stats.loads += 1
            self.stats.demand_loads += plan.demand
        if all(t is None for t in plan.tasks):
            plan.tasks = []
        self.in_flight -= len(picked)
        if error is not None:
            self._unreserve(plan)
            raise error

    def _harvest(self, layer: int) -> None:
        """Collect this layer's reads that have landed: their slots stop counting as filling."""
        for plan in [*self.plans.values(), *self.landing] if self.in_flight else ():  # (none: no read to collect)
            if plan.layer == layer and plan.tasks:
                landed = {s for (s, _), t in zip(plan.fills, plan.tasks) if t is not None and t.done}
                if landed:
                    self._collect(plan, None, landed)
        if self.landing:
            self.landing = [p for p in self.landing if p.tasks]

    def _wait_filling(self, layer: int, cache, slots: np.ndarray) -> None:
        """Wait for the reads still filling `slots` (experts the layer routed to now), and only for those."""
        wanted = set(slots.tolist())
        for plan in [*self.plans.values(), *self.landing]:
            if plan.layer == layer and plan.tasks:
                self._collect(plan, "prefetch", wanted)
        self.landing = [p for p in self.landing if p.tasks]

    def _take_back(self, layer: int, ids: np.ndarray) -> None:
        """A consumed guess's reads of experts the router did not choose (not in `ids`): those not started are
        taken back from the pool; running ones land in the background."""
        keep = None  # (made only where a guess of this layer still has reads: most layers have none)
        for plan in self.landing:
            if plan.layer == layer:
                keep = set(ids.tolist()) if keep is None else keep
                gone = [t for (_, e), t in zip(plan.fills, plan.tasks) if t is not None and not t.done
                        and e not in keep]
                if gone:  # (a landed read is in no queue of the pool's)
                    self.pool.cancel(gone)

    # -- consuming ------------------------------------------------------------------------------------

    def ready(self, layer: int) -> LayerPlan | None:
        """Before layer `layer` gathers in this step: its planned fill, landed (waited for if not)."""
        plan = self.plans.pop((layer, self.step), None)
        if plan is None:
            return None
        if plan.speculative:  # the reads the router chooses are waited for in `demand`, the others taken back
            self._unreserve(plan)
            if plan.tasks:
                self.landing.append(plan)
            return plan
        try:
            self._collect(plan, "prefetch")
        finally:
            self._unreserve(plan)  # the caller reads them now: the write rule protects them from here
        return plan

    def take(self, layer: int, ids: np.ndarray) -> LayerPlan | None:
        """`ready` for a certain plan made for exactly `ids` (the same array: a routing decided a step ahead), on
        the graph-building thread with the least work: its reads waited for (a stall) where its group says some
        have not landed, and refused where one failed or was taken back; the books (`consumed`) are the caller's to
        hand to the scheduler's loop, before its next plan of the bank. None where no such plan landed whole (a
        read failed, a slot still filling): then `ready` takes it."""
        key = (layer, self.step)
        plan = self.plans.get(key)
        if plan is None or plan.speculative or plan.predicted is not ids or not plan.clean:
            return None
        if plan.group.left:  # some reads still running (landed: two fields read, no lock, no walk)
            before = self.pool.waited_s
            try:
                self.pool.wait([t for t in plan.tasks if t is not None], layer=layer, why="prefetch")
            except Exception:
                return None  # `ready` collects it and raises the error
            finally:
                self.stats.stall_s += self.pool.waited_s - before
        if plan.group.failed:
            return None  # failed or taken back: its slot holds nothing
        del self.plans[key]
        return plan

    def consumed(self, plan: LayerPlan) -> None:
        """The books of a plan `take` consumed (on the loop): its reads collected, its slots released, counted as
        hits and as the bank's most recently used (as `ready`, `count` and the bank's `holding` do)."""
        self._collect(plan, None)
        self._unreserve(plan)
        self.count(plan, plan.predicted)
        plan.cache._used(plan.slots, len(plan.slots))  # the bank's `holding`, its checks made by `take`

    def _unreserve(self, plan: LayerPlan) -> None:
        """Release a plan's slots, except those another plan of the same bank still holds for its step."""
        cache = plan.cache
        _mark(cache.reserved, plan.slots.tolist(), False)
        for other in self.plans.values():
            if other.cache is cache and other is not plan:
                cache.reserved[other.slots] = True

    def count(self, plan: LayerPlan | None, ids: np.ndarray) -> None:
        if plan is None:
            return
        hit = len(set(ids.tolist()).intersection(plan.predicted.tolist()))  # ids unique; np.isin costs 30x on a few ids
        self.stats.predicted += hit
        self.stats.routed += len(ids)
        if self.trace.on:
            self.trace.instant("prediction", "predict", layer=plan.layer, step=plan.step, hits=hit,
                               misses=len(ids) - hit)

    def next_step(self) -> None:
        """Called after a decode step has been evaluated: plans of this step that no layer consumed are dropped."""
        self.end_step(self.step)
        self.step += 1

    def end_step(self, step: int) -> None:
        """Plans of `step` and before that no layer consumed are dropped. Where steps overlap this runs on the loop
        while the graph-building thread, which owns `step`, builds the next one (so nothing here reads `step`)."""
        for key in [k for k in self.plans if k[1] <= step]:
            self._drop(self.plans.pop(key))  # popped first: _unreserve keeps only the others' slots

    def _drop(self, plan: LayerPlan) -> None:
        try:
            self._collect(plan, None)
        except Exception:
            pass  # nobody consumes this plan: its failed slots were emptied
        self._unreserve(plan)

    def cancel(self) -> None:
        """Abandon every plan (a generation ended); waits for reads in flight so no worker writes later. A
        failed read's error is dropped here (its slot was emptied): nobody consumes that plan."""
        plans = [*self.plans.values(), *self.landing]
        self.plans.clear()
        self.landing = []
        for plan in plans:
            self._drop(plan)

    def reset(self) -> None:
        """A new generation: nothing planned or in flight, step 0."""
        self.cancel()
        self.step = 0

    def busy(self, layer: int) -> bool:
        """Whether a plan of `layer` (for any step) waits to be consumed or still has reads landing."""
        if not self.plans and not self.landing:
            return False
        return any(p.layer == layer for p in [*self.plans.values(), *self.landing])

    @property
    def pending(self) -> int:
        """Plans with a read still running."""
        return sum(1 for p in [*self.plans.values(), *self.landing] if any(t is not None and not t.done for t in p.tasks))

    def close(self) -> None:
        self.cancel()
