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
built with no host round trip at all. Only layers that route with their own router sync (`SYNC`), and not
those that hold every expert (`held`, --placement: pipeline/prefetch_runtime.py held_layers): their graph gathers
from all of them by the routed ids, as resident experts do.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..compute.executors import SlotCache, WholeLayer, held_first
from ..compute.experts import ExactExperts, Quant, ResidentExperts, bank_positions, switch_glu, unique_ids
from ..compute.kernel_choice import current
from ..compute.kernels import host_eval, queue
from ..compute.choices import PREDICTORS  # noqa: F401 (prefetch_runtime.py checks a choice against it)
from ..sched.trace import now_us
from .affinity import plan_next


@dataclass
class Decided:
    """A layer's routing for one step, decided a step ahead by its owner's head (predicted routing)."""

    inds: mx.array  # (B, 1, K) routed ids, evaluated
    plan: mx.array  # what the block's `planned` hook returns beside them (weights, or logits)
    host: np.ndarray | None = None  # inds on the host: made on the scheduler's loop with their fill (plan_waiting)
    ids: np.ndarray | None = None  # their unique ids (the fill's `predicted`: Scheduler.take knows it by them)

    def on_host(self) -> tuple[np.ndarray, np.ndarray]:
        """(host, ids), read after a settle; made here where no fill of them was handed to the loop yet."""
        if self.ids is None:
            self.host = np.array(self.inds, copy=False)
            self.ids = unique_ids(self.host)
        return self.host, self.ids


@dataclass
class Prediction:
    """A prediction of one layer's experts for one step, still a graph node."""

    consumer: "PrefetchExperts"  # the layer it names experts for
    step: int  # the step it is for
    inds: mx.array  # (B, T, K) predicted ids
    plan: mx.array | None  # the consumer block's decision beside them (predicted routing), else None
    scores: mx.array | None = None  # a guess's scores of every expert (B, T, E); None where plan is not (decided)


class PrefetchExperts:
    """One MoE layer under the scheduler: gather from its bank, prefetched during the step before."""

    def __init__(self, layer: int, cache: SlotCache | None, rt, exact: ExactExperts,
                 prefill: WholeLayer | None, predictor: str, staged=None, *, held: ResidentExperts | None = None):
        self.layer, self.cache, self.rt = layer, cache, rt
        self.staged = staged  # the staged executor on the same bank: the whole layer while prefetch is paused
        self.held = held  # every expert of this layer in memory (--placement): no bank, no read, no host sync
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
        self.waiting: list[tuple] = []  # (Decided, step, None) of a decided routing, (routed ids, step, scores) of a
        # guess, pulled (evaluated arrays): planned once this layer has run this step

    def reset(self) -> None:
        """A new generation: no previous token, no routing decided ahead."""
        self.prev_inds = None
        self.decided.clear()
        self.answered = -1
        self.ran = -1
        self.waiting = []
        self._banked = self._begun = None

    def unlink(self) -> None:
        """The runtime closed: drop the references back to it, to the other layers and to the block (cycles)."""
        self.reset()
        self.rt = self.next = self.block = self.planned_by = self._bank_view = None
        self.heads = []

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

    @property
    def resident(self) -> ResidentExperts | None:
        """A held layer's experts, which a block may run its whole decode step over (model/blocks.py add_norm)."""
        return self.held

    def routed(self, x: mx.array, inds: mx.array) -> None:
        """This layer's experts `inds` for input x are chosen (here, or by a fused block step, model/blocks.py
        add_norm): the heads it owns predict their consumers' next step, and inds become the previous token's. A
        streamed layer's fused step (bank_step before it) then plans the fills waiting for it."""
        self.ran = self.rt.sched.step
        banked, self._banked = self._banked, None
        if banked is not None:  # its scheduler work of this step is done (bank_step)
            self.rt.plan_later(self)
        predictions = self._predict(x, inds, banked) if inds.shape[-2] == 1 else []
        self.prev_inds = last_token(inds)
        self._schedule(predictions)

    def banked_experts(self) -> "BankedExperts | None":
        """This layer's slot bank as the experts a block's one-call step reads (with bank_step's table); None where
        it has none."""
        if self.cache is None or self.held is not None:
            return None
        if self._bank_view is None:
            self._bank_view = BankedExperts(self.cache.bank.arrays, self.quant)
        return self._bank_view

    def bank_step(self) -> tuple[dict, mx.array] | None:
        """A streamed layer's decode step whose routing its owner's head decided a step ahead, run by the block in one
        call (model/blocks.py add_norm, the edge0 kernel's Edge0MoeBlock over this bank; the layer has one:
        banked_experts): once the candidates are in the bank, (the bank's arrays, the table (E,) uint32 of each
        candidate's slot), marked read; then the block calls `routed`. None where the step was not decided (__call__'s
        way), or where the candidates do not fit the bank: __call__ then reads them the exact way, from what this
        began."""
        rt = self.rt
        step = rt.sched.step
        d = self.decided.get(step) if self.answered == step else None
        if d is None:
            return None
        got = self._slots(d, None)
        if got is None:
            self._begun = step  # the exact way, in __call__
            return None
        slots, reads = got
        if reads is not None:
            with rt.scheduling(self.layer):
                rt.sched.demand_end(reads, rt.booked)
        table = self._table if self._table is not None else slot_table(d.ids, slots, self.num_experts)
        self._table, self._banked = None, d.ids
        return self.cache.bank.read(slots), mx.array(table)

    def _slots(self, d: Decided | None, ids: np.ndarray | None):
        """This layer's slots for `ids` (d's, after the settle) this step: (slots, None) where the fill planned a step
        before holds them (taken whole: its slot table in `_table`), (slots, reads begun) if read now, None: exactly."""
        rt, sched, cache = self.rt, self.rt.sched, self.cache
        with rt.scheduling(self.layer):
            if not rt.paused:  # the predictions made at earlier layers (paused: at the step's end, as reads from the
                rt.pull()  # page cache hide nothing: one wait for the heads, not one per layer), planned after this
                # layer's work; the settle after the wait for MLX, the loop planning the layers before meanwhile
            rt.settle()
            if d is not None:  # decided a step ahead and read: only the wait for its reads here, its books on the loop
                ids = d.on_host()[1]
                plan = sched.take(self.layer, ids)
                if plan is not None:
                    rt.booked.append(plan)
                    self._table = plan.table
                    return plan.slots, None
            elif (slots := sched.held(self.layer, cache, ids, rt.booked)) is not None:  # its router's, all held: only
                return slots, None  # a lookup here, the books on the loop
            plan = sched.ready(self.layer)  # this layer's fill, planned during the step before: landed
            sched.count(plan, ids)
            if d is not None and plan is not None and cache.holding(ids, plan.slots):
                return plan.slots, None  # decided a step ahead, read: the bank holds them where planned
            return sched.demand_begin(self.layer, cache, ids) if len(ids) <= cache.bank.slots else None

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.held is not None:
            self.routed(x, inds)
            return self.held(x, inds)
        if self.prefill is not None and self.prefill.wants(inds):
            self.prev_inds = last_token(inds)
            return self.prefill(self.layer, x, inds)
        rt = self.rt
        sched, step = rt.sched, rt.sched.step  # (the step's end was settled: the loop only plans inside a step)
        if rt.paused and self.staged is not None and self.planned_by is None and not self.waiting:
            rt.settle()  # (else settled after the wait for the routed ids: the loop plans meanwhile)
            if not sched.busy(self.layer):
                return self._staged(x, inds, step)
        d = self.decided.get(step) if self.answered == step else None
        chosen = d is not None and inds is not d.inds  # the block's router chose K of the candidates, in the graph
        # decided a step ahead: the candidates' ids and slots are on the host already; else this layer routes with
        # its own router
        host, ids = self._on_host(inds) if d is None else (None, None)
        begun, self._begun = self._begun, None
        got = None if begun == step else self._slots(d, ids)  # (bank_step began the step and found no room)
        self._table = None
        if d is not None:
            host, ids = d.on_host()  # (settled in _slots, or in bank_step's)
        cache = self.cache
        if got is None:  # more experts than slots, or too few writable: read them the exact way
            rt.plan_later()  # the consumers pulled in _slots
            host, ids = self._on_host(inds) if chosen else (host, ids)
            self._schedule(self._predict(x, inds, ids) if inds.shape[-2] == 1 else [])  # its heads still decide
            self.prev_inds = last_token(inds)
            return self.exact.compute(x, host, ids)
        slots, reads = got
        fills = reads.fills if reads is not None else []
        try:  # the held experts compute while the rest are read from the disk (the routed rows known on the host)
            early = None if chosen else held_first(self.exact.reader, self.layer, x, host, ids, slots, cache.bank,
                                                   fills, self.quant)
        except BaseException:
            cache.forget([slot for slot, _ in fills])  # assigned, never to be read
            raise
        if reads is not None:
            with rt.scheduling(self.layer):
                sched.demand_end(reads, rt.booked)
        arrays = cache.bank.read(slots)  # marked read: the next fills avoid these slots
        self.ran = step
        rt.plan_later(self)  # its fills and the consumers pulled in _slots, on the loop
        predictions = self._predict(x, inds, ids) if inds.shape[-2] == 1 else []
        self.prev_inds = last_token(inds)
        where = slot_positions(inds, ids, slots, self.num_experts) if chosen else bank_positions(host, ids, slots)
        y = early() if early is not None else switch_glu(x, where, arrays, self.quant, owner=self)
        t0 = now_us()
        self._schedule(predictions)
        queue(y)  # returns once MLX's queue has room: a long wait means the stream is busy (good)
        rt.span(f"queue L{self.layer}", "compute", t0)
        return y

    @staticmethod
    def _schedule(predictions: list) -> None:
        """Predictions' graphs evaluated apart, before the experts (one async_eval runs its outputs' graphs
        interleaved, so the predictions would wait for the experts)."""
        if predictions:
            mx.async_eval(*(a for p in predictions for a in (p.inds, p.plan, p.scores) if a is not None))

    def _on_host(self, inds: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """The routed ids on the host, and their unique values."""
        t0 = now_us()
        self.rt.wake()
        host_eval(inds)  # SYNC: the routed ids to the host
        self.rt.span(f"eval L{self.layer}", "compute", t0)
        self.rt.sync()  # (the fence moves after the fills the loop still plans)
        host = np.array(inds, copy=False)
        return host, unique_ids(host)

    def _staged(self, x: mx.array, inds: mx.array, step: int) -> mx.array:
        """Paused with nothing planned here: native routing on the same bank, no scheduler. A layer owning a
        head that routes its consumer still predicts (scheduled before its experts, pulled at the step's end)."""
        self.ran = step
        predictions = self._predict(x, inds, None) if self.routes_ahead and inds.shape[-2] == 1 else []
        self.prev_inds = last_token(inds)
        self._schedule(predictions)
        return self.staged(x, inds)

    def plan_waiting(self, waiting: list | None = None) -> None:
        """Plan the fills predicted for this layer's next step (`waiting`: those taken from it for the loop). Only
        once the layer has read its bank this step: before that, its last routed set is what the coming step most
        likely reuses, and a fill may not evict it (with 2K slots it would: K are planned for this step, K hold the
        last routed set)."""
        if waiting is None:
            waiting, self.waiting = self.waiting, []
        for what, step, scores in waiting:  # pulled (evaluated): made numpy here, on the loop
            guess = scores is not None  # speculative (the router may not follow it): routed ids (B, T, n), scores
            ids, rank = ((unique_ids(np.array(what, copy=False)), guess_rank(np.array(scores, copy=False))) if guess
                         else (what.on_host()[1], None))  # a decided routing: its ids kept for the step it decides
            plan = self.rt.sched.prefetch(self.layer, self.cache, ids, step=step, speculative=guess, rank=rank)
            if plan is not None and not guess:  # the table of its slots the layer's one-call step reads (bank_step)
                plan.table = slot_table(ids, plan.slots, self.num_experts)

    def _predict(self, x: mx.array, inds: mx.array, ids: np.ndarray | None) -> list[Prediction]:
        """The graphs of this layer's predictions for the next step (pulled later), and repeat's plan. Paused,
        only the heads whose prediction is their consumer's routing (predicted routing) run."""
        rt, step, n = self.rt, self.rt.sched.step, self.rt.guesses
        out = []
        for head, consumer in self.heads:
            if rt.paused and not consumer.predicted_routing:
                continue
            blk = consumer.block
            router = blk.logits(x)  # (B, 1, E) the consumer's router on this layer's input
            scores = head_per_row(head, x, inds, self.prev_inds, router)
            if n is not None:  # a guess: the head's n likeliest experts
                out.append(Prediction(consumer, step + 1, _likeliest(scores, n), None, host_scores(scores)))
                continue
            decide = getattr(blk, "decide", None) or blk.select
            p_inds, plan = decide(scores)
            routes = consumer.predicted_routing
            out.append(Prediction(consumer, step + 1, p_inds, plan if routes else None,
                                  None if routes else host_scores(scores)))
        owned = {c.layer for _, c in self.heads}
        if rt.paused:
            pass
        elif (self.next is not None and self.next.layer not in owned and self.next.held is None
              and self.predictor in ("next-router", "heads")):
            blk = self.next.block
            logits = blk.logits(x)  # its scores rank the held experts its fills replace
            p_inds = blk.select(logits)[0] if n is None else _likeliest(logits, n)
            out.append(Prediction(self.next, step + 1, p_inds, None, host_scores(logits)))  # (B, T, K or n)
        elif self.predictor == "affinity":  # the next layer at this step, from this layer's ids (pipeline/affinity.py)
            plan_next(self, ids)
        elif self.predictor == "repeat":  # all held already: the reuse is the prediction
            rt.plan_later(self, lambda: rt.sched.prefetch(self.layer, self.cache, ids, step=step + 1))
        rt.pending.extend(out)
        return out

    @property
    def pulls_predictions(self) -> bool:
        """Whether the host takes this layer's heads' predictions within the step (reading ahead; paused, they come
        at its end): then a fused block step gives them features that do not wait for its experts (model/blocks.py
        add_norm)."""
        return not self.rt.paused

    _bank_view = None  # banked_experts, made once (the bank's arrays never change: fills write into them)
    _banked = None  # the candidates' ids of a fused step under way (bank_step, then routed)
    _begun = None  # the step whose candidates bank_step found too many for the bank: __call__ reads them exactly
    _table = None  # the slot table of the fill `_slots` took whole (made on the loop), for bank_step
    predicted_routing = False  # this layer routes by its owner's head (routing=predicted)
    planned_by = None  # the executor of the layer whose head decides this one's routing (predicted routing)
    routes_ahead = False  # this layer owns a head that decides its consumer's routing (predicted routing)


@dataclass
class BankedExperts:
    """A slot bank's arrays as a fused block step reads them (model/blocks.py add_norm; the bank keeps its own packed
    copy, compute/banks.py)."""

    bank: dict[str, mx.array]
    quant: Quant

    def pack(self, ext) -> None:
        """Nothing: the bank packs its projections itself, and repacks each slot a fill writes."""


def guess_rank(scores: np.ndarray) -> np.ndarray:
    """A guess's scores (B, T, E) on the host as one per expert (the highest over the rows): its fills replace the
    held experts it ranks lowest."""
    return scores.reshape(-1, scores.shape[-1]).max(axis=0)


def last_token(inds: mx.array) -> mx.array:
    """The routed ids (B, T, K) of the last token, (B, 1, K): inds itself for a decode step (no slice node to build)."""
    return inds if inds.shape[-2] == 1 else inds[..., -1:, :]


def slot_table(ids: np.ndarray, slots, num_experts: int) -> np.ndarray:
    """(E,) uint32: slots[i] at ids[i], the position in a bank of each expert it holds (0 elsewhere)."""
    table = np.zeros(num_experts, dtype=np.uint32)
    table[ids] = np.asarray(slots, dtype=np.uint32)
    return table


def slot_positions(inds: mx.array, ids: np.ndarray, slots, num_experts: int) -> mx.array:
    """Routed ids `inds` (a graph array, each one of `ids`) as positions in a bank where slots[i] holds ids[i]."""
    return mx.take(mx.array(slot_table(ids, slots, num_experts)), inds)


def host_scores(scores: mx.array) -> mx.array:
    """A guess's scores as the host reads them (numpy has no bfloat16: --dtype bfloat16's router logits)."""
    return scores if scores.dtype == mx.float32 else scores.astype(mx.float32)


def _likeliest(scores: mx.array, n: int) -> mx.array:
    """The ids of the n highest scores on the last axis (unordered)."""
    return mx.argpartition(-scores, kth=n - 1, axis=-1)[..., :n]


def head_per_row(head, x: mx.array, inds: mx.array, prev: mx.array | None, router: mx.array) -> mx.array:
    """The head on a batch's sequences, each as it would run alone: MLX's float matmul over B rows may round
    differently from one row's, and a head's top-k flips on such a difference, so a batched sequence would route
    (and answer) otherwise than alone. On the edge0 kernel the head's linears are row-independent (one node for
    the batch); on MLX's, each sequence is run apart."""
    if x.shape[0] == 1 or current().edge0:
        return head.predict(x, inds, prev, router)
    return mx.concatenate([head.predict(x[i:i + 1], inds[i:i + 1], None if prev is None else prev[i:i + 1],
                                        router[i:i + 1]) for i in range(x.shape[0])])


def joined_history(prevs: list[tuple[mx.array | None, int]], num_experts: int) -> mx.array | None:
    """A layer's routed ids at the previous token for a batch joined from parts of (ids (n, 1, K) or None, n):
    a part without a previous token gets rows naming no expert (id E: an empty multi-hot)."""
    known = [p for p, _ in prevs if p is not None]
    if not known:
        return None
    return mx.concatenate([p if p is not None else mx.full((n, 1, known[0].shape[-1]), num_experts, dtype=known[0].dtype)
                           for p, n in prevs])
