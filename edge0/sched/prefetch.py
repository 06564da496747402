"""`--routing prefetch`: the model's own router decides, predicted experts are read one token ahead.

Predictors (one small interface: given what is known at layer L of step s, name layer L'`s experts for
step s+1):
  repeat       layer L at s+1 uses what it used at s (known once layer L has routed at s).
  next-router  layer L+1's own router applied to layer L's MoE input at s: what an untrained
               prerouter head computes (known at layer L of step s, a full layer earlier).
Output is token-identical to native routing: the prediction only decides what is read early.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..compute.banks import Fence
from ..compute.executors import SlotCache, WholeLayer
from ..compute.experts import ExactExperts, switch_glu
from ..compute.runtime import Runtime, build_runtime
from ..errors import Edge0Error
from .scheduler import IO_WORKERS, QUEUE_DEPTH, Scheduler
from .trace import NULL, now_us

PREDICTORS = ("repeat", "next-router")


class PrefetchExperts:
    """One MoE layer under the scheduler: gather from bank (step % 2), prefetched during the step before."""

    def __init__(self, layer: int, caches: list[SlotCache], sched: Scheduler, fence: Fence, exact: ExactExperts,
                 prefill: WholeLayer | None, predictor: str, trace=NULL):
        self.layer, self.caches, self.sched, self.fence = layer, caches, sched, fence
        self.exact, self.prefill, self.predictor, self.trace = exact, prefill, predictor, trace
        self.quant = exact.quant
        self.num_experts = exact.num_experts
        self.next: PrefetchExperts | None = None  # the next MoE layer's executor
        self.next_route = None  # the next MoE layer's router: x -> (inds, scores)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.prefill is not None and self.prefill.wants(inds):
            return self.prefill(self.layer, x, inds)
        sched = self.sched
        predicted = None
        if self.predictor == "next-router" and self.next is not None:
            predicted = self.next_route(x)[0]  # (1, T, K) layer L+1's router on layer L's input
        t0 = now_us()
        mx.eval(inds, predicted) if predicted is not None else mx.eval(inds)  # SYNC: ids to the host
        if self.trace.on:
            self.trace.span(f"eval L{self.layer}", "compute", t0, now_us(), layer=self.layer, step=sched.step)
        self.fence.sync()
        host = np.array(inds, copy=False)
        ids = np.unique(host)
        plan = sched.ready(self.layer)  # the prefetch made during the step before has landed
        sched.count(plan, ids)
        cache = self.caches[sched.step % 2]
        if len(ids) > cache.bank.slots:
            return self.exact.compute(x, host, ids)
        slots = sched.demand(self.layer, cache, ids)  # misses, read now through the pool
        if predicted is not None:
            nxt = self.next
            sched.prefetch(nxt.layer, nxt.caches[(sched.step + 1) % 2], np.unique(np.array(predicted, copy=False)))
        elif self.predictor == "repeat":
            sched.prefetch(self.layer, self.caches[(sched.step + 1) % 2], ids)
        lut = np.zeros(self.num_experts, dtype=np.uint32)
        lut[ids] = slots
        return switch_glu(x, mx.array(lut[host]), cache.bank.read(), self.quant)


class PrefetchRuntime(Runtime):
    """A Runtime whose decode steps are driven by the scheduler."""

    sched: Scheduler = None

    def next_step(self) -> None:
        self.sched.next_step()

    def finish(self) -> None:
        self.sched.cancel()

    def link(self, blocks: dict) -> None:
        """Give each layer its successor and the successor's router (for next-router)."""
        order = sorted(self.executors)
        for a, b in zip(order, order[1:]):
            self.executors[a].next = self.executors[b]
            self.executors[a].next_route = blocks[b].route

    def close(self) -> None:
        self.sched.close()


def build_prefetch_runtime(reader, compute_dtype, *, predictor: str = "next-router", memory_budget_gib=None,
                           slots: int | None = None, workers: int = IO_WORKERS, queue_depth: int = QUEUE_DEPTH,
                           trace=NULL) -> PrefetchRuntime:
    """Two banks per MoE layer (as staged) filled by the scheduler's pool, whole-layer prefill."""
    if predictor not in PREDICTORS:
        raise Edge0Error(f"--predictor {predictor}: choose {', '.join(PREDICTORS)} (heads come with trained heads)")
    base = build_runtime(reader, "staged", compute_dtype, memory_budget_gib=memory_budget_gib, slots=slots)
    m = reader.manifest
    sched = Scheduler(reader, workers=workers, queue_depth=queue_depth, trace=trace)
    rt = PrefetchRuntime("staged", base.fence, {}, banks=base.banks, stats=base.stats, prefill=base.prefill,
                         budget_bytes=base.budget_bytes)
    rt.sched = sched
    rt.trace = trace
    for layer, staged in base.executors.items():
        rt.executors[layer] = PrefetchExperts(layer, staged.caches, sched, base.fence, staged.exact, base.prefill,
                                              predictor, trace)
    return rt

