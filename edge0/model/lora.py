"""The recovery adapter: an unmerged LoRA served beside the int4 weights (docs/DESIGN.md §10, the adapter).

    y = W_int4 x + (alpha / r) B A x

as a parallel branch of every dense projection of a decoder layer: attention (q/k/v/o), linear
attention, shared experts and dense MLPs; and beside each MoE block of Edge0's own, a branch from the
block's input to its output (kind moe_block: `layers.{i}.mlp.branch`), added to the experts' weighted sum,
so that what routing by prediction (or at a smaller K) changes in the block's output is repaid where it
happens. Routers and the streamed routed experts never carry one.
Merging the delta into W and requantizing would erase most of it (the delta is far below the int4
step), so it stays a separate low-rank product. An adapter is trained on the served path, predicted
routing by one set of heads included (`edge0 train lora`), so a file is bound to its store and its head
file by fingerprints and refused with anything else.

File: safetensors with `layers.{i}.{path}.lora_a` (D_in, r) and `.lora_b` (r, D_out), and the layout
in its metadata (format, rank, alpha, fingerprint, heads, top_k).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..compute.qmm import lora_add, lora_linear
from ..errors import Edge0Error, SettingError
from ..io.atomic import atomic_path
from .heads import model_fingerprint, refuse_nonfinite

FORMAT = "edge0-lora-1"
RANK = 16
ALPHA = 32.0
ROUTERS = ("gate", "shared_expert_gate")  # an MoE block's routing linears (mlp.gate, mlp.gate.gate_proj, ...)


class LoRALinear(nn.Module):
    """base(x) + scale * (x @ lora_a) @ lora_b; the base is any linear (quantized as served, dense in training)."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, scale: float):
        super().__init__()
        self.base = base
        self.lora_a = lora_a  # (D_in, r)
        self.lora_b = lora_b  # (r, D_out)
        self.scale = scale
        self.rounds_to = None  # training: the dtype the adapter is served in (its values rounded to it, gradients
        # straight through), so the student computes with the served adapter's numbers

    def __call__(self, x: mx.array) -> mx.array:
        base, a, b = self["base"], self["lora_a"], self["lora_b"]
        if self.rounds_to is not None and self.rounds_to != a.dtype:
            a, b = (w + mx.stop_gradient(w.astype(self.rounds_to).astype(w.dtype) - w) for w in (a, b))
        fused = lora_linear(x, base, a, b, self.scale)  # one node (edge0 kernel)
        if fused is not None:
            return fused
        return mx.addmm(base(x), x @ a, b, alpha=self.scale)  # MLX: two more nodes


class LoRABranch(nn.Module):
    """The branch beside an MoE block (`block.branch`): its output y becomes y + scale * (x @ lora_a) @ lora_b, x the
    block's input. The block has no weight of its own to carry the product, so the branch is all there is."""

    def __init__(self, lora_a: mx.array, lora_b: mx.array, scale: float):
        super().__init__()
        self.lora_a = lora_a  # (D, r)
        self.lora_b = lora_b  # (r, D)
        self.scale = scale
        self.rounds_to = None  # as LoRALinear's

    def add(self, y: mx.array, x: mx.array) -> mx.array:
        a, b = self["lora_a"], self["lora_b"]
        if self.rounds_to is not None and self.rounds_to != a.dtype:
            a, b = (w + mx.stop_gradient(w.astype(self.rounds_to).astype(w.dtype) - w) for w in (a, b))
        fused = lora_add(y, x, a, b, self.scale)  # one node (edge0 kernel)
        if fused is not None:
            return fused
        return mx.addmm(y, x @ a, b, alpha=self.scale)

    def arrays(self) -> tuple[mx.array, mx.array, float]:
        """(lora_a, lora_b, scale) as served, for a block node that adds the branch itself."""
        return self["lora_a"], self["lora_b"], float(self.scale)


def moe_branch_dims(block: nn.Module) -> int | None:
    """The hidden width of an Edge0 MoE block that can carry a branch (its router's input), None for other modules."""
    from .blocks import SigmoidGroupMoeBlock, SoftmaxMoeBlock

    if isinstance(block, SoftmaxMoeBlock):
        return _dims(block["gate"])[0]
    if isinstance(block, SigmoidGroupMoeBlock):
        return _dims(block["gate"]["gate_proj"])[0]
    return None


def kind_of(rel: str) -> str | None:
    """What a projection at `rel` (a path inside a decoder layer) is, or None when it takes no adapter."""
    parts = rel.split(".")
    if parts[0] in ("self_attn", "attention"):
        return "attention"
    if parts[0] == "linear_attn":
        return "linear_attention"
    if parts[0] == "mlp" and len(parts) > 1:
        if parts[1] in ROUTERS:
            return None
        if parts[1] == "branch":
            return "moe_block"
        return "shared_expert" if parts[1].startswith("shared_expert") else "dense_mlp"
    return None


def targets(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """{"layers.{i}.{path}": (linear, kind)} of every projection that takes an adapter, in layer order, then the
    MoE blocks' branches {"layers.{i}.mlp.branch": (block, "moe_block")} (the order a fresh adapter draws them in)."""
    out, branches = {}, {}
    for i, layer in enumerate(model.layers):
        for rel, m in layer.named_modules():
            if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and not rel.endswith(".base"):
                kind = kind_of(rel)
                if kind is not None:
                    out[f"layers.{i}.{rel}"] = (m, kind)
        if "mlp" in layer and moe_branch_dims(layer["mlp"]) is not None:
            branches[f"layers.{i}.mlp.branch"] = (layer["mlp"], "moe_block")
    return out | branches


def _dims(m: nn.Module) -> tuple[int, int]:
    """(D_in, D_out) of a dense or quantized linear, or of an MoE block's branch (D, D)."""
    if "weight" not in m and (d := moe_branch_dims(m)) is not None:
        return d, d
    out_dims, packed = m.weight.shape
    return (packed * 32 // m.bits if isinstance(m, nn.QuantizedLinear) else packed), out_dims


def put_projection(model: nn.Module, key: str, module: nn.Module) -> None:
    """Put `module` at "layers.{i}.{path}" of `model` (an adapted projection, or its bare base)."""
    _, i, *path = key.split(".")
    parent = model.layers[int(i)]
    for p in path[:-1]:
        parent = parent[p]
    setattr(parent, path[-1], module)


def heads_fingerprint(path: str | Path) -> str:
    """What an adapter is bound to besides its store: the bytes of the head file its routing came from."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:16]


@dataclass
class Adapter:
    """One model's adapter: per projection (lora_a, lora_b), with what it is bound to."""

    weights: dict  # "layers.{i}.{path}" -> (lora_a (D_in, r), lora_b (r, D_out))
    rank: int
    alpha: float
    fingerprint: str  # the store's (model/heads.py model_fingerprint)
    heads: str  # heads_fingerprint of the head file it was trained with
    top_k: int  # K of those heads
    meta: dict = field(default_factory=dict)  # anything else the file's metadata holds (its training report)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def create(cls, model: nn.Module, *, rank: int = RANK, alpha: float = ALPHA, fingerprint: str, heads: str,
               top_k: int, seed: int = 0) -> "Adapter":
        """A fresh adapter: lora_a drawn uniform in +-1/sqrt(D_in), lora_b zero, so it starts as no change."""
        key = mx.random.key(seed)
        weights = {}
        for name, (m, _) in targets(model).items():
            d_in, d_out = _dims(m)
            key, sub = mx.random.split(key)
            bound = 1 / math.sqrt(d_in)
            weights[name] = (mx.random.uniform(-bound, bound, (d_in, rank), key=sub), mx.zeros((rank, d_out)))
        return cls(weights, rank, alpha, fingerprint, heads, top_k)

    def arrays(self) -> dict[str, mx.array]:
        return {f"{k}.lora_{ab}": w for k, pair in self.weights.items() for ab, w in zip("ab", pair)}

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """safetensors with the binding in its metadata; written atomically."""
        meta = {"format": FORMAT, "rank": str(self.rank), "alpha": repr(float(self.alpha)),
                "fingerprint": self.fingerprint, "heads": self.heads, "top_k": str(self.top_k),
                **{k: v for k, v in self.meta.items() if isinstance(v, str)}, **(extra or {})}
        with atomic_path(Path(path)) as tmp:
            mx.save_safetensors(str(tmp), {k: v.astype(mx.float32) for k, v in self.arrays().items()}, metadata=meta)

    @classmethod
    def read(cls, path: str | Path) -> "Adapter":
        """The file as it is, unchecked against any store (see `load`)."""
        path = Path(path)
        if not path.is_file():
            raise Edge0Error(f"{path}: no such adapter file")
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
        except (RuntimeError, ValueError) as e:
            raise Edge0Error(f"{path}: not a safetensors adapter file ({e})") from None
        if meta.get("format") != FORMAT:
            raise Edge0Error(f"{path}: not an Edge0 adapter (metadata format {meta.get('format')!r})")
        try:
            rank, alpha, top_k = int(meta["rank"]), float(meta["alpha"]), int(meta["top_k"])
            fingerprint, heads = meta["fingerprint"], meta["heads"]
        except (KeyError, ValueError) as e:
            raise Edge0Error(f"{path}: damaged adapter metadata ({e!r})") from None
        if rank < 1 or not math.isfinite(alpha):
            raise Edge0Error(f"{path}: damaged adapter metadata (rank {rank}, alpha {alpha})")
        refuse_nonfinite(path, arrays)
        pairs: dict = {}
        for name, w in arrays.items():
            stem, _, ab = name.rpartition(".lora_")
            if ab not in ("a", "b") or not stem:
                raise Edge0Error(f"{path}: unexpected tensor {name}")
            pairs.setdefault(stem, [None, None])["ab".index(ab)] = w
        for stem, (a, b) in pairs.items():
            if a is None or b is None or a.shape[1] != rank or b.shape[0] != rank:
                raise Edge0Error(f"{path}: {stem} does not hold a rank-{rank} pair lora_a (D_in, r), lora_b (r, D_out)")
        rest = {k: v for k, v in meta.items() if k not in ("format", "rank", "alpha", "fingerprint", "heads", "top_k")}
        return cls({k: tuple(v) for k, v in pairs.items()}, rank, alpha, fingerprint, heads, top_k, rest)

    @classmethod
    def load(cls, path: str | Path, manifest, config: dict, *, heads_file: str | Path | None) -> "Adapter":
        """The file, checked against the store and the head file a run routes with (None: not predicted)."""
        a = cls.read(path)
        a.check_model(path, manifest, config)
        if heads_file is None:
            raise Edge0Error(f"{path}: the adapter was trained with predicted routing (heads for K={a.top_k}); this "
                             "run does not route with heads: use --routing predicted, or --lora none")
        got = heads_fingerprint(heads_file)
        if a.heads != got:
            raise Edge0Error(f"{path}: the adapter was trained with other heads (K={a.top_k}, heads {a.heads}); this "
                             f"run routes with {heads_file} ({got}): pass the adapter trained with it, or --lora none")
        return a

    def check_model(self, path: str | Path, manifest, config: dict) -> None:
        """Refuse an adapter trained for another model than the store's (`path` names it in the message)."""
        want = model_fingerprint(manifest, config)
        if self.fingerprint != want:
            raise Edge0Error(f"{path}: adapter trained for another model (fingerprint {self.fingerprint}, this store is "
                             f"{want})")

    def attach(self, model: nn.Module, dtype: mx.Dtype | None = None) -> int:
        """Wrap each adapted projection of `model` in LoRALinear (shapes checked); returns how many."""
        found = targets(model)
        missing = sorted(set(self.weights) - set(found))
        if missing:
            raise Edge0Error(f"adapter: {missing[0]} is not an adaptable projection of this model")
        for name, (a, b) in self.weights.items():
            base, _ = found[name]
            if (a.shape[0], b.shape[1]) != _dims(base):
                raise Edge0Error(f"adapter: {name} is {a.shape[0]} -> {b.shape[1]}, the model's is "
                                 f"{' -> '.join(map(str, _dims(base)))}")
            a, b = (w.astype(dtype) for w in (a, b)) if dtype is not None else (a, b)
            branch = kind_of(name.split(".", 2)[2]) == "moe_block"
            put_projection(model, name,
                           LoRABranch(a, b, self.scale) if branch else LoRALinear(base, a, b, self.scale))
        mx.eval([m.parameters() for m in adapted(model).values()])
        return len(self.weights)

    @staticmethod
    def served_dtype(compute: mx.Dtype) -> mx.Dtype:
        """The dtype of lora_a and lora_b as served: bfloat16 under float32 compute (half the bytes a decode step
        reads for them; the products widen them exactly, so they compute in float32 on the rounded values, at no
        measurable cost in quality: docs/lab/cpu-kernels.md), the compute dtype otherwise. Training keeps them float32."""
        return mx.bfloat16 if compute == mx.float32 else compute

    def kinds(self) -> dict[str, int]:
        """Adapted projections per kind (attention, linear_attention, shared_expert, dense_mlp, moe_block)."""
        out: dict[str, int] = {}
        for name in self.weights:
            kind = kind_of(name.split(".", 2)[2])
            out[kind] = out.get(kind, 0) + 1
        return out


def adapted(model: nn.Module) -> dict[str, LoRALinear | LoRABranch]:
    """{"layers.{i}.{path}": LoRALinear or LoRABranch} of the model's adapted projections and MoE blocks."""
    out = {}
    for i, layer in enumerate(model.layers):
        for rel, m in layer.named_modules():
            if isinstance(m, (LoRALinear, LoRABranch)):
                out[f"layers.{i}.{rel}"] = m
    return out


def read_weights(model: nn.Module) -> dict:
    """The adapted projections' (lora_a, lora_b), as Adapter.weights holds them."""
    return {k: (m.lora_a, m.lora_b) for k, m in adapted(model).items()}


def resolve_lora(lora: str | None, store: Path, *, routing: str, default_heads: bool, top_k: int | None) -> str:
    """The adapter a run uses, or "none": --lora FILE as given (checked against the routing here, against the
    store when opened); no flag: lora-k{K}.safetensors next to the store, when the run routes predicted with
    the store's own heads-k{K}.safetensors."""
    from ..io.manifest import read_manifest

    if lora == "none":
        return lora
    if lora is not None:
        if routing != "predicted":
            raise SettingError(f"{{routing.lora}} {lora}: an adapter is trained with predicted routing; "
                               f"{{routing.mode}} {routing} does not apply (use {{routing.mode}} predicted, or "
                               "{routing.lora} none)")
        return lora
    if routing != "predicted" or not default_heads:
        return "none"
    manifest = read_manifest(store)
    found = store / f"lora-k{top_k or manifest.top_k}.safetensors"
    if not found.exists() and manifest.lists(found.name):  # the store's own adapter gone: not a run without one
        raise SettingError(f"{found}: missing, though {store / 'edge0.json'} lists it (restore it, or pass "
                           "{routing.lora} none to serve without the adapter)")
    return str(found) if found.exists() else "none"
