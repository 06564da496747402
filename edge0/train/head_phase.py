"""Phase 1: distil prerouter heads on the served base (the int4 store, frozen).

    edge0 train heads --model edge0/model/demo/store --out heads-k4.safetensors --k 4 --steps 300

Each step runs the store's model over one window of training text, records every MoE layer's input
h, router logits and routed ids, and fits each head (owner N -> consumer M) to M's router
distribution at the next token: KL(softmax(router_M,t+1) || softmax(head_t)). Features stream from the
forward passes (nothing is stored beyond one window). Held-out recall@K per consumer layer is reported
for repeat, next-router and the trained heads.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..compute.machine import blas
from ..errors import Edge0Error
from ..config.checks import check_seed, positive, routed_k, whole
from ..model.heads import FORMAT as HEADS_FORMAT, HIDDEN, HeadSet, multi_hot
from ..model.route_stats import recorded_routes
from .loop import (World, blas_notice, check_out, finite_loss, load_checkpoint, progress_bar, save_checkpoint,
                   write_outputs)
from .student import mlx_kernel

SEQ_LEN = 256


def window_targets(model, window: np.ndarray, layers: list[int]):
    """One forward over the window; per MoE layer: h (T, D), router logits (T, E), routed ids (T, K)."""
    with recorded_routes(model, layers) as rec:
        model(mx.array(window[None]))
    out = {i: tuple(a[0] for a in rec[i][-1]) for i in layers}
    mx.eval([a for v in out.values() for a in v])
    return out, {i: model.layers[i].mlp for i in layers}


def window_features(h: mx.array, inds: mx.array, experts: int) -> mx.array:
    """Features at t = 0..T-2 of a window: (h_t, multi-hot t, multi-hot t-1; zeros at t = 0), as served."""
    now = multi_hot(inds[:-1], experts)  # (T-1, E)
    prev = mx.concatenate([mx.zeros((1, experts)), now[:-1]])
    return mx.concatenate([h[:-1].astype(mx.float32), now, prev], axis=-1)


def head_loss(heads: HeadSet, module, data: dict, blocks: dict, experts: int):
    total = 0.0
    for consumer, owner in heads.owners.items():
        h, _, inds = data[owner]
        _, target, _ = data[consumer]
        feats = window_features(h, inds, experts)
        router = mx.stop_gradient(blocks[consumer].logits(h[:-1]).astype(mx.float32))
        pred = module.heads[f"layer_{consumer}"](feats, router)
        p = mx.softmax(target[1:].astype(mx.float32), axis=-1)
        logq = pred - mx.logsumexp(pred, axis=-1, keepdims=True)
        logp = mx.log(mx.maximum(p, 1e-30))
        total = total + (p * (logp - logq)).sum(-1).mean()
    return total / len(heads.owners)


def recall(heads: HeadSet, data: dict, blocks: dict, experts: int) -> dict:
    """Per consumer: fraction of layer M's routed experts at t+1 named by repeat, next-router and the head."""
    out = {}
    for consumer, owner in heads.owners.items():
        h, _, inds = data[owner]
        _, _, true = data[consumer]
        k = true.shape[-1]
        feats = window_features(h, inds, experts)
        router = blocks[consumer].logits(h[:-1])
        guesses = {
            "repeat": true[:-1],
            "next-router": blocks[consumer].select(router)[0],
            "heads": blocks[consumer].select(heads.heads[consumer](feats, router.astype(mx.float32)))[0],
        }
        t = np.array(true[1:])
        out[consumer] = {}
        for name, g in guesses.items():
            g = np.array(g)
            out[consumer][name] = float((g[:, :, None] == t[:, None, :]).any(-1).sum() / (t.shape[0] * k))
    return out


def _windows(stream: np.ndarray, seq_len: int) -> list[np.ndarray]:
    n = (stream.size - 1) // seq_len
    return [stream[i * seq_len:(i + 1) * seq_len].astype(np.int32) for i in range(n)]


@dataclass
class HeadRun:
    """What one head-training run works on."""

    store: object  # model.load.Store, the int4 model as served
    layers: list  # its MoE layers
    top_k: int  # K the heads serve
    train: list  # training windows
    held: list  # held-out windows
    train_desc: str
    held_desc: str
    data_hash: str  # of the training stream, recorded in the head file


def train_heads(model_dir: str | os.PathLike, out: str | os.PathLike, *, data=None, heldout=None, top_k: int | None = None,
                steps: int = 300, hidden: int = HIDDEN, lr: float = 1e-3, seed: int = 0, eval_windows: int = 8,
                resume: bool = False, progress: bool = True, seq_len: int = SEQ_LEN, consumers=None) -> dict:
    """Train heads for the store at K = top_k (default the model's); returns the report (also written as JSON).
    Data parallel under mlx.launch: each rank fits its own window per step, gradients averaged (train/loop.py)."""
    from ..model.load import load_store

    out = Path(out)
    check_head_flags(top_k=top_k, hidden=hidden, lr=lr, seed=seed)
    report_path = check_out(out, resume, steps, fmt=HEADS_FORMAT, inputs={"--data": data, "--heldout": heldout},
                            ckpt=out.with_suffix(".ckpt"))
    world = World.init()
    blas_notice(world, progress)
    store = load_store(model_dir, dtype="float32", executor="staged")
    try:
        run = _prepare(store, Path(model_dir), data, heldout, top_k, seq_len, eval_windows)
        mx.random.seed(seed)  # fc1's initial draw
        heads = HeadSet.create(store.manifest, store.config, top_k=run.top_k, hidden=hidden,
                               consumers=consumers)  # None: the default layout
        heads.data_hash = run.data_hash
        with mlx_kernel():  # gradients: the edge0 kernels have none
            before, after, losses = _fit_heads(run, heads, world, out.with_suffix(".ckpt"), steps=steps, lr=lr,
                                               seed=seed, resume=resume, progress=progress)
        report = {"model": str(model_dir), "top_k": run.top_k, "steps": steps, "seed": seed, "hidden": hidden,
                  "ranks": world.size, "blas": blas(), "train": run.train_desc, "heldout": run.held_desc,
                  "data_hash": run.data_hash,
                  "consumers": sorted(heads.owners), "owners": {str(c): o for c, o in heads.owners.items()},
                  "recall_before": before, "recall": after, "losses": losses}
        if world.writer:
            write_outputs(out, report_path, report, lambda p: heads.save(p, {"report": json.dumps({"recall": after})}))
        return report
    finally:
        store.close()


def _prepare(store, model_dir: Path, data, heldout, top_k, seq_len: int, eval_windows: int) -> HeadRun:
    from .corpus import token_stream, train_stream

    m = store.manifest
    routed_k(top_k, m.num_experts)
    k = top_k or m.top_k
    layers = [e.layer for e in m.layers]
    for i in layers:
        store.model.layers[i].mlp.top_k = k
    stream, train_desc = train_stream(model_dir, data)
    held_stream, held_desc = token_stream(model_dir, heldout)
    train_w, held_w = _windows(stream, seq_len), _windows(held_stream, seq_len)[:eval_windows]
    if not train_w or not held_w:
        raise Edge0Error("not enough text for one training and one held-out window")
    return HeadRun(store, layers, k, train_w, held_w, train_desc, held_desc,
                   hashlib.sha256(stream.tobytes()).hexdigest()[:16])


def _fit_heads(run: HeadRun, heads: HeadSet, world: World, ckpt: Path, *, steps: int, lr: float, seed: int,
               resume: bool, progress: bool) -> tuple[dict, dict, list]:
    """(held-out recall before, after, losses); checkpoints every 50 steps and at the end for --resume."""
    m, model = run.store.manifest, run.store.model
    module = heads.module()
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.0)
    same = {"hidden": heads.hidden, "k": run.top_k, "seed": seed}
    loaded = load_checkpoint(ckpt, opt, same) if resume else None
    start = 0
    if loaded is not None:
        module.load_weights(list(loaded[0].items()))
        start = loaded[1]["step"]
    order = np.random.default_rng(seed).permutation(len(run.train))
    blocks = {}  # the MoE blocks of the windows' forward passes (head_loss reads their routers)
    loss_grad = nn.value_and_grad(module, lambda mod, d: head_loss(heads, mod, d, blocks, m.num_experts))
    held = [window_targets(model, w, run.layers) for w in run.held]
    blocks.update(held[0][1])
    before = _mean_recall([recall(heads, d, blocks, m.num_experts) for d, _ in held])
    losses = []
    bar = progress_bar(world, steps, start, "heads", progress)
    for step in range(start, steps):
        d, _ = window_targets(model, run.train[order[(step * world.size + world.rank) % len(order)]], run.layers)
        loss, grads = loss_grad(module, d)
        opt.update(module, world.mean(grads))
        mx.eval(module.parameters(), opt.state, loss)
        loss = world.sum(loss).item() / world.size  # SYNC: once per step, for the log
        losses.append(finite_loss(loss, step + 1, "heads"))
        bar.update(1)
        bar.set_postfix(kl=f"{losses[-1]:.4f}")
        if world.writer and ((step + 1) % 50 == 0 or step + 1 == steps):
            save_checkpoint(ckpt, dict(tree_flatten(module.parameters())), opt, {"step": step + 1, **same})
    bar.close()
    after = _mean_recall([recall(heads, d, blocks, m.num_experts) for d, _ in held])
    return before, after, losses


def _mean_recall(per_window: list[dict]) -> dict:
    layers = per_window[0].keys()
    return {str(c): {name: float(np.mean([w[c][name] for w in per_window])) for name in per_window[0][c]}
            for c in layers}


def check_head_flags(*, top_k, hidden: int, lr: float, seed: int) -> None:
    """The flags of `train heads` (and make-workload's heads) checked before the store loads; K against the model's
    experts once its manifest is read."""
    routed_k(top_k)
    whole("--hidden", hidden, 1)
    positive("--lr", lr)
    check_seed(seed)
