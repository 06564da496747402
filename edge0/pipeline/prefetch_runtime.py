"""The runtime of scheduled routing (prefetch, predicted): one Scheduler, the layers' PrefetchExperts
(pipeline/prefetch.py), the predictions in flight, the pause of the reads ahead, the batch's routing history."""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from ..compute.experts import ExactExperts, unique_ids
from ..compute.kernels import host_eval
from ..compute.runtime import Runtime, build_runtime, streamed_slots
from ..errors import Edge0Error, SettingError
from ..sched.loop import SchedLoop
from ..sched.scheduler import QUEUE_DEPTH, Scheduler
from ..sched.trace import NULL, now_us
from .gate import CertainReads, ReadAheadGate, read_ahead_gate
from .handoff import Handoff
from .prefetch import PREDICTORS, Decided, PrefetchExperts, joined_history


class PrefetchRuntime(Handoff, Runtime):
    """A Runtime whose decode steps are driven by the scheduler."""

    sched: Scheduler = None
    heads = None  # HeadSet when predicting with trained heads
    predicted_routing = False
    candidates: int | None = None  # predicted routing: experts read ahead per consumer, its router choosing K (None: K)
    guesses: int | None = None  # experts read ahead per predicted set, the predictor's likeliest (None: all K)
    pending: list  # predictions scheduled in the graph, not yet on the host (set by build_prefetch_runtime)
    _built: dict  # overlapped decode: step -> the fence epoch its graph was built in, until known evaluated
    pull_s = 0.0  # time the graph-building thread waited for predictions to be computed
    # Reading ahead only while it pays. While every bundle of the last PAUSE_AFTER steps came from the page cache (and
    # the gate's warm_pause), a demand read is a cheap copy and the predictor costs more than it can hide: the layers
    # stop predicting until a read comes from the disk again. While reads come from the disk the gate (pipeline/gate.py)
    # measures steps with and without reading ahead and pauses while not reading ahead is faster. Under predicted
    # routing the routing heads keep predicting (their reads planned at the step's end), the guesses pause.
    # --read-ahead always: nothing pauses (gate None); never: every step pauses.
    PAUSE_AFTER = 4
    PAUSE_ON_PROMPT = True  # a prompt whose reads all came from the page cache pauses from the first step
    paused = False  # this step's layers read nothing ahead (routing heads still decide)
    flushed_steps = 0  # steps evaluated (each flushes once)
    paused_steps = 0  # of which run paused (--json)
    gated_steps = 0  # of which paused by the gate (reads from the disk, reading ahead measured slower)
    gate: ReadAheadGate | None = None  # or its NoReadAhead (--read-ahead never)
    _warm = False  # the step being built is paused by a warm page cache
    _warm_steps = 0  # steps since a bundle came from the disk
    _cold_bytes = 0.0  # the pool's cold bytes at the last step boundary
    _prompt_reads = (0, 0.0)  # the reader's (bytes, cold bytes) when the generation began

    def begin(self) -> int:
        gen = super().begin()
        st = self.sched.pool.reader.stats
        self._prompt_reads = (st.bytes, st.cold_bytes)
        if self.gate is not None:
            self.gate.restart()
        return gen

    def end_prefill(self) -> None:
        """The prompt's reads (whole layers, or its experts) tell at once what PAUSE_AFTER steps would: all
        from the page cache, the first decode step is already paused; some from the disk, it is not."""
        super().end_prefill()
        if self.gate is None:
            return
        st, (read0, cold0) = self.sched.pool.reader.stats, self._prompt_reads
        sees = self.sched.pool.reader.sees_cache and self.gate.warm_pause
        if self.PAUSE_ON_PROMPT and sees and st.bytes != read0:
            self._warm_steps = self.PAUSE_AFTER if st.cold_bytes == cold0 else 0
        self._warm = sees and self._warm_steps >= self.PAUSE_AFTER
        self.paused = self._warm or not self.gate.ahead

    # Predicted routing where every layer is routed by its head or holds its experts (set by link): no layer syncs with
    # the host inside a step (a consumer's ids and slots are on the host a step ahead), so decode builds step n+1's
    # graph while step n evaluates (decode/step.py), waiting for a fill only where it has not landed; the fence
    # learns what is evaluated from the predictions pulled (those made in step s follow all of step s-1). A batch's
    # steps overlap up to `_overlap_rows` rows: each streamed bank holds two steps' candidates of every row (the step
    # built ahead reads slots no fill may take until it is evaluated: with less room, its fills would be read again).
    overlaps_steps = False
    _overlap_rows = 0

    def overlaps_batch(self, rows: int) -> bool:
        return self.overlaps_steps and rows <= self._overlap_rows

    def step_built(self) -> None:
        """Overlapped decode: this step's graph is built and queued, the one before it may still be evaluating; the
        next step's graph gets its own fence epoch, so fills avoid the slots of both until they are known evaluated."""
        self._count_step()
        self._built[self.sched.step] = self.fence.advance()
        if self.loop is None or self._advanced:
            self.next_step()
            return
        with self.scheduling(-1):  # the step's end on the loop, not settled: the next layer settles after its wait
            # for MLX, the loop working meanwhile; the step counter is this thread's (the step built next reads it)
            self.deferred += self._take_pending()
            plans = self.books() + self.waiting_plans(self.deferred)
            self.deferred = []
            step = self.sched.step
            self.loop.post("step end", self._end_built, plans, step, step=step, wake=False)
            self.sched.step = step + 1
            self._watch_reads()  # (the pause of the step built next, read by its layers before they settle)

    def _count_step(self) -> None:
        self.flushed_steps += 1
        self.paused_steps += self.paused
        self.gated_steps += self.paused and not self._warm

    def pull(self) -> None:
        """Bring the pending predictions to the host (predicted routing: decide) and settle: the wait for MLX comes
        first, the loop works meanwhile. Their fills are planned with the next `plan_later` (`deferred`)."""
        self.deferred += self._take_pending()
        self.settle()

    def _take_pending(self) -> list:
        """The pending predictions to the host: their ids wait at their consumers, their routing is decided.
        Returns the consumers whose fills may be planned now (each has read its bank this step already)."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        t0 = now_us()
        self.wake()
        host_eval([a for p in pending for a in (p.inds, p.plan, p.scores) if a is not None])  # scheduled already
        if self._built:  # (overlapped decode only)
            self._evaluated_before(min(p.step for p in pending) - 1)
        self.pull_s += (now_us() - t0) / 1e6
        self.span("pull", "compute", t0)
        ready = []
        for p in pending:  # evaluated: the loop makes them numpy where it plans their fills (`plan_waiting`)
            c = p.consumer
            if p.plan is not None:  # a decided routing: its ids are the consumer's a step later (no rank: certain)
                d = c.decided[p.step] = Decided(p.inds, p.plan)
                c.waiting.append((d, p.step, None))
            else:  # a guess: its unique ids and rank made on the loop
                c.waiting.append((p.inds, p.step, p.scores))
            if c.ran >= p.step - 1 and c not in ready:
                ready.append(c)
        return ready

    def _evaluated_before(self, step: int) -> None:
        """Values made in `step`'s graph are on the host: every step before it is evaluated (its token, or the stream's
        order for a forced one, comes first). Overlapped decode: their slots may be written again."""
        done = [s for s in self._built if s < step]
        if done:
            self._fence_after_loop(self.fence.complete, max(self._built[s] for s in done))
            for s in done:
                del self._built[s]

    def flush(self) -> None:
        """Before a step's evaluation (decode/step.py): what the last layers predicted comes to the host here; the
        scheduler's loop ends the step and then plans their fills while this thread waits for MLX to evaluate it.
        The settle after the evaluation waits for the step's end only (the step next built reads its pause); the
        fills run on, and the fence moves after them (`sync`), so the plans are the ones made before."""
        self._count_step()
        if not (self.pending or self.booked or self.deferred or not self.loop.idle or self.sched.plans
                or self.sched.landing):
            return  # nothing to plan or drop, as paused: the books at next_step cost less than a post
        with self.scheduling(-1):
            ready = self._take_pending()  # (waits for MLX: the loop works meanwhile)
            for c in ready:
                c.cache.bank.arrays  # allocated here if not yet: MLX stays on this thread
            plans = self.books() + self.waiting_plans(ready + self.deferred)
            self.deferred = []
            self._advanced = True
            now = self.gate.clock() if self.gate is not None else None
            self.loop.post("step end", self._step_end, now, step=self.sched.step, wake=not plans)
            self._ended = self.loop.posted
            if plans:
                self.loop.post("plan", self._plan, plans, step=self.sched.step)

    def sync(self) -> None:
        self._fence_after_loop(self.fence.sync)

    def _fence_after_loop(self, move, *args) -> None:
        """Graphs are evaluated: the fence moves after the fills the loop still plans (so they avoid the slots those
        graphs read, which the next step most likely reads again, as when planned before), before the next settle."""
        if self.loop is not None and not self.loop.idle:
            self.loop.post("fence", move, *args, step=self.sched.step, wake=False)
        else:
            move(*args)

    def next_step(self) -> None:
        if self._advanced:  # the loop ended the step at its flush: what was predicted after it is planned there too
            self._advanced = False
            if self.pending:
                with self.scheduling(-1):
                    self.deferred += self._take_pending()
                    self.plan_later()
            return
        idle = not self.pending and self.loop_idle  # nothing predicted or planning: no span to time
        with nullcontext() if idle else self.scheduling(-1):
            self.pull()  # whatever was predicted after the flush (the loop's work settled)
            self.plan_later(books=True)
            self.settle()  # (its plans come before the step's end: the loop's, or run here)
            self.sched.next_step()
            self._watch_reads()

    def _watch_reads(self, now: float | None = None) -> None:
        """At a step boundary (at the clock's `now`, default the clock now): whether the next step's layers read
        ahead (PAUSE_AFTER, then the gate)."""
        gate, pool = self.gate, self.sched.pool
        if gate is None:
            return
        was_warm = self._warm
        if pool.reader.sees_cache and gate.warm_pause:
            cold = pool.stats.cold_bytes
            self._warm_steps = 0 if cold > self._cold_bytes else self._warm_steps + 1
            self._cold_bytes = cold
            self._warm = self._warm_steps >= self.PAUSE_AFTER
        if self._warm:
            self.paused = True
            return
        if was_warm:  # the step that ended was paused by the page cache: it says nothing of either mode
            gate.restart()
        self.paused = not gate.step(now)

    def finish(self) -> None:
        self._settle_quietly()
        self._advanced = False
        self.pending, self.deferred = [], []
        self.sched.cancel()
        if self._built:  # overlapped steps: a step built ahead of an early stop may still be computing
            mx.synchronize()
            self.fence.sync()
            self._built = {}

    def reset_pipeline(self) -> None:
        """No read in flight or planned, step 0, no routing history: as a freshly built runtime."""
        self._settle_quietly()
        self._advanced = False
        self.pending, self.deferred = [], []
        self._built = {}
        self.sched.reset()
        for ex in self.executors.values():
            ex.reset()

    # -- batches (serve --max-batch): the routing history's rows follow the batch's sequences ------------

    def snapshot(self, ahead: int = 0) -> dict:
        """Each layer's routing state for the batch's rows: (routed ids at the previous token (B, 1, K) or None,
        the routing decided for step now + ahead or None). ahead=1 after a sequence's first step alone: its
        predictions are pulled, and what they decided for its next step is taken."""
        if ahead:
            self.pull()
            self.plan_later()
        step = self.sched.step + ahead
        return {layer: (ex.prev_inds, ex.decided.get(step)) for layer, ex in self.executors.items()}

    def keep_rows(self, rows: list[int]) -> None:
        """Sequences left the batch: keep the history and the routing decided ahead of the others."""
        if self.gate is not None:
            self.gate.resize(len(rows))
        self.settle()  # (the decided routings' host ids are made on the loop)
        idx = mx.array(rows)
        for ex in self.executors.values():
            ex.prev_inds = ex.prev_inds[idx] if ex.prev_inds is not None else None
            ex.decided = {s: Decided(d.inds[idx], d.plan[idx], d.on_host()[0][rows], unique_ids(d.on_host()[0][rows]))
                          for s, d in ex.decided.items()}

    def join(self, parts: list[tuple[dict, int]]) -> None:
        """The batch becomes the concatenation of (snapshot, rows) parts: their histories (a part without a
        previous token gets rows naming no expert) and, where every part has one, their routing decided for
        the step now (else that layer routes the step with its own router). No parts: a clean slate."""
        self.pending = []  # predictions made for other rows decide nothing
        self.settle()  # (the parts' decided routings' host ids are made on the loop)
        if self.gate is not None and parts:  # (none: a newcomer's clean slate, its prompt next)
            self.gate.resize(sum(n for _, n in parts))
        step = self.sched.step
        for layer, ex in self.executors.items():
            ex.prev_inds = joined_history([(snap[layer][0], n) for snap, n in parts], ex.num_experts)
            decs = [snap[layer][1] for snap, _ in parts]
            ex.decided.clear()
            if decs and all(d is not None for d in decs):
                host = np.concatenate([d.on_host()[0] for d in decs])
                ex.decided[step] = Decided(mx.concatenate([d.inds for d in decs]),
                                           mx.concatenate([d.plan for d in decs]), host, unique_ids(host))

    def link(self, blocks: dict) -> None:
        """Give each layer its block and its successor; heads to their owners; with predicted routing,
        consumer blocks take the routing their owner's head decided (the block's `planned` hook)."""
        order = sorted(self.executors)
        for layer in order:
            self.executors[layer].block = blocks[layer]
        for a, b in zip(order, order[1:]):
            self.executors[a].next = self.executors[b]
        if self.heads is None:
            return
        self._link_heads(blocks)
        self.recount_overlap()

    def recount_overlap(self) -> None:
        """Whether decode steps overlap, and for how many rows, from the layers' routing now (link; edge0/dist after
        it routes a layer by another rank's head)."""
        streamed = [ex for ex in self.executors.values() if ex.held is None]
        self.overlaps_steps = (self.predicted_routing and bool(self.executors)
                               and all(ex.predicted_routing for ex in streamed))
        m = self.candidates or max((ex.block.top_k for ex in streamed), default=1)
        self._overlap_rows = min((ex.cache.bank.slots // (2 * m) for ex in streamed), default=1 << 30)  # (none: any)
        if type(self.gate) is ReadAheadGate and self.overlaps_steps:
            self.gate = CertainReads(self.sched.pool.reader.manifest.bundle_bytes)  # every read ahead is made

    def _link_heads(self, blocks: dict) -> None:
        """Each head to its owner's executor, but a held layer's that only reads ahead; routing heads to their blocks."""
        for consumer, owner in sorted(self.heads.owners.items()):
            if owner not in self.executors or consumer not in self.executors:
                raise Edge0Error(f"head for layer {consumer} (owned by layer {owner}): the store has no such MoE layer")
            ex = self.executors[consumer]
            routes = self.heads.routes is None or consumer in self.heads.routes  # else the head only reads ahead
            if ex.held is not None and not (routes and self.predicted_routing):
                continue  # every expert held: nothing to read ahead
            self.executors[owner].heads.append((self.heads.heads[consumer], ex))
            ex.predicted_routing = self.predicted_routing and routes
            if ex.predicted_routing:
                blocks[consumer].planned = ex.planned
                if hasattr(blocks[consumer], "choose"):
                    blocks[consumer].candidates = self.candidates
                ex.planned_by = self.executors[owner]
                self.executors[owner].routes_ahead = True

    def close(self) -> None:
        self._settle_quietly()
        if self.loop is not None:
            self.loop.close()
            self.loop = None
        self.sched.close()
        super().close()
        for ex in self.executors.values():  # their links to this runtime, each other and their blocks are cycles: a
            ex.unlink()  # closed engine is freed by refcount alone, not at the garbage collector's next pass
        self.booked, self.deferred, self.pending = [], [], []


def build_prefetch_runtime(reader, compute_dtype, *, predictor: str = "next-router", memory_budget_gib=None,
                           slots: int | None = None, queue_depth: int = QUEUE_DEPTH, trace=NULL, heads=None,
                           predicted_routing: bool = False, guesses: int | None = None, top_k: int | None = None,
                           candidates: int | None = None, read_ahead: str = "measured", placement: str = "auto",
                           **_) -> PrefetchRuntime:
    """One bank per MoE layer (as staged) filled through the store's I/O pool, whole-layer prefill.

    heads: a HeadSet (predictor "heads" and predicted routing need one). guesses: read ahead only the predictor's
    N likeliest experts of each predicted set (None: all K). top_k: the K routed (None: the model's).
    candidates: predicted routing reads ahead each head's M likeliest experts, its consumer's router choosing K
    of them (None: K). read_ahead: measured (pause while not reading ahead is faster, or the page cache
    serves every read), always or never. placement: auto holds every expert of the layers no head routes, where
    that fits (held_layers); even gives every layer `slots`."""
    if predictor not in PREDICTORS:
        raise SettingError(f"{{routing.predictor}} {predictor}: choose {', '.join(PREDICTORS)}")
    if (predictor == "heads" or predicted_routing) and heads is None:
        raise SettingError("predicting with heads needs a head file: {routing.heads} (train one with `edge0 train heads`)")
    k = top_k or reader.manifest.top_k
    if guesses is not None and (predicted_routing or not 1 <= guesses <= k):
        why = "predicted routing reads what its heads route" if predicted_routing else f"between 1 and K = {k}"
        raise SettingError(f"{{routing.guesses}} {guesses}: {why}")
    held = held_layers(reader.manifest, heads, slots, candidates or k) if heads and placement == "auto" else ()
    base = build_runtime(reader, "staged", compute_dtype, memory_budget_gib=memory_budget_gib, slots=slots, held=held)
    rt = PrefetchRuntime("staged", base.fence, {}, banks=base.banks, held=base.held, stats=base.stats,
                         prefill=base.prefill)
    rt.pending, rt.deferred, rt.booked = [], [], []
    rt._built = {}
    rt.sched = Scheduler(reader.pool, queue_depth=queue_depth, trace=trace)
    reader.pool.trace = trace
    rt.trace = trace
    rt.loop = SchedLoop(trace=trace)
    rt.heads = heads
    rt.predicted_routing = predicted_routing
    rt.candidates = candidates
    rt.guesses = None if guesses == k else guesses
    full = all(b.slots >= reader.manifest.num_experts for b in base.banks)  # nothing to read ahead once filled
    rt.gate = read_ahead_gate(read_ahead, full=full and not predicted_routing)
    for layer, staged in base.executors.items():
        if layer in base.held:
            exact = ExactExperts(reader, layer, compute_dtype)  # its quantization and experts (nothing is read)
            rt.executors[layer] = PrefetchExperts(layer, None, rt, exact, None, predictor, held=staged)
            continue
        rt.executors[layer] = PrefetchExperts(layer, staged.cache, rt, staged.exact, base.prefill, predictor, staged)
    return rt


def held_layers(m, heads, slots: int | None, candidates: int) -> tuple:
    """--placement auto with heads: the layers no head routes (under predicted routing their own router decides,
    so their reads can only be guessed ahead, and each costs a host sync and a wait for the disk inside the step;
    under prefetch routing their heads are the weak ones) hold every expert, where that fits in the memory of
    `slots` per layer (default 2K) and leaves each other layer at least twice its candidates (a step's and the
    next's), S >= E too (a bank holding every expert still syncs with the host at each step; a held layer does not)."""
    layers = [e.layer for e in m.layers]
    routed = set(heads.owners if heads.routes is None else heads.routes) & set(heads.owners)
    own = tuple(layer for layer in layers if layer not in routed)
    if not own or len(own) == len(layers):
        return ()
    return own if streamed_slots(slots or 2 * m.top_k, len(layers), len(own), m.num_experts) >= 2 * candidates else ()
