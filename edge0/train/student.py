"""The student path of Phases 2 and 3: the store's model as served, made differentiable.

    student = load_student("edge0/model/demo/store", "edge0/model/demo/store/heads-k4.safetensors")
    logits = student.model(tokens)  # (B, T, V): routing as served, the adapter's branches in place

The base is the dequantized reconstruction of the int4 store (every quantized linear, the embeddings
and the routed experts), frozen; only the adapter's lora_a and lora_b train. Routing is the served
path's, predicted by the heads at K: at a consumer layer M, position t routes by the K likeliest under M's own
router among the `candidates` likeliest of head(features of its owner N at t - 1), with the router's softmax
weights; the first `prefix` positions route by M's own router, as a fresh
context's first token (eval) or a prompt's tokens (generation) do when served. Other layers route by
their own router. Everything builds on MLX's own ops (the edge0 kernels have no gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from ..compute.kernel_choice import Kernel
from ..errors import Edge0Error
from ..model.heads import HeadSet, multi_hot
from ..model.lora import Adapter, adapted, heads_fingerprint


def _dequantized(m: nn.Module) -> nn.Module | None:
    """A float copy of a quantized linear or embedding (same math up to rounding); None for anything else."""
    if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return None
    w = mx.dequantize(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode)
    if isinstance(m, nn.QuantizedEmbedding):
        e = nn.Embedding(*w.shape)
        e.weight = w
        return e
    lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
    lin.weight = w
    if "bias" in m:
        lin.bias = m["bias"]
    return lin


def grouped_glu(x: mx.array, inds: mx.array, gate: mx.array, up: mx.array, down: mx.array) -> mx.array:
    """down(silu(gate(x)) * up(x)) of the routed experts, x (..., D), inds (..., K) -> (..., K, D), with weights
    (E, D, H), (E, D, H), (E, H, D): one dense product per expert over the rows routed to it (on CPU several
    times faster than gather_mm's row-by-row products)."""
    k = inds.shape[-1]
    flat = inds.flatten()
    order = mx.argsort(flat)  # rows grouped by expert
    counts = np.bincount(np.array(flat), minlength=down.shape[0])  # SYNC: once per layer
    xs = x.reshape(-1, x.shape[-1])[order // k]  # (N*K, D)
    outs, at = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = xs[at:at + n]
            outs.append((nn.silu(rows @ gate[e]) * (rows @ up[e])) @ down[e])
            at += n
    return mx.concatenate(outs)[mx.argsort(order)].reshape(*inds.shape, -1)


class DenseExperts:
    """A layer's routed experts dequantized from the store's bank, computed by grouped_glu."""

    def __init__(self, bank: dict, quant):
        def deq(name):
            w = mx.dequantize(bank[f"{name}.weight"], bank[f"{name}.scales"], bank.get(f"{name}.biases"),
                              group_size=quant.group_size, bits=quant.bits, mode=quant.mode)
            return mx.contiguous(w.swapaxes(-1, -2))  # (E, in, out)

        self.gate, self.up, self.down = deq("gate_proj"), deq("up_proj"), deq("down_proj")
        mx.eval(self.gate, self.up, self.down)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        return grouped_glu(x, inds, self.gate, self.up, self.down)


class ServedRouting:
    """Routes a forward of (B, T) positions starting at `offset` (a KV cache's length) as the served path does
    (module docstring); installed on the blocks' `route`. Each layer keeps its last position's input and last
    two routed sets, so a chunk after the first (decoding) predicts from the chunk before it."""

    def __init__(self, model: nn.Module, heads: HeadSet, experts: int):
        self.heads, self.experts = heads, experts
        self.prefix = 1  # leading positions routed by the layer's own router
        self.offset = 0  # position of this forward's first token
        self.seen: dict[int, tuple] = {}  # layer -> (inputs at positions offset-1.., multi-hots at offset-2..)
        self.blocks = {i: layer.mlp for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "route")}
        for i, blk in self.blocks.items():
            object.__setattr__(blk, "route", lambda x, _i=i: self.route(_i, x))  # shadows the method

    def start(self, offset: int, prefix: int) -> None:
        """Before a forward: its first position, and how many leading positions route natively."""
        if offset == 0:
            self.seen.clear()
        self.offset, self.prefix = offset, prefix

    def route(self, layer: int, x: mx.array) -> tuple[mx.array, mx.array]:
        blk, t = self.blocks[layer], x.shape[1]
        routes = getattr(self.heads, "routes", None)  # consumers whose head routes them (None: every consumer)
        owner = self.heads.owners.get(layer) if routes is None or layer in routes else None
        q = min(max(self.prefix - self.offset, 0), t)  # positions [0, q) of x route natively
        if owner is None or q == t:
            inds, scores = blk.select(blk.logits(x))
        else:
            h, mh = self.seen[owner]  # features at position p - 1 for p = offset..: (h, multi-hot, the one before)
            feats = mx.concatenate([h[:, q:t].astype(mx.float32), mh[:, q + 1:t + 1], mh[:, q:t]], axis=-1)
            logits = self.heads.heads[layer](feats, blk.logits(h[:, q:t]).astype(mx.float32))
            if hasattr(blk, "choose"):  # the head names candidates, the layer's router chooses K of them
                inds, scores = blk.choose(x[:, q:t], *blk.decide(logits))
            else:
                inds, scores = blk.select(logits)
            if q:
                ni, ns = blk.select(blk.logits(x[:, :q]))
                inds = mx.concatenate([ni, inds.astype(ni.dtype)], axis=1)
                scores = mx.concatenate([ns, scores.astype(ns.dtype)], axis=1)
        self._remember(layer, x, mx.stop_gradient(inds))
        return inds, scores

    def _remember(self, layer: int, x: mx.array, inds: mx.array) -> None:
        """seen[layer]: inputs at positions offset-1 .. and multi-hots at offset-2 .. (zeros before position 0)."""
        mh = multi_hot(inds, self.experts)  # (B, T, E)
        if self.offset == 0:
            h_before, mh_before = mx.zeros_like(x[:, :1]), mx.zeros((mh.shape[0], 2, mh.shape[2]), mh.dtype)
        else:
            h_old, mh_old = self.seen[layer]
            h_before, mh_before = h_old[:, -1:], mh_old[:, -2:]
        self.seen[layer] = (mx.concatenate([h_before, x], 1), mx.concatenate([mh_before, mh], 1))


@dataclass
class Student:
    """A store's model on the student path, with its adapter attached (the only trainable parameters)."""

    model: nn.Module
    store: object  # model.load.Store (its reader stays open until close)
    heads: HeadSet
    heads_file: Path
    routing: ServedRouting
    kernel: Kernel  # MLX's own: the graphs need gradients
    candidates: int  # experts each head names, its consumer's router choosing K of them

    def adapter(self, adapter: Adapter) -> None:
        """Attach `adapter` (only its weights train from now on)."""
        adapter.attach(self.model, mx.float32)
        self.model.freeze()
        for m in adapted(self.model).values():
            m.unfreeze(keys=["lora_a", "lora_b"], recurse=False)
            m.rounds_to = Adapter.served_dtype(mx.float32)  # trained on the numbers it is served with

    def logits(self, tokens: mx.array, prefix: int = 1, cache=None) -> mx.array:
        """(B, T) ids -> (B, T, V) float32, the first `prefix` positions routed natively; with a KV cache the
        tokens continue it."""
        self.routing.start(cache[0].offset if cache else 0, prefix)
        with self.kernel.active():
            return self.model(tokens, cache=cache).astype(mx.float32)

    def generate(self, prompts: np.ndarray, new: int, *, temp: float, key: mx.array) -> np.ndarray:
        """(B, P) prompts continued by `new` tokens sampled on the student path, routed as served (the prompt by
        the layers' own routers, generated tokens by prediction): (B, P + new) int32."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        prefix = prompts.shape[1]
        logits = self.logits(mx.array(prompts), prefix, cache)[:, -1]
        out = []
        for _ in range(new):
            key, sub = mx.random.split(key)
            out.append(mx.random.categorical(logits * (1 / temp), key=sub))  # (B,)
            logits = self.logits(out[-1][:, None], prefix, cache)[:, -1]
        return np.concatenate([prompts, np.array(mx.stack(out, axis=1)).astype(np.int32)], axis=1)

    def close(self) -> None:
        self.store.close()


def default_heads_file(store: Path, top_k: int) -> Path:
    return store / f"heads-k{top_k}.safetensors"


def load_student(store_dir: str | Path, heads_file: str | Path | None = None, top_k: int | None = None,
                 candidates: int | None = None) -> Student:
    """The store dequantized, at K = top_k (default the heads'), routed by `heads_file` (default heads-k{K}): each
    head names `candidates` experts (default 2K, as served over resident experts), its layer's router chooses K."""
    from ..config.checks import routed_k
    from ..io.manifest import read_manifest
    from ..model.arch import read_config
    from ..model.load import load_store

    store_dir = Path(store_dir)
    manifest, config = read_manifest(store_dir), read_config(store_dir)
    routed_k(top_k, manifest.num_experts)
    k = top_k or manifest.top_k
    heads_file = Path(heads_file) if heads_file else default_heads_file(store_dir, k)
    if not heads_file.exists():
        raise Edge0Error(f"{heads_file}: no prerouter heads for K={k}; the adapter trains on predicted routing, so "
                         f"train the heads first: edge0 train heads --model {store_dir} --out {heads_file} --k {k}")
    heads = HeadSet.load(heads_file, manifest, config, top_k=top_k).served()  # routing exactly as served
    m = candidates if candidates is not None else min(2 * heads.top_k, manifest.num_experts)
    if not heads.top_k <= m <= manifest.num_experts:
        raise Edge0Error(f"--candidates {m}: must be between K = {heads.top_k} and the model's "
                         f"{manifest.num_experts} experts")
    routing = heads.owners if heads.routes is None else {c: heads.owners[c] for c in heads.routes}
    late = sorted(c for c, o in routing.items() if o >= c)
    if late:  # the consumer's routing at t would need a later layer at t - 1: not one parallel forward
        raise Edge0Error(f"{heads_file}: the head of layer {late[0]} is owned by a later layer; the student path "
                         "trains heads owned by an earlier layer only")
    kernel = Kernel.choose("mlx")
    with kernel.active():
        store = load_store(store_dir, dtype="float32", executor="resident")
        model = store.model
        swaps = [(path, d) for path, m in model.named_modules() if (d := _dequantized(m)) is not None]
        model.update_modules(tree_unflatten(swaps))
        for i, layer in enumerate(model.layers):
            if i in store.runtime.executors:
                ex = store.runtime.executors[i]
                layer.mlp.executor = DenseExperts(ex.bank, ex.quant)
                layer.mlp.top_k = heads.top_k
                layer.mlp.candidates = m
    mx.eval(model.parameters())
    return Student(model, store, heads, heads_file, ServedRouting(model, heads, manifest.num_experts), kernel, m)


def new_adapter(student: Student, *, rank: int, alpha: float, seed: int) -> Adapter:
    from ..model.heads import model_fingerprint

    s = student.store
    return Adapter.create(student.model, rank=rank, alpha=alpha, fingerprint=model_fingerprint(s.manifest, s.config),
                          heads=heads_fingerprint(student.heads_file), top_k=student.heads.top_k, seed=seed)


def mlx_kernel():
    """MLX's own kernels, active for the graphs built inside (the edge0 kernels have no gradients)."""
    return Kernel.choose("mlx").active()
