"""Recording what an Edge0 model's MoE blocks route to (routing statistics, head training targets)."""

from __future__ import annotations

from contextlib import contextmanager

from ..errors import Edge0Error
from .adapter import FamilyBlock, expert_slots


def moe_blocks(model) -> dict:
    """{layer: MoE block} of a loaded store's model with a router interface (logits, select, route, top_k):
    Edge0's own blocks, or a family's block given FamilyBlock's interface; wherever the family keeps it."""
    family = {i: b for i, (_, b, _) in expert_slots(model).items() if isinstance(b, FamilyBlock)}
    return family or {i: layer.mlp for i, layer in enumerate(getattr(model, "layers", []))
                      if hasattr(layer, "mlp") and hasattr(layer.mlp, "route")}


@contextmanager
def recorded_routes(model, layers: list[int] | None = None):
    """Within the block, every routing of the given MoE layers (default all) is recorded as
    {layer: [(x, router logits, routed ids), ...]}, one entry per forward through the block."""
    blocks = {i: b for i, b in moe_blocks(model).items() if layers is None or i in layers}
    if layers is not None and len(blocks) < len(layers):
        raise Edge0Error(f"layers {sorted(set(layers) - set(blocks))} are not Edge0 MoE blocks")
    if not blocks:
        raise Edge0Error("routing records need an Edge0 store with MoE layers whose router Edge0 knows; convert the "
                         "checkpoint first (edge0 convert)")
    records: dict[int, list] = {i: [] for i in blocks}
    for i, blk in blocks.items():
        if isinstance(blk, FamilyBlock):  # the family routes in its own code: record from its input
            def observe(x, _blk=blk, _rec=records[i]):
                logits = _blk.logits(x)
                _rec.append((x, logits, _blk.select(logits)[0]))

            blk.observe = observe
            continue

        def route(x, _blk=blk, _rec=records[i]):
            logits = _blk.logits(x)
            inds, scores = _blk.select(logits)
            _rec.append((x, logits, inds))
            return inds, scores

        object.__setattr__(blk, "route", route)  # an instance attribute shadows the method
    try:
        yield records
    finally:
        for blk in blocks.values():
            if isinstance(blk, FamilyBlock):
                blk.observe = None
            else:
                object.__delattr__(blk, "route")
