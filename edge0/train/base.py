"""`edge0 train base`: train a small Qwen3-MoE language model from scratch on the Python standard library.

    edge0 train base --out runs/demo --preset demo            # about an hour on one CPU core (OpenBLAS)
    edge0 train base --out runs/demo --preset demo --resume   # continue from the latest checkpoint
    edge0 train base --out /tmp/t --preset tiny --steps 8     # seconds (tests)

    # Linux CPU: MLX's wheel uses the reference BLAS; OpenBLAS makes float32 training ~10x faster.
    apt-get install libopenblas0-pthread
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 edge0 train base --out runs/demo

The model is mlx-lm's own `qwen3_moe.Model` (softmax top-k routing, renormalised), so the exported
checkpoint loads with `mlx_lm.load` and converts with `edge0 convert`. Training adds a Switch-style
load-balancing loss, computed from each layer's router in `forward_with_aux`, which walks the same
modules mlx-lm's forward does: the parameter names stay mlx-lm's. Batches are drawn from
numpy.random.default_rng([seed, step]): a run resumed from a checkpoint sees exactly the batches and
losses of an uninterrupted one. On CPU, training in float32 with OpenBLAS preloaded is fastest
(docs/DESIGN.md §15); the exported weights are bfloat16 and need neither.

OUT/data     tokenizer and token streams (edge0.train.corpus)
OUT/ckpt     step_N.safetensors (weights), step_N.opt.safetensors (AdamW state), step_N.json (last: marks it
             complete); edge0/train/base_ckpt.py
OUT/log.jsonl  one line per step: step, loss, ce, aux, lr, tokens, elapsed_s; eval lines carry heldout_loss
OUT/fp       the float (bf16) mlx-lm checkpoint;  OUT/store  its int4 Edge0 store
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from edge0.errors import Edge0Error
from edge0.config.checks import check_seed
from edge0.io.atomic import atomic_dir
from edge0.model.tokenizer import SPECIAL_TOKENS
from edge0.train.base_ckpt import (_truncate_log, _write_atomic, check_run_dir, latest_checkpoint,  # noqa: F401
                                   load_checkpoint, read_log, save_checkpoint)  # read_log: the run's curve, for callers
from edge0.model.tokenizer import save_tokenizer_files
from edge0.train.corpus import Corpus, prepare_corpus
from edge0.compute.machine import blas
from edge0.train.loop import World, blas_notice

EOS_ID = SPECIAL_TOKENS.index("<|im_end|>")


@dataclass
class Preset:
    """Model shape and training schedule of one named configuration."""

    layers: int  # decoder layers, every one MoE
    hidden: int  # D
    heads: int  # query heads of head_dim each
    kv_heads: int
    head_dim: int
    experts: int  # E
    top_k: int  # K routed per token
    moe_hidden: int  # H, per expert
    vocab: int  # BPE vocabulary, special tokens included
    seq_len: int  # tokens per training window
    batch: int  # windows per step
    steps: int
    lr: float  # peak AdamW learning rate
    warmup: int  # linear warmup steps
    weight_decay: float
    aux_coef: float  # weight of the load-balancing loss (Switch: E * sum_e f_e P_e, 1.0 when uniform)
    eval_every: int  # steps between held-out evaluations
    eval_tokens: int  # held-out tokens per evaluation
    ckpt_every: int  # steps between checkpoints
    max_files: int | None = None  # corpus files cap (tests)


PRESETS = {
    # 6 layers x 32 experts (K 4, H 128), D 256: 22M parameters, 5M active; 850 steps x 4096 tokens
    # (3.5M tokens, 1.4 epochs) train in about an hour on two cores with OpenBLAS.
    "demo": Preset(layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=32, top_k=4, moe_hidden=128,
                   vocab=4096, seq_len=256, batch=16, steps=850, lr=2e-3, warmup=50, weight_decay=0.1,
                   aux_coef=0.01, eval_every=100, eval_tokens=16384, ckpt_every=50),
    "tiny": Preset(layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2, moe_hidden=64,
                   vocab=512, seq_len=32, batch=4, steps=8, lr=3e-3, warmup=2, weight_decay=0.1,
                   aux_coef=0.01, eval_every=4, eval_tokens=256, ckpt_every=4, max_files=12),
}


def model_config(p: Preset) -> dict:
    """The Hugging Face style config.json of the qwen3_moe model (mlx-lm reads it as is)."""
    return dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu",
        hidden_size=p.hidden, num_hidden_layers=p.layers, num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads, head_dim=p.head_dim, num_experts=p.experts,
        num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_hidden, intermediate_size=4 * p.hidden,
        norm_topk_prob=True, rms_norm_eps=1e-6, vocab_size=p.vocab, tie_word_embeddings=False,
        eos_token_id=EOS_ID, bos_token_id=None, use_cache=True, attention_bias=False, attention_dropout=0.0,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, rope_theta=10000.0,
        router_aux_loss_coef=p.aux_coef, output_router_logits=False, sliding_window=None,
        use_sliding_window=False, torch_dtype="bfloat16",
    )


def build_model(config: dict, seed: int) -> nn.Module:
    """mlx-lm's qwen3_moe.Model at its default initialisation under `seed`, float32."""
    from mlx_lm.models import qwen3_moe

    mx.random.seed(seed)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def forward_with_aux(model: nn.Module, inputs: mx.array) -> tuple[mx.array, mx.array]:
    """Logits as mlx-lm's forward computes them, and the mean over layers of the load-balancing loss.

    Per layer: aux = E * sum_e f_e * P_e, f_e the fraction of routed slots going to expert e
    (not differentiable), P_e the mean router probability of e; 1.0 when balanced.
    """
    from mlx_lm.models.base import create_attention_mask

    h = model.model.embed_tokens(inputs)  # (B, L, D)
    mask = create_attention_mask(h, None)
    aux = []
    for layer in model.model.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask, None)
        x = layer.post_attention_layernorm(h)
        moe = layer.mlp
        probs = mx.softmax(moe.gate(x), axis=-1, precise=True)  # (B, L, E)
        k, n_exp = moe.top_k, moe.num_experts
        inds = mx.stop_gradient(mx.argpartition(probs, kth=-k, axis=-1)[..., -k:])  # (B, L, K)
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if moe.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = moe.switch_mlp(x, inds)  # (B, L, K, D)
        h = h + (y * scores[..., None]).sum(axis=-2)
        frac = mx.zeros((n_exp,), probs.dtype).at[inds.reshape(-1)].add(1.0) / inds.size
        aux.append(n_exp * (frac * probs.reshape(-1, n_exp).mean(axis=0)).sum())
    logits = model.lm_head(model.model.norm(h))
    return logits, mx.stack(aux).mean()


def loss_fn(model: nn.Module, inputs: mx.array, targets: mx.array, aux_coef: float):
    logits, aux = forward_with_aux(model, inputs)
    ce = nn.losses.cross_entropy(logits, targets, reduction="mean")
    return ce + aux_coef * aux, (ce, aux)


def batch_at(stream: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> tuple[mx.array, mx.array]:
    """The step's (inputs, targets): random windows drawn from default_rng([seed, step])."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - seq_len - 1, size=batch)
    win = np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    return mx.array(win[:, :-1]), mx.array(win[:, 1:])


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> list[np.ndarray]:
    """Consecutive non-overlapping windows of seq_len + 1 tokens from the stream's start."""
    n = min(max_tokens // seq_len, (stream.size - 1) // seq_len)
    return [stream[i * seq_len:i * seq_len + seq_len + 1].astype(np.int32) for i in range(max(n, 1))]


def heldout_loss(model: nn.Module, windows: list[np.ndarray], batch: int) -> float:
    """Mean next-token cross-entropy (nats) of the model over the windows."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = np.stack(windows[i:i + batch])
        logits = model(mx.array(w[:, :-1]))
        ce = nn.losses.cross_entropy(logits, mx.array(w[:, 1:]), reduction="sum")
        total += ce.item()  # SYNC: once per eval batch
        count += w[:, 1:].size
    return total / count


def make_optimizer(p: Preset) -> optim.Optimizer:
    decay = optim.cosine_decay(p.lr, max(p.steps - p.warmup, 1), end=p.lr * 0.1)
    warm = optim.linear_schedule(p.lr * 0.01, p.lr, max(p.warmup, 1))
    return optim.AdamW(learning_rate=optim.join_schedules([warm, decay], [max(p.warmup, 1)]),
                       betas=[0.9, 0.95], weight_decay=p.weight_decay)


# Training ------------------------------------------------------------------------------------------

def train_base(out: str | os.PathLike, *, preset: str = "demo", steps: int | None = None, seed: int = 0,
               resume: bool = False, export: bool = True, progress: bool = True, stop_at: int | None = None) -> dict:
    """Train (or resume) a base model into `out`; export OUT/fp and OUT/store at the end. Returns the summary.

    steps: override the preset's step count (the LR schedule follows it).
    resume: continue from the latest complete checkpoint in OUT/ckpt; without it, OUT/ckpt must be empty.
    stop_at: stop after this step with a checkpoint and without export (an interruption, for tests).
    Data parallel under mlx.launch: each rank takes its share of every batch, gradients averaged
    (train/loop.py); rank 0 writes the log, checkpoints and exports.
    """
    p = _preset(preset, steps)
    check_seed(seed)
    out = Path(out)
    ckpt_dir = out / "ckpt"
    check_run_dir(out)
    last = latest_checkpoint(ckpt_dir)
    if last is not None and not resume:
        raise Edge0Error(f"{ckpt_dir}: holds checkpoints (latest step {last}); pass --resume or use another --out")
    if export and not resume:  # the export replaces OUT/fp and OUT/store: only ones this run's checkpoints made
        for d in (out / "fp", out / "store"):
            if d.exists():
                raise Edge0Error(f"{d}: exists and was not made by this run; move it away, use another --out, "
                                 "or pass --no-export")
    world = World.init()
    world.check_batch(p.batch)
    corpus = _corpus(out, p, world)
    config = model_config(p)
    model = build_model(config, seed)
    opt = make_optimizer(p)
    state = dict(step=0, seed=seed, preset=preset, tokens=0, elapsed_s=0.0, config=config, hparams=asdict(p))
    if last is not None:
        prev = load_checkpoint(ckpt_dir, last, model, opt)
        if prev["seed"] != seed or prev["hparams"] != asdict(p):
            raise Edge0Error(f"{ckpt_dir}/step_{last}.json: was trained with another seed or preset; resume with the same flags")
        state.update(prev)
        if world.writer:
            _truncate_log(out / "log.jsonl", state["step"])
    out.mkdir(parents=True, exist_ok=True)
    heldout = _train_loop(model, opt, p, corpus, state, out, world, progress, stop_at)
    summary = dict(preset=preset, seed=seed, steps=state["step"], tokens=state["tokens"],
                   train_s=round(state["elapsed_s"], 1), heldout_loss=heldout,
                   heldout_ppl=math.exp(heldout) if heldout else None, blas=blas(), config=config, ranks=world.size,
                   train_files=len(corpus.train_files), heldout_files=len(corpus.heldout_files),
                   train_tokens=int(corpus.train.size), heldout_tokens=int(corpus.heldout.size))
    if world.writer and export and state["step"] == p.steps:
        export_fp(model, config, corpus, out / "fp")
        from edge0.model.convert import convert

        convert(out / "fp", out / "store", force=True, progress=progress)
        summary["fp"], summary["store"] = str(out / "fp"), str(out / "store")
    if world.writer:
        _write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary


def _preset(name: str, steps: int | None) -> Preset:
    if name not in PRESETS:
        raise Edge0Error(f"--preset {name}: choose one of {', '.join(PRESETS)}")
    p = PRESETS[name]
    if steps is not None:
        if steps < 1:
            raise Edge0Error(f"--steps {steps}: must be at least 1")
        p = Preset(**{**asdict(p), "steps": steps})
    return p


def _corpus(out: Path, p: Preset, world: World) -> Corpus:
    """The corpus, prepared by the writer first when data parallel (the others then read its cache)."""
    if world.writer:
        corpus = prepare_corpus(out / "data", vocab_size=p.vocab, max_files=p.max_files)
    world.sum(mx.array(0.0)).item()  # a barrier: the cache is complete before the others read it
    if not world.writer:
        corpus = prepare_corpus(out / "data", vocab_size=p.vocab, max_files=p.max_files)
    return corpus


def _train_loop(model, opt, p: Preset, corpus: Corpus, state: dict, out: Path, world: World, progress: bool,
                stop_at: int | None) -> float | None:
    """Steps from state["step"] to the preset's (or stop_at), logging and checkpointing; the last held-out loss."""
    from tqdm import tqdm

    windows = eval_windows(corpus.heldout, p.seq_len, p.eval_tokens)
    step_fn = nn.value_and_grad(model, loss_fn)
    blas_notice(world, progress)
    bar = tqdm(total=p.steps, initial=state["step"], desc=f"train {state['preset']}",
               disable=not (progress and world.writer), dynamic_ncols=True)
    t_start = time.perf_counter() - state["elapsed_s"]
    heldout = state.get("heldout_loss")
    with open(out / "log.jsonl", "a") if world.writer else contextlib.nullcontext() as log:
        while state["step"] < min(p.steps, stop_at or p.steps):
            step, t0 = state["step"], time.perf_counter()
            inputs, targets = batch_at(corpus.train, state["seed"], step, p.batch, p.seq_len)
            (loss, (ce, aux)), grads = step_fn(model, inputs[world.rank::world.size], targets[world.rank::world.size],
                                               p.aux_coef)
            grads, _ = optim.clip_grad_norm(world.mean(grads), 1.0)
            opt.update(model, grads)
            lr = opt.learning_rate  # the rate this update used
            loss, ce, aux = (world.sum(x) / world.size for x in (loss, ce, aux))
            mx.eval(model.parameters(), opt.state, loss, ce, aux)
            loss, ce, aux, lr = loss.item(), ce.item(), aux.item(), lr.item()  # SYNC: once per step, for the log
            if not math.isfinite(loss):
                raise Edge0Error(f"step {step}: loss is {loss}; lower --lr or check the data")
            state["step"], state["tokens"] = step + 1, state["tokens"] + inputs.size
            state["elapsed_s"] = time.perf_counter() - t_start
            rec = dict(step=step + 1, loss=loss, ce=ce, aux=aux, lr=lr, tokens=state["tokens"],
                       elapsed_s=round(state["elapsed_s"], 2))
            if state["step"] % p.eval_every == 0 or state["step"] == p.steps:
                heldout = rec["heldout_loss"] = state["heldout_loss"] = heldout_loss(model, windows, p.batch)
            if world.writer:
                log.write(json.dumps(rec) + "\n")
                log.flush()
                if state["step"] % p.ckpt_every == 0 or state["step"] in (p.steps, stop_at):
                    save_checkpoint(out / "ckpt", state["step"], model, opt, state)
            bar.update(1)
            bar.set_postfix(loss=f"{ce:.3f}", aux=f"{aux:.2f}", heldout=f"{heldout:.3f}" if heldout else "-",
                            tok_s=f"{inputs.size / (time.perf_counter() - t0):.0f}")
    bar.close()
    return heldout


def export_fp(model: nn.Module, config: dict, corpus: Corpus, out: Path) -> Path:
    """A bf16 mlx-lm checkpoint: config.json, model.safetensors, tokenizer files; built aside, renamed in."""
    with atomic_dir(out, replace=True) as tmp:
        weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_tokenizer_files(tmp, corpus.tokenizer_json)
    return out
