"""Expert parallel: every rank holds every layer's dense weights and a share of every layer's experts by id (id %
ranks == rank); each computes the routed experts it holds, and the layer's expert outputs are summed over the ranks
with one all_sum. Each rank reads only its experts from its disk, so a token's reads are spread over the hosts.

The sum is of the (T, K, D) expert outputs, each row from the one rank that holds its expert and exact zeros from
the others, then combined with the routing weights on every rank alike: the same numbers as one process (a sum of
per-rank partial combinations would add in another order). Shapes: T tokens, K routed, D hidden.
Routing is the model's own router (--routing native): a head's prediction would need the slots of other ranks.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import Edge0Error


class ShardedExperts:
    """One MoE layer's executor on one rank: its own experts computed, the others' rows zero, then summed."""

    def __init__(self, inner, group, num_experts: int, stats: "Traffic"):
        self.inner, self.group, self.stats = inner, group, stats
        rank, size = group.rank(), group.size()
        self.owned = mx.arange(num_experts) % size == rank  # (E,)
        self.fill = rank  # an expert this rank holds, for a row with none of its own (its rows are dropped)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        mine = self.owned[inds]  # (..., K)
        # in place of another rank's expert: one of this rank's in the same row (read already), else its fill
        first = mx.take_along_axis(inds, mx.argmax(mine, axis=-1, keepdims=True), axis=-1)  # (..., 1)
        fill = mx.where(mine.any(axis=-1, keepdims=True), first, mx.array(self.fill, dtype=inds.dtype))
        local = mx.where(mine, inds, fill)
        out = self.inner(x, local)  # (..., K, D): this rank reads and computes only its experts
        out = mx.where(mine[..., None], out, mx.zeros((), dtype=out.dtype))
        self.stats.add(out.size * out.dtype.size)
        out = mx.distributed.all_sum(out, group=self.group)
        if inds.ndim >= 2 and inds.shape[-2] > 1:  # a prompt chunk: its experts' bytes freed before the next layer's
            mx.eval(out)  # SYNC: once per layer of a prompt chunk, as whole-layer prefill
        return out


class Traffic:
    """What this rank's all_sums carried since it loaded."""

    def __init__(self):
        self.bytes_sent = 0  # each all_sum's payload (a ring moves about this much per rank for two ranks)
        self.messages = 0

    def add(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.messages += 1


def shard_experts(engine, group) -> Traffic:
    """Replace each MoE block's executor by this rank's ShardedExperts; returns their traffic counter."""
    from ..model.route_stats import moe_blocks

    blocks = moe_blocks(engine.store.model)
    if not blocks or not all(hasattr(b, "executor") for b in blocks.values()):
        raise Edge0Error(f"{engine.store.path}: expert parallel needs Edge0's MoE blocks (qwen3_moe, qwen3_5_moe, "
                         "bailing_moe)")
    traffic = Traffic()
    e = engine.store.manifest.num_experts
    for block in blocks.values():
        block.executor = ShardedExperts(block.executor, group, e, traffic)
    no_whole_layers(engine.store.runtime, [b.executor.inner for b in blocks.values()])
    return traffic


class LayerAtATime:
    """A pipeline rank's MoE executor: a prompt chunk's layer evaluated before the next layer builds, so that the
    experts it read are freed (no whole-layer prefill: no_whole_layers)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        out = self.inner(x, inds)
        if inds.ndim >= 2 and inds.shape[-2] > 1:
            mx.eval(out)  # SYNC: once per layer of a prompt chunk, as whole-layer prefill
        return out


def layer_at_a_time(engine) -> None:
    """A pipeline rank's prompt: each layer's routed experts read and freed in turn. Whole-layer prefill keeps two
    banks of every expert of a layer, the same bytes on every rank, whatever the ranks; this rank's share of the
    memory would not shrink with them."""
    from ..model.route_stats import moe_blocks

    blocks = [b for b in moe_blocks(engine.store.model).values() if hasattr(b, "executor")]
    if not blocks or getattr(engine.store.runtime, "prefill", None) is None:
        return
    for block in blocks:
        block.executor = LayerAtATime(block.executor)
    no_whole_layers(engine.store.runtime, [b.executor.inner for b in blocks])


def no_whole_layers(runtime, executors: list) -> None:
    """A prompt's experts read as a decode step's (its unique routed ids, here this rank's alone), not every expert of
    each layer (whole-layer prefill would read the other ranks' experts on every rank)."""
    prefill = getattr(runtime, "prefill", None)
    if prefill is None:
        return
    prefill.close()  # nothing read yet: drops no bank
    runtime.prefill = None
    for ex in [*getattr(runtime, "executors", {}).values(), *executors]:
        if getattr(ex, "prefill", None) is prefill:
            ex.prefill = None
