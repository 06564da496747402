"""Prerouter heads: owned by MoE layer N, they predict layer M's (the next MoE layer's) router logits
for the next token, from what layer N knows now.

Features at token t: concat(h_N,t, multi-hot of N's routed set at t, multi-hot at t-1), size D + 2E.
logits_M,t+1 = router_M(h_N,t) + delta(features) + fc2(gelu(fc1(features)))
router_M is layer M's own (frozen, as served) router and delta and fc2 start at zero, so an untrained
head *is* the next-router predictor (bit for bit); the residual's hidden-state block is thus initialised
from M's router weights and its multi-hot blocks at zero (docs/DESIGN.md §10).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..compute.dense import linear
from ..compute.kernel_choice import current
from ..errors import Edge0Error, SettingError
from ..io.atomic import atomic_path

HIDDEN = 512  # head width (docs/DESIGN.md §10)
SKIP_FIRST = 2  # MoE layers at the start that keep their own router (their input moves fastest)
FEATURES = "h|multi_hot_t|multi_hot_t-1"
FORMAT = "edge0-heads-1"  # the metadata that names a heads file


class Head(nn.Module):
    def __init__(self, dim: int, experts_in: int, experts_out: int, hidden: int = HIDDEN):
        super().__init__()
        width = dim + 2 * experts_in
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, experts_out)
        self.delta = nn.Linear(width, experts_out, bias=False)
        self.fc2.weight = mx.zeros_like(self.fc2.weight)
        self.fc2.bias = mx.zeros_like(self.fc2.bias)
        self.delta.weight = mx.zeros_like(self.delta.weight)

    def __call__(self, features: mx.array, router_logits: mx.array) -> mx.array:
        # (T, E); served on the edge0 kernel, a row's logits do not depend on the rows beside it (compute/dense.py)
        return router_logits + linear(features, self.delta) + linear(nn.gelu(linear(features, self.fc1)), self.fc2)

    def predict(self, h: mx.array, inds: mx.array, prev_inds: mx.array | None, router_logits: mx.array) -> mx.array:
        """self(features(h, inds, prev_inds), router_logits) as served: on the edge0 kernel one node (the same
        products; MLX builds the features and the head as about 18 nodes), rows independent as in __call__."""
        ext = current().ext
        fc1, fc2 = self["fc1"], self["fc2"]
        params = (self["delta"]["weight"], fc1["weight"], fc1["bias"], fc2["weight"], fc2["bias"])
        weights = (params[0].dtype, params[1].dtype, params[3].dtype)
        if (ext is not None and h.dtype == router_logits.dtype == mx.float32 and inds.dtype == mx.uint32
                and (prev_inds is None or prev_inds.dtype == mx.uint32) and params[2].dtype == params[4].dtype
                == mx.float32 and len(set(weights)) == 1 and weights[0] in (mx.float32, mx.bfloat16)):
            return ext.head(h, inds, prev_inds, router_logits, *params)
        experts = (fc1["weight"].shape[1] - h.shape[-1]) // 2
        return self(features(h, inds, prev_inds, experts), router_logits)


def multi_hot(inds: mx.array, experts: int) -> mx.array:
    """(..., K) ids -> (..., E) float 0/1."""
    return (mx.arange(experts) == inds[..., None]).any(axis=-2).astype(mx.float32)


def features(h: mx.array, inds: mx.array, prev_inds: mx.array | None, experts: int) -> mx.array:
    """concat(h, multi-hot(t), multi-hot(t-1)); prev_inds None means no previous token (zeros)."""
    now = multi_hot(inds, experts)
    prev = multi_hot(prev_inds, experts) if prev_inds is not None else mx.zeros_like(now)
    return mx.concatenate([h.astype(mx.float32), now, prev], axis=-1)


def default_consumers(moe_layers: list[int]) -> list[int]:
    """Every MoE layer but the first SKIP_FIRST and the last consumes a head (owned by its predecessor)."""
    return moe_layers[SKIP_FIRST:-1] if len(moe_layers) > SKIP_FIRST + 1 else moe_layers[1:]


def model_fingerprint(manifest, config: dict) -> str:
    """What a head file is bound to: the store's expert checksums and the model's shapes."""
    h = hashlib.sha256()
    h.update(json.dumps({k: config.get(k) for k in sorted(config) if k != "quantization"}, sort_keys=True,
                        default=str).encode())
    for entry in (getattr(manifest, "whole", None) or manifest).layers:  # a pipeline rank's: its store's (dist)
        h.update("".join(entry.checksums).encode())
    return h.hexdigest()[:16]


@dataclass
class HeadSet:
    """All heads of one model at one K."""

    heads: dict  # consumer layer -> Head
    owners: dict  # consumer layer -> owner layer
    top_k: int
    hidden: int
    fingerprint: str
    data_hash: str = ""
    routes: list | None = None  # consumers whose prediction is the routing under predicted routing (None: all);
    # the others' heads only name experts to read ahead (a head too weak to route still hides reads)

    def served(self) -> "HeadSet":
        """The heads as served: their weight matrices (fc1, fc2, delta) in bfloat16, their biases float32. A head's
        weights are read at every decode step, more bytes than the step's int4 weights; half of them go, at no
        measurable cost in quality (docs/lab/cpu-kernels.md). The products still run in float32 on the widened values (exact), on every kernel."""
        for head in self.heads.values():
            for lin in (head.fc1, head.fc2, head.delta):
                lin.weight = lin.weight.astype(mx.bfloat16)
        mx.eval(self.module().parameters())
        return self

    def module(self) -> nn.Module:
        m = nn.Module()
        m.heads = {f"layer_{c}": h for c, h in self.heads.items()}  # not bare digits: those unflatten as list indices
        return m

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """safetensors with the layout in its metadata; written atomically."""
        path = Path(path)
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "top_k": str(self.top_k),
                "hidden": str(self.hidden), "features": FEATURES, "data_hash": self.data_hash,
                "owners": json.dumps({str(c): o for c, o in self.owners.items()}), **(extra or {})}
        if self.routes is not None:
            meta["routes"] = json.dumps(sorted(self.routes))
        weights = dict(tree_flatten(self.module().parameters()))
        with atomic_path(path) as tmp:
            mx.save_safetensors(str(tmp), weights, metadata=meta)

    @classmethod
    def create(cls, manifest, config: dict, *, top_k: int, hidden: int = HIDDEN, consumers=None) -> "HeadSet":
        moe = [e.layer for e in manifest.layers]
        consumers = consumers if consumers is not None else default_consumers(moe)
        owners = {c: moe[moe.index(c) - 1] for c in consumers}
        dim = _hidden_size(config)
        heads = {c: Head(dim, manifest.num_experts, manifest.num_experts, hidden) for c in consumers}
        return cls(heads, owners, top_k, hidden, model_fingerprint(manifest, config))

    @classmethod
    def load(cls, path: str | Path, manifest, config: dict, *, top_k: int | None = None) -> "HeadSet":
        path = Path(path)
        if not path.exists():
            raise Edge0Error(f"{path}: no such head file")
        try:
            weights, meta = mx.load(str(path), return_metadata=True)
        except (RuntimeError, ValueError) as e:
            raise Edge0Error(f"{path}: not a safetensors head file ({e})") from None
        if meta.get("format") != FORMAT:
            raise Edge0Error(f"{path}: not an Edge0 head file (metadata format {meta.get('format')!r})")
        want = model_fingerprint(manifest, config)
        if meta.get("fingerprint") != want:
            raise Edge0Error(f"{path}: heads were trained for another model (fingerprint {meta.get('fingerprint')}, "
                             f"this store is {want})")
        try:
            k, hidden = int(meta["top_k"]), int(meta["hidden"])
            owners = {int(c): int(o) for c, o in json.loads(meta["owners"]).items()}
            routes = [int(c) for c in json.loads(meta["routes"])] if "routes" in meta else None
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise Edge0Error(f"{path}: damaged head metadata ({e!r})") from None
        if top_k is not None and k != top_k:
            raise SettingError(f"{path}: heads for K={k}, but {{routing.top_k}} {top_k} was asked; use the head file "
                               f"trained for K={top_k}")
        dim = _hidden_size(config)
        hs = cls({c: Head(dim, manifest.num_experts, manifest.num_experts, hidden) for c in owners}, owners, k, hidden,
                 want, meta.get("data_hash", ""), routes)
        try:
            hs.module().load_weights(list(weights.items()), strict=True)
        except ValueError as e:
            raise Edge0Error(f"{path}: head weights do not match their metadata ({e})") from None
        refuse_nonfinite(path, weights)
        mx.eval(hs.module().parameters())
        return hs


def refuse_nonfinite(path, arrays: dict) -> None:
    """Refuse a trained file (heads, adapter) holding NaN or inf: served, it turns every later token into noise."""
    names = sorted(n for n, w in arrays.items() if mx.issubdtype(w.dtype, mx.floating))
    finite = mx.stack([mx.all(mx.isfinite(arrays[n])) for n in names]) if names else mx.array([True])
    if not mx.all(finite).item():  # SYNC: once, at load
        bad = names[finite.tolist().index(False)]
        raise Edge0Error(f"{path}: {bad} holds values that are not finite (NaN or inf); train it again")


def _hidden_size(config: dict) -> int:
    return config.get("hidden_size") or config.get("text_config", {})["hidden_size"]
