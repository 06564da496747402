"""`--routing predicted` with every expert resident: the heads' decisions never leave the graph.

Where every expert of the store fits in memory nothing is read during decode, so predicted routing needs no
scheduler: a head owned by layer L at step s decides its consumer's routing for step s+1 as graph nodes, and
the consumer's block takes them at step s+1 as they are. No layer syncs with the host inside a step, so
decode builds step s+1's graph while step s evaluates (decode/step.py `overlaps`). The same heads, the same
routing math and the same expert products as the staged pipeline (pipeline/prefetch.py): the same tokens.

A decision is stamped with the step it is for, as the streamed pipeline's are: the runtime's step, which
next_step() advances once a step's graph is built (evaluated, where steps are not overlapped); prompt chunks
do not advance it, so the step after the prompt routes with the model's router.
"""

from __future__ import annotations

import mlx.core as mx

from ..compute.experts import ResidentExperts
from ..compute.runtime import Runtime, build_runtime
from ..errors import Edge0Error
from .prefetch import head_per_row, joined_history, last_token


class PredictedResident:
    """One MoE layer, every expert resident; the heads it owns decide their consumers' next routing in the graph."""

    predictor = "heads"  # for model/adapter.py's check of the family's router

    def __init__(self, layer: int, resident: ResidentExperts, num_experts: int, rt: "PredictedResidentRuntime"):
        self.layer, self.resident, self.num_experts, self.rt = layer, resident, num_experts, rt
        self.block = None  # this layer's MoE block (its router: logits, decide)
        self.heads: list[tuple] = []  # (head, consumer executor) of the routing heads this layer owns
        self.prev_inds: mx.array | None = None  # (B, 1, K) this layer's routed ids at the previous token
        self.ahead: dict[int, tuple] = {}  # step -> (inds, plan): routing its owner's head decided for that step

    def reset(self) -> None:
        self.prev_inds, self.ahead = None, {}

    def planned(self):
        """The block's hook: the routing the owner's head decided for this step, or None (the block's router)."""
        step = self.rt.step
        for old in [s for s in self.ahead if s < step]:
            del self.ahead[old]
        return self.ahead.get(step)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        y = self.resident(x, inds)
        self.routed(x, inds)
        return y

    def routed(self, x: mx.array, inds: mx.array) -> None:
        """This layer's experts `inds` for input x are chosen: its heads decide their consumers' next routing, and
        inds become the previous token's (also called by a fused block step, model/blocks.py add_norm)."""
        if inds.shape[-2] == 1:  # one token a row: decide the consumers' routing for the next step
            for head, consumer in self.heads:
                blk = consumer.block
                scores = head_per_row(head, x, inds, self.prev_inds, blk.logits(x))
                p_inds, plan = (getattr(blk, "decide", None) or blk.select)(scores)
                consumer.ahead[self.rt.step + 1] = (p_inds, plan)
        self.prev_inds = last_token(inds)


class PredictedResidentRuntime(Runtime):
    """The runtime of predicted routing over resident experts: no scheduler, no reads, no host sync."""

    heads = None  # the HeadSet that routes
    candidates = None  # experts each head names a token ahead, its consumer's router choosing K of them (None: K)
    predicted_routing = True
    step = 0  # the decode step being built (step 0: the prompt's last token)

    def reset_pipeline(self) -> None:
        self.step = 0
        for ex in self.executors.values():
            ex.reset()

    def next_step(self) -> None:
        self.step += 1

    # -- batches (serve --max-batch): the routing state's rows follow the batch's sequences ------------

    def snapshot(self, ahead: int = 0) -> dict:
        """Each layer's (previous routed ids, routing decided for step now + ahead) for the batch's rows; ahead=1
        after a sequence's first step alone, which does not advance the step."""
        return {layer: (ex.prev_inds, ex.ahead.get(self.step + ahead)) for layer, ex in self.executors.items()}

    def keep_rows(self, rows: list[int]) -> None:
        idx = mx.array(rows)
        for ex in self.executors.values():
            ex.prev_inds = ex.prev_inds[idx] if ex.prev_inds is not None else None
            ex.ahead = {step: (inds[idx], plan[idx]) for step, (inds, plan) in ex.ahead.items()}

    def join(self, parts: list[tuple[dict, int]]) -> None:
        """The batch becomes the concatenation of (snapshot, rows) parts: their histories (rows naming no expert
        where a part has none) and, where every part has one, the routing decided for the step now."""
        for layer, ex in self.executors.items():
            ex.prev_inds = joined_history([(snap[layer][0], n) for snap, n in parts], ex.num_experts)
            decs = [snap[layer][1] for snap, _ in parts]
            ex.ahead = {}
            if decs and all(d is not None for d in decs):
                ex.ahead[self.step] = (mx.concatenate([d[0] for d in decs]), mx.concatenate([d[1] for d in decs]))

    def link(self, blocks: dict) -> None:
        """Each layer its block; each routing head to its owner; consumer blocks take the owner's decision."""
        for layer, ex in self.executors.items():
            ex.block = blocks[layer]
        for consumer, owner in sorted(self.heads.owners.items()):
            if owner not in self.executors or consumer not in self.executors:
                raise Edge0Error(f"head for layer {consumer} (owned by layer {owner}): the store has no such MoE layer")
            if self.heads.routes is not None and consumer not in self.heads.routes:
                continue  # a head that only reads ahead: nothing to read here
            ex = self.executors[consumer]
            self.executors[owner].heads.append((self.heads.heads[consumer], ex))
            blocks[consumer].planned = ex.planned
            if hasattr(blocks[consumer], "choose"):
                blocks[consumer].candidates = self.candidates


def build_predicted_resident(reader, compute_dtype, *, heads, candidates: int | None = None,
                             memory_budget_gib: float | None = None, **_) -> PredictedResidentRuntime:
    """Every expert read once into memory, routed by `heads` (a HeadSet) decided one step ahead in the graph;
    candidates: experts each head names, its consumer's router choosing K of them (None: K)."""
    base = build_runtime(reader, "resident", compute_dtype, memory_budget_gib=memory_budget_gib)
    rt = PredictedResidentRuntime("resident", base.fence, {}, banks=base.banks, stats=base.stats)
    rt.heads = heads
    rt.candidates = candidates
    for layer, resident in base.executors.items():
        rt.executors[layer] = PredictedResident(layer, resident, reader.manifest.num_experts, rt)
    return rt
