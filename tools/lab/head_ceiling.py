"""How well the next token's routing can be predicted: heads trained from other owners and on other features, and one
given the next token itself (a ceiling no served head reaches: that token is what the step computes).

    python tools/lab/head_ceiling.py --store S [--windows 400] [--steps 1200] [--heldout-windows 8] [--consumers 2,3,4]
        [--variants previous,self,last,history,next-token] [--k K]

Every variant is the served head (edge0/model/heads.py Head: the consumer's router on the owner's MoE input, plus a
linear residual and an MLP of width 512 over the features, both starting at zero: untrained, the router alone), trained as `edge0 train
heads` trains (KL to the consumer's router distribution at t+1, AdamW 1e-3, one window of 256 tokens a step) on the
forward passes of the stdlib train split's first windows, recorded once. Variants (features at token t):
  previous    owner the MoE layer before the consumer (as served; the last layer for the first): its input h and its
              routed sets at t and t-1 (a lead of one token and one layer)
  self        owner the consumer itself (a lead of one token; untrained, its own router at t: repeat)
  last        owner the last MoE layer (the deepest state; a lead shorter than a token for all but the last layer)
  history     previous, with the owner's routed sets at t-2 and t-3 as well
  next-token  previous, with the embedding of the token at t+1 (what no head knows a step ahead: the ceiling)
Printed: held-out recall@K (the stdlib held-out split's first windows) per consumer and variant, untrained and trained.
A research tool, not a measurement of the served path; its figures are in docs/lab/pipeline.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from edge0.model.heads import Head

VARIANTS = ("previous", "self", "last", "history", "next-token")


def owner_of(variant: str, consumer: int, layers: list[int]) -> int:
    i = layers.index(consumer)
    return {"self": consumer, "last": layers[-1]}.get(variant, layers[i - 1])  # [-1]: the first's is the last


def record(store, windows: list, layers: list[int]) -> list[dict]:
    """Per window: {layer: (MoE input (T, D), router logits (T, E), routed ids (T, K))} as numpy, and "ids"."""
    from edge0.train.head_phase import window_targets

    out = []
    for w in windows:
        data, _ = window_targets(store.model, w, layers)
        rec = {i: tuple(np.array(a) for a in data[i]) for i in layers}
        rec["ids"] = w
        out.append(rec)
    return out


def features(rec: dict, variant: str, owner: int, experts: int, embed) -> np.ndarray:
    """(T-1, F) features at t = 0..T-2 of one window."""
    h, _, inds = rec[owner]
    hot = np.zeros((h.shape[0], experts), np.float32)
    np.put_along_axis(hot, inds.astype(np.int64), 1.0, axis=-1)
    parts = [h[:-1]]
    for back in range(4 if variant == "history" else 2):  # the routed sets at t, t-1 (t-2, t-3): zeros before 0
        shifted = np.zeros_like(hot[:-1])
        shifted[back:] = hot[:hot.shape[0] - 1 - back]
        parts.append(shifted)
    if variant == "next-token":
        parts.append(embed(rec["ids"][1:]))
    return np.concatenate(parts, axis=-1).astype(np.float32)


def fit(train: list, held: list, consumer: int, owner: int, variant: str, blocks: dict, experts: int, k: int,
        steps: int, embed) -> tuple[float, float]:
    """(held-out recall@k untrained, trained) of one head."""
    def prep(rec):
        router = blocks[consumer].logits(mx.array(rec[owner][0][:-1])).astype(mx.float32)
        return (mx.array(features(rec, variant, owner, experts, embed)), router,
                mx.array(rec[consumer][1][1:].astype(np.float32)), rec[consumer][2][1:])

    tr, ho = [prep(r) for r in train], [prep(r) for r in held]
    mx.random.seed(0)
    head = Head(tr[0][0].shape[1] - 2 * experts, experts, experts)  # the served head over features of this width
    opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.0)

    def loss(mod, f, router, target):
        p = mx.softmax(target, axis=-1)
        logq = mod(f, router)
        logq = logq - mx.logsumexp(logq, axis=-1, keepdims=True)
        return (p * (mx.log(mx.maximum(p, 1e-30)) - logq)).sum(-1).mean()

    step = nn.value_and_grad(head, loss)

    def held_recall(score) -> float:
        hits = total = 0
        for f, router, _, true in ho:
            guess = np.argsort(-np.array(score(f, router)), axis=-1)[:, :k]
            hits += int((guess[:, :, None] == true[:, None, :]).any(-1).sum())
            total += true.size
        return hits / total

    before = held_recall(lambda f, router: router)
    order = np.random.default_rng(0).permutation(max(steps, len(tr))) % len(tr)
    for s in range(steps):
        f, router, target, _ = tr[order[s % len(order)]]
        _, grads = step(head, f, router, target)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state)
    return before, held_recall(head)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True, help="the Edge0 store")
    p.add_argument("--windows", type=int, default=400, help="training windows recorded (default 400)")
    p.add_argument("--steps", type=int, default=1200, help="training steps of each head (default 1200)")
    p.add_argument("--heldout-windows", type=int, default=8, help="held-out windows scored (default 8)")
    p.add_argument("--consumers", help="MoE layers predicted (comma-separated; default every one)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated of {', '.join(VARIANTS)} (default all)")
    p.add_argument("--k", type=int, default=None, help="routed experts per token (default the model's)")
    a = p.parse_args()
    from edge0.errors import Edge0Error

    try:
        return run(a)
    except (Edge0Error, OSError) as e:
        print(f"head_ceiling: {e}", file=sys.stderr)
        return 1


def run(a) -> int:
    from edge0.errors import Edge0Error
    from edge0.model.load import load_store
    from edge0.model.route_stats import moe_blocks
    from edge0.train.corpus import token_stream, train_stream
    from edge0.train.head_phase import _windows
    from edge0.train.student import mlx_kernel

    variants = a.variants.split(",")
    if set(variants) - set(VARIANTS) or min(a.windows, a.steps, a.heldout_windows) < 1:
        raise Edge0Error(f"--variants {a.variants}: choose from {', '.join(VARIANTS)}; --windows, --steps and "
                         "--heldout-windows: at least 1")
    store = load_store(a.store, dtype="float32", executor="staged")
    try:
        m = store.manifest
        layers, k = [e.layer for e in m.layers], m.top_k if a.k is None else a.k
        try:
            consumers = [int(c) for c in a.consumers.split(",")] if a.consumers else layers
        except ValueError:
            raise Edge0Error(f"--consumers {a.consumers}: expected comma-separated layer numbers") from None
        if set(consumers) - set(layers):
            raise Edge0Error(f"--consumers: {sorted(set(consumers) - set(layers))} are not MoE layers "
                             f"(those: {layers})")
        if not 1 <= k <= m.num_experts:
            raise Edge0Error(f"--k {k}: between 1 and the model's {m.num_experts} experts")
        blocks = moe_blocks(store.model)
        for i in layers:
            blocks[i].top_k = k
        embed_tokens = getattr(getattr(store.model, "model", None), "embed_tokens", None)
        if "next-token" in variants and embed_tokens is None:
            raise Edge0Error("--variants next-token: this model has no token embedding (model.embed_tokens) to read")

        def embed(ids):
            return np.array(embed_tokens(mx.array(ids)).astype(mx.float32))

        t0 = time.perf_counter()
        with mlx_kernel():  # gradients: the edge0 kernels have none
            stream, _ = train_stream(Path(a.store), None)
            held_stream, _ = token_stream(Path(a.store), None)
            train = record(store, _windows(stream, 256)[:a.windows], layers)
            held = record(store, _windows(held_stream, 256)[:a.heldout_windows], layers)
            took = time.perf_counter() - t0
            print(f"recorded {len(train)} training and {len(held)} held-out windows in {took:.0f} s", file=sys.stderr)
            print(f"| consumer | variant | owner | recall@{k} untrained | trained |\n|---|---|---|---|---|")
            for c in consumers:
                for v in variants:
                    owner = owner_of(v, c, layers)
                    before, after = fit(train, held, c, owner, v, blocks, m.num_experts, k, a.steps, embed)
                    print(f"| {c} | {v} | {owner} | {before:.3f} | {after:.3f} |", flush=True)
        return 0
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
