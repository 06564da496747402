"""`edge0 eval`: held-out perplexity of a model, and how far it is from a teacher.

    edge0 eval                                              # the built-in model on the stdlib held-out split
    edge0 eval --model STORE --data FILE_OR_DIR --teacher FP_DIR --json
    edge0 eval --routing-stats                              # + expert usage and cross-token overlap per layer

The token stream (a file, every .py file under a directory, or a .npy of token ids) is cut into
consecutive windows of --seq-len tokens, each scored from a fresh context; --max-tokens caps the
scored tokens. With a teacher (normally the float checkpoint the store was made from), each scored
position also gives top-1 agreement (same argmax) and KL(teacher || model) in nats: the price of
int4, and later of predicted routing. Models compute in float32 on CPU (--dtype auto).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0.compute.dense import log_softmax
from edge0.errors import Edge0Error

MAX_TOKENS = 4096  # scored tokens by default: a few seconds for the demo model on CPU
SEQ_LEN = 256  # tokens per window (the demo model's training window)


@dataclass
class Loaded:
    """A model from a store or an mlx-lm checkpoint, with what is needed to release it."""

    model: object  # mlx-lm model class (Edge0 MoE blocks for a store)
    tokenizer_dir: Path  # holds tokenizer.json
    kind: str  # "store" or "mlx-lm"
    close: object  # () -> None
    logprobs: object = None  # window -> (L, V) log-probabilities, when not one forward pass (served routing)
    kernel: object = None  # the engine's Kernel (a store's); None: the current one


def _load_served(config) -> Loaded:
    """A store opened as served (edge0/engine.py); with scheduled routing every window is decoded token by
    token (teacher-forced), since predicted routing at t+1 depends on the heads' output at t."""
    from edge0.engine import open_engine

    engine = open_engine(config)
    c = engine.config
    stepwise = c.routing.mode != "native"  # native (at any K): one forward pass gives the same log-probabilities
    return Loaded(engine.store.model, Path(c.model), f"store, routing {c.routing.mode}", engine.close,
                  (lambda w: engine.forced_logprobs([int(t) for t in w])) if stepwise else None, engine.kernel)


def load_any(path: str | os.PathLike, dtype: str = "auto") -> Loaded:
    """An Edge0 store through load_store, anything else through mlx_lm.load (floats cast like a store's)."""
    from edge0.model.load import cast_floats, compute_dtype, load_store

    path = Path(path)
    if not (path / "config.json").exists():
        raise Edge0Error(f"{path}: no config.json; not a model directory")
    if (path / "edge0.json").exists():
        store = load_store(path, dtype=dtype)
        return Loaded(store.model, path, "store", store.close)
    from mlx_lm import load

    try:
        model, _ = load(str(path))
    except (ValueError, FileNotFoundError) as e:
        raise Edge0Error(f"{path}: cannot load with mlx_lm.load ({e})") from None
    cast_floats(model, compute_dtype(dtype))
    mx.eval(model.parameters())
    return Loaded(model, path, "mlx-lm", lambda: None)


def windows_of(stream: np.ndarray, seq_len: int, max_tokens: int) -> list[np.ndarray]:
    """Consecutive windows of seq_len + 1 tokens (the last shorter), scoring at most max_tokens in all."""
    out, i = [], 0
    while i + 1 < stream.size and sum(w.size - 1 for w in out) < max_tokens:
        n = min(seq_len, max_tokens - sum(w.size - 1 for w in out), stream.size - 1 - i)
        out.append(stream[i:i + n + 1].astype(np.int32))
        i += n
    if not out:
        raise Edge0Error("the data holds fewer than two tokens")
    return out


def _logprobs(model, window: np.ndarray) -> mx.array:
    logits = model(mx.array(window[None, :-1])).astype(mx.float32)[0]  # (L, V)
    return log_softmax(logits)


def evaluate(model_dir: str | os.PathLike, data: str | os.PathLike | None = None, *,
             teacher: str | os.PathLike | None = None, max_tokens: int = MAX_TOKENS, seq_len: int = SEQ_LEN,
             dtype: str = "auto", routing: bool = False, config=None) -> dict:
    """Perplexity of model_dir (store or mlx-lm checkpoint) on data, and vs the teacher if given.

    Returns loss (nats/token), ppl, tokens; with a teacher also teacher_loss, teacher_ppl,
    top1_agreement, kl (mean KL(teacher || model) per token); with routing, routing_stats's figures.
    config: the EngineConfig a store is scored with (default: the store's served defaults, as `edge0 run`
    runs it, with `dtype`); an mlx-lm checkpoint is loaded resident.
    """
    from edge0.config import EngineConfig, KernelConfig

    if (Path(model_dir) / "edge0.json").exists() or config is not None:
        config = config or EngineConfig(kernel=KernelConfig(dtype=dtype))
        student = _load_served(dataclasses.replace(config, model=str(model_dir)))
    else:
        student = load_any(model_dir, dtype)
    try:
        from edge0.train.corpus import token_stream

        stream, desc = token_stream(student.tokenizer_dir, data)
        wins = windows_of(stream, seq_len, max_tokens)
        tutor = load_any(teacher, dtype) if teacher is not None else None
        try:
            with (student.kernel.active() if student.kernel else contextlib.nullcontext()):
                sums, n = _score(student, tutor, wins)
        finally:
            if tutor is not None:
                tutor.close()
        nll, t_nll, agree, kl = sums
        out = dict(model=str(model_dir), kind=student.kind, data=desc, tokens=n, windows=len(wins), seq_len=seq_len,
                   loss=nll / n, ppl=math.exp(nll / n))
        if tutor is not None:
            out.update(teacher=str(teacher), teacher_loss=t_nll / n, teacher_ppl=math.exp(t_nll / n),
                       top1_agreement=agree / n, kl=kl / n)
        if routing:
            out["routing"] = routing_stats(student.model, wins)
    finally:
        student.close()
    return out


def _score(student: Loaded, tutor: Loaded | None, wins: list[np.ndarray]) -> tuple[list[float], int]:
    """Summed (student NLL, teacher NLL, top-1 agreements, KL(teacher || student)) over the windows, and
    the tokens scored."""
    sums = [0.0] * 4
    n = 0
    for w in wins:
        targets = mx.array(w[1:])
        lp = student.logprobs(w) if student.logprobs else _logprobs(student.model, w)  # (L, V)
        parts = [-mx.take_along_axis(lp, targets[:, None], axis=-1).sum()]
        if tutor is not None:
            tlp = _logprobs(tutor.model, w)
            parts += [-mx.take_along_axis(tlp, targets[:, None], axis=-1).sum(),
                      (mx.argmax(tlp, axis=-1) == mx.argmax(lp, axis=-1)).sum(),
                      (mx.exp(tlp) * (tlp - lp)).sum()]
        mx.eval(parts)
        for i, p in enumerate(parts):
            sums[i] += p.item()  # SYNC: once per window
        n += w.size - 1
    return sums, n


def routing_stats(model, windows: list[np.ndarray]) -> dict:
    """Expert usage and cross-token overlap per MoE layer over the windows.

    used_fraction: share of experts routed to at least once; effective_fraction: exp(entropy of the
    load) / E (1.0 when perfectly balanced); overlap: mean |S_t & S_t+1| / K between consecutive
    tokens of a window (K/E if routing were independent across tokens).
    """
    from edge0.model.route_stats import recorded_routes

    E = model.args.num_experts
    K = model.args.num_experts_per_tok
    with recorded_routes(model) as records:
        seen = list(records.values())
        counts = np.zeros((len(seen), E), np.int64)
        inter = np.zeros(len(seen))
        pairs = 0
        for w in windows:
            for rec in seen:
                rec.clear()
            mx.eval(model(mx.array(w[None, :-1])))
            for li, rec in enumerate(seen):
                ids = np.array(mx.concatenate([inds.reshape(-1, K) for _, _, inds in rec]))  # (L, K)
                np.add.at(counts[li], ids.reshape(-1), 1)
                hit = (ids[1:, :, None] == ids[:-1, None, :]).any(-1).sum()
                inter[li] += hit / K
            pairs += w.size - 2
    load = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    ent = -(np.where(load > 0, load * np.log(np.where(load > 0, load, 1)), 0)).sum(1)
    return dict(
        experts=E, top_k=K, tokens=int(counts[0].sum() // K),
        used_fraction=[float(x) for x in (counts > 0).mean(1)],
        effective_fraction=[float(x) for x in np.exp(ent) / E],
        max_load=[float(x) for x in load.max(1)],
        overlap=[float(x) for x in inter / max(pairs, 1)],
        overlap_mean=float((inter / max(pairs, 1)).mean()),
        overlap_independent=K / E,
    )
