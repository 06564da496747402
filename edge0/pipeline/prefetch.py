"""`--routing prefetch` and `--routing predicted` under the scheduler.

prefetch: the model's own router decides, predicted experts are read one token ahead; output is
token-identical to native routing. predicted: at consumer layers the prerouter head's prediction *is*
the routing, so the staged set is the routed set and nothing is read on demand there.

Predictors (given what is known at layer L of step s, name a layer's experts for step s+1):
  repeat       layer L at s+1 uses what it used at s (known once layer L has routed at s).
  next-router  layer L+1's own router applied to layer L's MoE input at s: what an untrained
               prerouter head computes (known at layer L of step s, a full layer earlier).
  heads        trained prerouter heads for consumer layers; next-router for the others.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..compute.banks import Fence
from ..compute.executors import SlotCache, WholeLayer
from ..compute.experts import ExactExperts, bank_positions, switch_glu
from ..compute.runtime import Runtime, build_runtime
from ..errors import Edge0Error
from ..model.heads import features
from ..sched.scheduler import IO_WORKERS, QUEUE_DEPTH, Scheduler
from ..sched.trace import NULL, now_us

PREDICTORS = ("repeat", "next-router", "heads")


class PrefetchExperts:
    """One MoE layer under the scheduler: gather from its bank, prefetched during the step before."""

    def __init__(self, layer: int, cache: SlotCache, sched: Scheduler, fence: Fence, exact: ExactExperts,
                 prefill: WholeLayer | None, predictor: str, trace=NULL):
        self.layer, self.cache, self.sched, self.fence = layer, cache, sched, fence
        self.exact, self.prefill, self.predictor, self.trace = exact, prefill, predictor, trace
        self.quant = exact.quant
        self.num_experts = exact.num_experts
        self.next: PrefetchExperts | None = None  # the next MoE layer's executor
        self.next_block = None  # the next MoE layer's block (its router: logits, select)
        self.head = None  # the prerouter head this layer owns (for self.next), if any
        self.prev_inds = None  # this layer's routed ids at the previous token (head features)
        self.predicted_routing = False  # the next layer routes with this layer's head (routing=predicted)
        self.decided: dict[int, tuple] = {}  # step -> (inds, scores) decided for this layer by its owner's head

    def reset(self) -> None:
        """A new generation: no previous token, no routing decided ahead."""
        self.prev_inds = None
        self.decided.clear()

    def planned(self):
        """Routing decided for this layer at the step before (predicted routing), for the step now built."""
        step = self.sched.step
        for old in [s for s in self.decided if s < step]:
            del self.decided[old]
        return self.decided.get(step)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.prefill is not None and self.prefill.wants(inds):
            self.prev_inds = inds[..., -1:, :]
            return self.prefill(self.layer, x, inds)
        sched = self.sched
        predicted, scores = None, None
        if self.next is not None and self.head is not None and inds.shape[-2] == 1:
            router = self.next_block.logits(x)  # (1, 1, E) layer L+1's router on layer L's input
            feats = features(x, inds, self.prev_inds, self.num_experts)
            predicted, scores = self.next_block.select(_per_row(self.head, feats, router))
        elif self.next is not None and self.predictor in ("next-router", "heads"):
            predicted = self.next_block.route(x)[0]  # (1, T, K)
        self.prev_inds = inds[..., -1:, :]
        t0 = now_us()
        mx.eval(*(a for a in (inds, predicted, scores) if a is not None))  # SYNC: ids to the host
        if self.trace.on:
            self.trace.span(f"eval L{self.layer}", "compute", t0, now_us(), layer=self.layer, step=sched.step)
        self.fence.sync()
        host = np.array(inds, copy=False)
        ids = np.unique(host)
        plan = sched.ready(self.layer)  # the prefetch made during the step before has landed
        sched.count(plan, ids)
        cache = self.cache
        slots = sched.demand(self.layer, cache, ids) if len(ids) <= cache.bank.slots else None  # misses read now
        if slots is None:
            return self.exact.compute(x, host, ids)
        arrays = cache.bank.read(slots)  # marked read before the next fills are planned: they avoid these slots
        if predicted is not None:
            nxt = self.next
            sched.prefetch(nxt.layer, nxt.cache, np.unique(np.array(predicted, copy=False)))
            if scores is not None and self.predicted_routing:
                nxt.decided[sched.step + 1] = (predicted, scores)
        elif self.predictor == "repeat":
            sched.prefetch(self.layer, cache, ids)  # all held already: the reuse is the prediction
        y = switch_glu(x, bank_positions(host, ids, slots), arrays, self.quant)
        mx.async_eval(y)  # as SlottedExperts: the experts compute while the next layer's graph is built
        return y


def _per_row(head, feats: mx.array, router: mx.array) -> mx.array:
    """The head on each sequence of a batch apart: MLX's float matmul over B rows rounds differently from one
    row's, and a head's top-k flips on such a difference, so a batched sequence would route (and answer)
    otherwise than alone. Heads are small: B nodes per layer cost little."""
    if feats.shape[0] == 1:
        return head(feats, router)
    return mx.concatenate([head(feats[i:i + 1], router[i:i + 1]) for i in range(feats.shape[0])])


class PrefetchRuntime(Runtime):
    """A Runtime whose decode steps are driven by the scheduler."""

    sched: Scheduler = None

    def next_step(self) -> None:
        self.sched.next_step()

    def finish(self) -> None:
        self.sched.cancel()

    def reset_pipeline(self) -> None:
        """No read in flight or planned, step 0, no routing history: as a freshly built runtime."""
        self.sched.reset()
        for ex in self.executors.values():
            ex.reset()

    heads = None  # HeadSet when predicting with trained heads
    predicted_routing = False

    # -- batches (serve --max-batch): the routing history's rows follow the batch's sequences ------------

    def history(self) -> dict:
        """Each layer's routed ids at the previous token, (B, 1, K) or None (no previous token)."""
        return {layer: ex.prev_inds for layer, ex in self.executors.items()}

    def keep_rows(self, rows: list[int]) -> None:
        """Sequences left the batch: keep the history and the routing decided ahead of the others."""
        idx = mx.array(rows)
        for ex in self.executors.values():
            ex.prev_inds = ex.prev_inds[idx] if ex.prev_inds is not None else None
            ex.decided = {s: (inds[idx], scores[idx]) for s, (inds, scores) in ex.decided.items()}

    def join(self, histories: list[tuple[dict, int]]) -> None:
        """The batch becomes the concatenation of (history, rows) parts (each a history() and its row count);
        a part without a previous token gets rows naming no expert. Routing decided ahead is dropped: the
        consumer layers route the next step with their own routers."""
        for layer, ex in self.executors.items():
            known = [h[layer] for h, _ in histories if h[layer] is not None]
            if not known:
                ex.prev_inds = None
            else:
                k, dtype = known[0].shape[-1], known[0].dtype
                ex.prev_inds = mx.concatenate([h[layer] if h[layer] is not None else
                                               mx.full((n, 1, k), ex.num_experts, dtype=dtype) for h, n in histories])
            ex.decided.clear()

    def link(self, blocks: dict) -> None:
        """Give each layer its successor and the successor's router; heads to their owners; with predicted
        routing, consumer blocks take the routing their owner's head decided."""
        order = sorted(self.executors)
        for a, b in zip(order, order[1:]):
            self.executors[a].next = self.executors[b]
            self.executors[a].next_block = blocks[b]
        if self.heads is None:
            return
        for consumer, owner in self.heads.owners.items():
            if owner not in self.executors or self.executors[owner].next is not self.executors.get(consumer):
                raise Edge0Error(f"head for layer {consumer} is owned by layer {owner}, which does not precede it")
            self.executors[owner].head = self.heads.heads[consumer]
            self.executors[owner].predicted_routing = self.predicted_routing
            if self.predicted_routing:
                blocks[consumer].planned = self.executors[consumer].planned

    def close(self) -> None:
        self.sched.close()
        super().close()


def build_prefetch_runtime(reader, compute_dtype, *, predictor: str = "next-router", memory_budget_gib=None,
                           slots: int | None = None, workers: int = IO_WORKERS, queue_depth: int = QUEUE_DEPTH,
                           trace=NULL, heads=None, predicted_routing: bool = False) -> PrefetchRuntime:
    """One bank per MoE layer (as staged) filled by the scheduler's pool, whole-layer prefill.

    heads: a HeadSet (predictor "heads" and predicted routing need one)."""
    if predictor not in PREDICTORS:
        raise Edge0Error(f"--predictor {predictor}: choose {', '.join(PREDICTORS)}")
    if (predictor == "heads" or predicted_routing) and heads is None:
        raise Edge0Error("predicting with heads needs a head file: --heads FILE (train one with `edge0 train heads`)")
    base = build_runtime(reader, "staged", compute_dtype, memory_budget_gib=memory_budget_gib, slots=slots)
    sched = Scheduler(reader, workers=workers, queue_depth=queue_depth, trace=trace)
    rt = PrefetchRuntime("staged", base.fence, {}, banks=base.banks, stats=base.stats, prefill=base.prefill)
    rt.sched = sched
    rt.trace = trace
    rt.heads = heads
    rt.predicted_routing = predicted_routing
    for layer, staged in base.executors.items():
        rt.executors[layer] = PrefetchExperts(layer, staged.cache, sched, base.fence, staged.exact, base.prefill,
                                              predictor, trace)
    return rt

