"""`--routing prefetch` and `--routing predicted` under the scheduler.

prefetch: the model's own router decides, predicted experts are read one token ahead; output is
token-identical to native routing. predicted: at consumer layers the prerouter head's prediction *is*
the routing, so the staged set is the routed set and nothing is read on demand there.

Predictors (given what is known at layer L of step s, name a layer's experts for step s+1):
  repeat       layer L at s+1 uses what it used at s (known once layer L has routed at s).
  next-router  layer L+1's own router applied to layer L's MoE input at s: what an untrained
               prerouter head computes (known at layer L of step s, a full layer earlier).
  heads        trained prerouter heads: each owned by one MoE layer and consumed by another at the next
               step (the layer after it, or the first layer for a head owned by the last); next-router
               for layers without one.

Host round trips. A prediction is a graph node; it is scheduled before its layer's experts (its own
`mx.async_eval`: within one call MLX interleaves the outputs' graphs, so the prediction would wait for the
experts) and brought to the host by the next MoE layer (`pull`), by which time the stream has usually
computed it, or at the end of the step. Pulling an already scheduled array waits for that array only,
never for the work queued after it. A layer whose routing its owner's
head decided a step ahead (predicted routing) knows its ids and slots on the host already: its graph is
built with no host round trip at all. Only layers that route with their own router sync (`SYNC`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..compute.banks import Fence
from ..compute.executors import SlotCache, WholeLayer, held_first
from ..compute.experts import ExactExperts, bank_positions, switch_glu
from ..compute.kernel import current
from ..compute.runtime import Runtime, build_runtime
from ..errors import Edge0Error
from ..sched.scheduler import QUEUE_DEPTH, Scheduler
from ..sched.trace import NULL, now_us

PREDICTORS = ("repeat", "next-router", "heads")


@dataclass
class Decided:
    """A layer's routing for one step, decided a step ahead by its owner's head (predicted routing)."""

    inds: mx.array  # (B, 1, K) routed ids, evaluated
    plan: mx.array  # what the block's `planned` hook returns beside them (weights, or logits)
    host: np.ndarray  # inds on the host
    ids: np.ndarray  # their unique ids


@dataclass
class Prediction:
    """A prediction of one layer's experts for one step, still a graph node."""

    consumer: "PrefetchExperts"  # the layer it names experts for
    step: int  # the step it is for
    inds: mx.array  # (B, T, K) predicted ids
    plan: mx.array | None  # the consumer block's decision beside them (predicted routing), else None


class PrefetchExperts:
    """One MoE layer under the scheduler: gather from its bank, prefetched during the step before."""

    def __init__(self, layer: int, cache: SlotCache, rt: "PrefetchRuntime", exact: ExactExperts,
                 prefill: WholeLayer | None, predictor: str, staged=None):
        self.layer, self.cache, self.rt = layer, cache, rt
        self.staged = staged  # the staged executor on the same bank: the whole layer while prefetch is paused
        self.exact, self.prefill, self.predictor = exact, prefill, predictor
        self.quant = exact.quant
        self.num_experts = exact.num_experts
        self.block = None  # this layer's MoE block (its router: logits, select, decide)
        self.next: PrefetchExperts | None = None  # the next MoE layer's executor (next-router predicts it)
        self.heads: list[tuple] = []  # (head, consumer executor) of the heads this layer owns
        self.prev_inds = None  # this layer's routed ids at the previous token (head features)
        self.decided: dict[int, Decided] = {}  # step -> routing decided for this layer by its owner's head
        self.answered = -1  # the step whose block call took the decided routing (`planned`)
        self.ran = -1  # the last step whose graph this layer built from its bank
        self.waiting: list[tuple[np.ndarray, int, bool]] = []  # (ids, step, speculative): planned once this layer
        # has run this step

    def reset(self) -> None:
        """A new generation: no previous token, no routing decided ahead."""
        self.prev_inds = None
        self.decided.clear()
        self.answered = -1
        self.ran = -1
        self.waiting = []

    def planned(self):
        """The block's hook: routing decided for this layer at the step before, for the step now built."""
        step = self.rt.sched.step
        for old in [s for s in self.decided if s < step]:
            del self.decided[old]
        d = self.decided.get(step)
        if d is None:
            return None
        self.answered = step
        return d.inds, d.plan

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.prefill is not None and self.prefill.wants(inds):
            self.prev_inds = inds[..., -1:, :]
            return self.prefill(self.layer, x, inds)
        rt, sched, step = self.rt, self.rt.sched, self.rt.sched.step
        if (rt.paused and self.staged is not None and self.planned_by is None and not self.routes_ahead
                and not self.waiting and not sched.busy(self.layer)):
            self.ran = step  # paused with nothing planned here: native routing on the same bank, no scheduler
            self.prev_inds = inds[..., -1:, :]
            return self.staged(x, inds)
        d = self.decided.get(step) if self.answered == step else None
        if d is not None:  # decided a step ahead: ids and slots are on the host already
            host, ids = d.host, d.ids
        else:
            t0 = now_us()
            mx.eval(inds)  # SYNC: the routed ids to the host (this layer routes with its own router)
            rt.span(f"eval L{self.layer}", "compute", t0)
            rt.fence.sync()
            host = np.array(inds, copy=False)
            ids = np.unique(host)
        with rt.scheduling(self.layer):
            if not rt.paused:  # the predictions made at earlier layers become plans (paused: at the step's end,
                rt.pull()  # as reads from the page cache hide nothing: one wait for the heads, not one per layer)
            plan = sched.ready(self.layer)  # this layer's fill, planned during the step before: landed
            sched.count(plan, ids)
            cache = self.cache
            got = sched.demand_begin(self.layer, cache, ids) if len(ids) <= cache.bank.slots else None
        if got is None:  # more experts than slots, or too few writable: read them the exact way
            self.prev_inds = inds[..., -1:, :]
            return self.exact.compute(x, host, ids)
        slots, reads = got
        fills = reads.fills if reads is not None else []
        try:  # the held experts compute while the rest are read from the disk
            early = held_first(self.exact.reader, self.layer, x, host, ids, slots, cache.bank, fills, self.quant)
        except BaseException:
            cache.forget([slot for slot, _ in fills])  # assigned, never to be read
            raise
        with rt.scheduling(self.layer):
            sched.demand_end(reads)
        arrays = cache.bank.read(slots)  # marked read: the next fills avoid these slots
        self.ran = step
        if self.waiting:
            with rt.scheduling(self.layer):
                self.plan_waiting()
        predictions = self._predict(x, inds, ids) if inds.shape[-2] == 1 else []
        self.prev_inds = inds[..., -1:, :]
        y = early() if early is not None else switch_glu(x, bank_positions(host, ids, slots), arrays, self.quant)
        t0 = now_us()
        if predictions:  # scheduled apart, before the experts: one async_eval runs its outputs' graphs interleaved
            mx.async_eval(*(a for p in predictions for a in (p.inds, p.plan) if a is not None))
        mx.async_eval(y)  # returns once MLX's queue has room: a long wait means the stream is busy (good)
        rt.span(f"queue L{self.layer}", "compute", t0)
        return y

    def plan_waiting(self) -> None:
        """Plan the fills predicted for this layer's next step. Only once the layer has read its bank this
        step: before that, its last routed set is what the coming step most likely reuses, and a fill may not
        evict it (with 2K slots it would: K are planned for this step, K hold the last routed set)."""
        for ids, step, speculative in self.waiting:
            self.rt.sched.prefetch(self.layer, self.cache, ids, step=step, speculative=speculative)
        self.waiting = []

    def _predict(self, x: mx.array, inds: mx.array, ids: np.ndarray) -> list[Prediction]:
        """The graphs of this layer's predictions for the next step (pulled later), and repeat's plan. Paused,
        only the heads whose prediction is their consumer's routing (predicted routing) run."""
        rt, step, n = self.rt, self.rt.sched.step, self.rt.guesses
        out = []
        for head, consumer in self.heads:
            if rt.paused and not consumer.predicted_routing:
                continue
            blk = consumer.block
            router = blk.logits(x)  # (B, 1, E) the consumer's router on this layer's input
            scores = _per_row(head, x, inds, self.prev_inds, router)
            if n is not None:  # a guess: the head's n likeliest experts
                out.append(Prediction(consumer, step + 1, _likeliest(scores, n), None))
                continue
            decide = getattr(blk, "decide", None) or blk.select
            p_inds, plan = decide(scores)
            out.append(Prediction(consumer, step + 1, p_inds, plan if consumer.predicted_routing else None))
        owned = {c.layer for _, c in self.heads}
        if rt.paused:
            pass
        elif self.next is not None and self.next.layer not in owned and self.predictor in ("next-router", "heads"):
            blk = self.next.block
            p_inds = blk.route(x)[0] if n is None else _likeliest(blk.logits(x), n)
            out.append(Prediction(self.next, step + 1, p_inds, None))  # (B, T, K or n)
        elif self.predictor == "repeat":
            with rt.scheduling(self.layer):
                rt.sched.prefetch(self.layer, self.cache, ids)  # all held already: the reuse is the prediction
        rt.pending.extend(out)
        return out

    predicted_routing = False  # this layer routes by its owner's head (routing=predicted)
    planned_by = None  # the executor of the layer whose head decides this one's routing (predicted routing)
    routes_ahead = False  # this layer owns a head that decides its consumer's routing (predicted routing)


def _likeliest(scores: mx.array, n: int) -> mx.array:
    """The ids of the n highest scores on the last axis (unordered)."""
    return mx.argpartition(-scores, kth=n - 1, axis=-1)[..., :n]


def _per_row(head, x: mx.array, inds: mx.array, prev: mx.array | None, router: mx.array) -> mx.array:
    """The head on a batch's sequences, each as it would run alone: MLX's float matmul over B rows may round
    differently from one row's, and a head's top-k flips on such a difference, so a batched sequence would route
    (and answer) otherwise than alone. On the edge0 kernel the head's linears are row-independent (one node for
    the batch); on MLX's, each sequence is run apart."""
    if x.shape[0] == 1 or current().edge0:
        return head.predict(x, inds, prev, router)
    return mx.concatenate([head.predict(x[i:i + 1], inds[i:i + 1], None if prev is None else prev[i:i + 1],
                                        router[i:i + 1]) for i in range(x.shape[0])])


class PrefetchRuntime(Runtime):
    """A Runtime whose decode steps are driven by the scheduler."""

    sched: Scheduler = None
    heads = None  # HeadSet when predicting with trained heads
    predicted_routing = False
    guesses: int | None = None  # experts read ahead per predicted set, the predictor's likeliest (None: all K)
    pending: list  # predictions scheduled in the graph, not yet on the host (set by build_prefetch_runtime)
    sched_s = 0.0  # the scheduler's time on the graph-building thread, stalls and pulls excluded
    sched_cpu_s = 0.0  # of which CPU time of that thread (the rest: waiting for a lock, or for a core)
    pull_s = 0.0  # time the graph-building thread waited for predictions to be computed
    # Reading ahead only while reads cost. Prefetch hides reads from the disk; while every bundle read of
    # the last PAUSE_AFTER steps came from the page cache (a warm store that fits in memory) a demand read
    # is a copy of microseconds, and the predictor (its graphs, pulls and plans) costs more than it can
    # hide: the layers stop predicting until a read comes from the disk again. Under predicted routing the
    # heads that route keep predicting (their prediction is the routing); the read-ahead ones pause (the
    # next-router guesses for layers without a routing head). With --io direct or --io-throttle every read
    # costs: nothing pauses.
    PAUSE_AFTER = 4
    PAUSE_ON_PROMPT = True  # a prompt whose reads all came from the page cache pauses from the first step
    paused = False  # this step's layers read nothing ahead (routing heads still decide)
    paused_steps = 0  # steps run paused (--json)
    _warm_steps = 0  # steps since a bundle came from the disk
    _cold_bytes = 0.0  # the pool's cold bytes at the last step boundary

    _prompt_reads = (0, 0.0)  # the reader's (bytes, cold bytes) when the generation began

    def begin(self) -> int:
        gen = super().begin()
        st = self.sched.pool.reader.stats
        self._prompt_reads = (st.bytes, st.cold_bytes)
        return gen

    def end_prefill(self) -> None:
        """The prompt's reads (whole layers, or its experts) tell at once what PAUSE_AFTER steps would: all
        from the page cache, the first decode step is already paused; some from the disk, it is not."""
        super().end_prefill()
        st, (read0, cold0) = self.sched.pool.reader.stats, self._prompt_reads
        if not (self.PAUSE_ON_PROMPT and self.sched.pool.reader.sees_cache) or st.bytes == read0:
            return
        self._warm_steps = self.PAUSE_AFTER if st.cold_bytes == cold0 else 0
        self.paused = self._warm_steps >= self.PAUSE_AFTER

    def pull(self) -> None:
        """Bring the pending predictions to the host and plan their fills (predicted routing: decide)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        t0 = now_us()
        mx.eval([a for p in pending for a in (p.inds, p.plan) if a is not None])  # scheduled already: waits for them only
        self.pull_s += (now_us() - t0) / 1e6
        self.span("pull", "compute", t0)
        for p in pending:
            host = np.array(p.inds, copy=False)
            ids = np.unique(host)
            c = p.consumer
            c.waiting.append((ids, p.step, p.plan is None))  # decided routing: certain reads
            if c.ran >= p.step - 1:  # the consumer has read its bank this step already
                c.plan_waiting()
            if p.plan is not None:
                c.decided[p.step] = Decided(p.inds, p.plan, host, ids)

    def span(self, name: str, cat: str, t0: float, **args) -> None:
        if self.trace is not None and self.trace.on:
            self.trace.span(name, cat, t0, now_us(), step=self.sched.step, **args)

    def scheduling(self, layer: int) -> "_Scheduling":
        return _Scheduling(self, layer)

    def flush(self) -> None:
        """Before a step's evaluation (pipeline/steps.py): plan what the last layers predicted."""
        self.paused_steps += self.paused
        with self.scheduling(-1):
            self.pull()

    def next_step(self) -> None:
        with self.scheduling(-1):
            self.pull()  # whatever was predicted after the flush
            self.sched.next_step()
            self._watch_reads()

    def _watch_reads(self) -> None:
        """At a step boundary: whether the next step's layers predict (PAUSE_AFTER)."""
        pool = self.sched.pool
        if not pool.reader.sees_cache:
            return
        cold = pool.stats.cold_bytes
        self._warm_steps = 0 if cold > self._cold_bytes else self._warm_steps + 1
        self._cold_bytes = cold
        self.paused = self._warm_steps >= self.PAUSE_AFTER

    def finish(self) -> None:
        self.pending = []
        self.sched.cancel()

    def reset_pipeline(self) -> None:
        """No read in flight or planned, step 0, no routing history: as a freshly built runtime."""
        self.pending = []
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
        step = self.sched.step + ahead
        return {layer: (ex.prev_inds, ex.decided.get(step)) for layer, ex in self.executors.items()}

    def keep_rows(self, rows: list[int]) -> None:
        """Sequences left the batch: keep the history and the routing decided ahead of the others."""
        idx = mx.array(rows)
        for ex in self.executors.values():
            ex.prev_inds = ex.prev_inds[idx] if ex.prev_inds is not None else None
            ex.decided = {s: Decided(d.inds[idx], d.plan[idx], d.host[rows], np.unique(d.host[rows]))
                          for s, d in ex.decided.items()}

    def join(self, parts: list[tuple[dict, int]]) -> None:
        """The batch becomes the concatenation of (snapshot, rows) parts: their histories (a part without a
        previous token gets rows naming no expert) and, where every part has one, their routing decided for
        the step now (else that layer routes the step with its own router). No parts: a clean slate."""
        self.pending = []  # predictions made for other rows decide nothing
        step = self.sched.step
        for layer, ex in self.executors.items():
            prevs = [(snap[layer][0], n) for snap, n in parts]
            known = [p for p, _ in prevs if p is not None]
            ex.prev_inds = None if not known else mx.concatenate(
                [p if p is not None else mx.full((n, 1, known[0].shape[-1]), ex.num_experts, dtype=known[0].dtype)
                 for p, n in prevs])
            decs = [snap[layer][1] for snap, _ in parts]
            ex.decided.clear()
            if decs and all(d is not None for d in decs):
                host = np.concatenate([d.host for d in decs])
                ex.decided[step] = Decided(mx.concatenate([d.inds for d in decs]),
                                           mx.concatenate([d.plan for d in decs]), host, np.unique(host))

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
        for consumer, owner in sorted(self.heads.owners.items()):
            if owner not in self.executors or consumer not in self.executors:
                raise Edge0Error(f"head for layer {consumer} (owned by layer {owner}): the store has no such MoE layer")
            ex = self.executors[consumer]
            self.executors[owner].heads.append((self.heads.heads[consumer], ex))
            routes = self.heads.routes is None or consumer in self.heads.routes  # else the head only reads ahead
            ex.predicted_routing = self.predicted_routing and routes
            if ex.predicted_routing:
                blocks[consumer].planned = ex.planned
                ex.planned_by = self.executors[owner]
                self.executors[owner].routes_ahead = True

    def close(self) -> None:
        self.sched.close()
        super().close()


class _Scheduling:
    """Times the scheduler's work on the graph-building thread (a `sched` span), its stalls left out."""

    def __init__(self, rt: PrefetchRuntime, layer: int):
        self.rt, self.layer = rt, layer

    def __enter__(self):
        self.t0, self.waits0 = now_us(), self.rt.sched.stats.stall_s + self.rt.pull_s
        self.cpu0 = time.thread_time()

    def __exit__(self, *exc):
        rt = self.rt
        spent = (now_us() - self.t0) / 1e6 - (rt.sched.stats.stall_s + rt.pull_s - self.waits0)
        if rt.sched.step >= 1:  # decode steps, as --json's figures (step 0 is the prompt's last token)
            rt.sched_s += spent
            rt.sched_cpu_s += time.thread_time() - self.cpu0  # stalls and pulls wait without using the CPU
        if rt.trace is not None and rt.trace.on:
            rt.trace.span("sched", "sched", self.t0, self.t0 + spent * 1e6, layer=self.layer, step=rt.sched.step)


def build_prefetch_runtime(reader, compute_dtype, *, predictor: str = "next-router", memory_budget_gib=None,
                           slots: int | None = None, queue_depth: int = QUEUE_DEPTH, trace=NULL, heads=None,
                           predicted_routing: bool = False, guesses: int | None = None, top_k: int | None = None,
                           **_) -> PrefetchRuntime:
    """One bank per MoE layer (as staged) filled through the store's I/O pool, whole-layer prefill.

    heads: a HeadSet (predictor "heads" and predicted routing need one). guesses: read ahead only the predictor's
    N likeliest experts of each predicted set (None: all K). top_k: the K routed (None: the model's)."""
    if predictor not in PREDICTORS:
        raise Edge0Error(f"--predictor {predictor}: choose {', '.join(PREDICTORS)}")
    if (predictor == "heads" or predicted_routing) and heads is None:
        raise Edge0Error("predicting with heads needs a head file: --heads FILE (train one with `edge0 train heads`)")
    k = top_k or reader.manifest.top_k
    if guesses is not None and (predicted_routing or not 1 <= guesses <= k):
        why = "predicted routing reads what its heads route" if predicted_routing else f"between 1 and K = {k}"
        raise Edge0Error(f"--guesses {guesses}: {why}")
    base = build_runtime(reader, "staged", compute_dtype, memory_budget_gib=memory_budget_gib, slots=slots)
    rt = PrefetchRuntime("staged", base.fence, {}, banks=base.banks, stats=base.stats, prefill=base.prefill)
    rt.pending = []
    rt.sched = Scheduler(reader.pool, queue_depth=queue_depth, trace=trace)
    reader.pool.trace = trace
    rt.trace = trace
    rt.heads = heads
    rt.predicted_routing = predicted_routing
    rt.guesses = None if guesses == k else guesses
    for layer, staged in base.executors.items():
        rt.executors[layer] = PrefetchExperts(layer, staged.cache, rt, staged.exact, base.prefill, predictor, staged)
    return rt
