"""Recording what an Edge0 model's MoE blocks route to (routing statistics, head training targets)."""

from __future__ import annotations

from contextlib import contextmanager

from ..errors import Edge0Error


@contextmanager
def recorded_routes(model, layers: list[int] | None = None):
    """Within the block, every routing of the given MoE layers (default all) is recorded as
    {layer: [(x, router logits, routed ids), ...]}, one entry per forward through the block."""
    blocks = {i: layer.mlp for i, layer in enumerate(model.layers)
              if (layers is None or i in layers) and hasattr(layer.mlp, "route")}
    if layers is not None and len(blocks) < len(layers):
        raise Edge0Error(f"layers {sorted(set(layers) - set(blocks))} are not Edge0 MoE blocks")
    if not blocks:
        raise Edge0Error("routing records need an Edge0 store with MoE layers; convert the checkpoint first "
                         "(edge0 convert)")
    records: dict[int, list] = {i: [] for i in blocks}
    for i, blk in blocks.items():
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
            object.__delattr__(blk, "route")
