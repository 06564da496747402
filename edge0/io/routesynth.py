"""Synthetic routing traces, for models with no recorded routing (`edge0 trace synth`). SYNTHETIC: not a model's.

    trace = synth_trace(layers=48, experts=128, top_k=8, tokens=200, seed=0)   # a RouteTrace, weights None
    route_stats(trace.ids, experts=128)        # {"kept": .., "top_quarter": ..}, each a mean over layers

Each layer keeps each of the last token's experts with probability KEPT and draws the rest, without replacement,
from the experts it did not just use, by a fixed popularity per layer (log-normal weights, randomly placed, their
spread fitted so that a quarter of the experts take TOP_QUARTER of the routings). Both targets are the OLMoE-1B-7B
traces' (tests/data/olmoe, seeds 1-3, mean over layers). Shapes: L layers, T tokens, K routed, E experts.
"""

from __future__ import annotations

import numpy as np

from ..errors import Edge0Error
from .routetrace import RouteTrace

KEPT = 0.41  # of a layer's K experts, the share routed again at the next token
SYNTH_MAX = {"layers": 1024, "experts": 4096, "top_k": 64, "tokens": 100_000}  # real models sit far inside
TOP_QUARTER = 0.60  # of a layer's routings in a generation, the share its most used quarter of experts takes


def synth_trace(layers: int, experts: int, top_k: int, tokens: int, seed: int = 0, kept: float = KEPT,
                top_quarter: float = TOP_QUARTER) -> RouteTrace:
    """A trace of `tokens` rows whose layers each keep `kept` of their experts a token and whose popularity puts
    `top_quarter` of the routings on a quarter of the experts."""
    if not (0 < top_k < experts and layers > 0 and tokens > 0):
        raise Edge0Error(f"synthetic trace: needs 0 < K ({top_k}) < experts ({experts}), layers and tokens > 0")
    if not (0 <= kept < 1 and 0.25 < top_quarter < 1):
        raise Edge0Error(f"synthetic trace: kept {kept} must be in [0, 1), top quarter {top_quarter} in (0.25, 1)")
    sigma = _fit_spread(experts, top_k, kept, top_quarter, seed)
    rng = np.random.default_rng(seed)
    ids = np.stack([_layer(rng, sigma, experts, top_k, tokens, kept) for _ in range(layers)])
    return RouteTrace(ids=ids.astype(np.int32), weights=None, layers=list(range(layers)), num_experts=experts)


def route_stats(ids: np.ndarray, experts: int) -> dict:
    """Mean over layers of the kept share (|S_t & S_t-1| / K) and the top quarter's share of routings."""
    _, t, k = ids.shape
    kept, top = [], []
    for lay in ids:
        same = (lay[1:, :, None] == lay[:-1, None, :]).any(axis=2).sum(axis=1)
        kept.append(same.mean() / k)
        counts = np.sort(np.bincount(lay.ravel(), minlength=experts))[::-1]
        top.append(counts[: experts // 4].sum() / counts.sum())
    return {"kept": float(np.mean(kept)), "top_quarter": float(np.mean(top))}


def _layer(rng, sigma: float, experts: int, top_k: int, tokens: int, kept: float) -> np.ndarray:
    logp = rng.permutation(sigma * rng.standard_normal(experts))
    out = np.empty((tokens, top_k), np.int64)
    prev = np.array([], np.int64)
    for t in range(tokens):
        stay = prev[rng.random(prev.size) < kept]
        # Gumbel top-k: draws without replacement in proportion to the popularity
        score = logp + rng.gumbel(size=experts)
        score[prev] = -np.inf
        new = np.argpartition(-score, top_k - stay.size)[: top_k - stay.size]
        out[t] = prev = np.concatenate([stay, new])
    return out


def _fit_spread(experts: int, top_k: int, kept: float, top_quarter: float, seed: int) -> float:
    # bisection on 6 simulated layers of 500 tokens (the targets were measured on 500); the share rises with it
    lo, hi = 0.0, 4.0
    for _ in range(10):
        mid = (lo + hi) / 2
        rng = np.random.default_rng(seed + 1)
        lays = np.stack([_layer(rng, mid, experts, top_k, 500, kept) for _ in range(6)])
        share = route_stats(lays, experts)["top_quarter"]
        lo, hi = (mid, hi) if share < top_quarter else (lo, mid)
    return (lo + hi) / 2


def synth_file(file: str, *, layers: int | None, experts: int | None, top_k: int | None, tokens: int | None,
               seed: int | None) -> str:
    """`edge0 trace synth FILE --layers L --experts E --top-k K --tokens T [--seed S]`: FILE must be new. Returns
    the line the command prints."""
    from pathlib import Path

    from .routetrace import write_trace

    shape = {"layers": layers, "experts": experts, "top_k": top_k, "tokens": tokens}
    for f, v in shape.items():
        if v is None or not 1 <= v <= SYNTH_MAX[f]:
            raise Edge0Error(f"--{f.replace('_', '-')}: `edge0 trace synth` needs it, from 1 to {SYNTH_MAX[f]} (got {v})")
    if shape["experts"] < 4:
        raise Edge0Error(f"--experts {shape['experts']}: at least 4 (the popularity is fitted over a quarter of them)")
    if seed is not None and seed < 0:
        raise Edge0Error(f"--seed {seed}: must be 0 or more")
    out = Path(file)
    if out.exists() or out.is_symlink():
        raise Edge0Error(f"{out}: exists; name a new file (no file is written over)")
    trace = synth_trace(**shape, seed=seed or 0)
    write_trace(out, trace)
    s = route_stats(trace.ids, shape["experts"])
    return (f"wrote {out}: SYNTHETIC routing, {shape['layers']} layers x {shape['experts']} experts, top-{shape['top_k']}, "
          f"{shape['tokens']} tokens; kept {s['kept']:.3f} (target {KEPT}), top quarter's share {s['top_quarter']:.3f} "
          f"(target {TOP_QUARTER})")
