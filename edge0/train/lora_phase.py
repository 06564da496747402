"""Phase 2: the recovery adapter, fine-tuned on the student path (`edge0 train lora`).

    edge0 train lora --model edge0/model/demo/store --out edge0/model/demo/store/lora-k4.safetensors

The base is the int4 store dequantized and frozen, routed exactly as served: predicted by the store's
trained heads at K (edge0/train/student.py). The text is the teacher's: prompts of the training split
continued by sampling the float checkpoint (--data adds text of one's own), and the loss is next-token
cross-entropy, so the adapter learns to repay what int4 and predicted routing cost. The heads come
first (Phase 1: the adapter's signal would otherwise swallow theirs); without them this refuses with
the command that trains them. Checkpoints go to OUT.ckpt (--resume continues them); the held-out
perplexity on the student path is printed every --eval-every steps, beside the no-adapter figures.
--init starts from an adapter of the same store (another K's, say) instead of a fresh one; its figures are
then the "before".
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..compute.machine import blas
from ..model.lora import ALPHA, FORMAT as LORA_FORMAT, RANK, Adapter
from .loop import (World, blas_notice, card, check_out, finite_loss, heldout_windows, load_checkpoint,
                   progress_bar, save_checkpoint, schedule, windows_of, write_outputs)
from .distill import TOP, forward_kl, log_softmax
from .student import Student, load_student, mlx_kernel, new_adapter

LOSSES = ("ce", "kd", "ce+kd")


@dataclass(frozen=True)
class Hyper:
    """The settings a run's checkpoint must be resumed with."""

    steps: int = 300  # optimizer steps
    batch: int = 8  # windows per step (over all ranks)
    seq_len: int = 256  # tokens per window
    rank: int = RANK  # r
    alpha: float = ALPHA  # the branch is scaled by alpha / r
    lr: float = 1e-3  # peak AdamW learning rate (warmup then cosine to lr / 10)
    seed: int = 0  # adapter initialisation, prompts, sampling, batch order
    temp: float = 1.0  # the teacher's sampling temperature
    samples: int = 0  # windows the teacher writes, drawn from in turn (0: steps x batch, each used once)
    top_k: int = 0  # K of the heads (set from them)
    candidates: int = 0  # experts each head names, its layer's router choosing K (set from the student)
    loss: str = "ce"  # "ce": next-token cross-entropy; "kd": KL(teacher || student) on the same windows; "ce+kd"
    top: int = TOP  # kd: teacher tokens the KL is taken over, besides the tail bucket


def next_token_loss(student: Student, tokens: mx.array) -> mx.array:
    """Mean cross-entropy of (B, T + 1) windows on the student path (position 0 routed natively)."""
    return nn.losses.cross_entropy(student.logits(tokens[:, :-1]), tokens[:, 1:], reduction="mean")


def teacher_kl_loss(student: Student, teacher_lp: mx.array, tokens: mx.array, top: int, ce: bool = False) -> mx.array:
    """Mean KL(teacher || student) over (B, T + 1) windows on the student path; teacher_lp (B, T, V), the
    teacher's log-probabilities of each next token (its whole distribution, not only the sampled token). ce: plus
    the next-token cross-entropy of the same logits (the sum: their gradients, p - onehot and p - p_teacher, weigh
    alike)."""
    s_lp = log_softmax(student.logits(tokens[:, :-1]))
    kl = forward_kl(s_lp, teacher_lp, top).mean()
    if not ce:
        return kl
    return kl - mx.take_along_axis(s_lp, tokens[:, 1:, None], axis=-1).mean()


def heldout_ppl(student: Student, windows: np.ndarray, world: World, native: bool = False) -> float:
    """Perplexity of the held-out windows on the student path (native: every position by its own router);
    the windows are shared out over the ranks."""
    nll, n = mx.array(0.0), mx.array(0.0)
    for w in world.share(list(windows)):
        tokens = mx.array(w[None])
        logits = student.logits(tokens[:, :-1], prefix=w.size - 1 if native else 1)
        nll = nll + nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="sum")
        n = n + w.size - 1
    return math.exp((world.sum(nll) / world.sum(n)).item())  # SYNC: once per evaluation


def data_windows(model_dir: Path, hp: Hyper, *, teacher, data, world: World, cache_dir: Path, progress: bool):
    """(windows, description, teacher path, teacher model): the teacher's continuations of prompts cut from the
    training text (--data, else the stdlib train split), plus --data's own windows."""
    from .corpus import train_stream
    from .teacher import GEN_BATCH, load_teacher, resolve_teacher, teacher_windows
    from ..model.arch import read_config, vocab_size

    path = resolve_teacher(model_dir, teacher)
    model = load_teacher(path, vocab_size(read_config(model_dir)))
    stream, what = train_stream(model_dir, data)  # the prompts' text
    n = hp.samples or hp.steps * hp.batch
    bar = progress_bar(world, -(-n // GEN_BATCH), 0, "teacher text", progress)
    with mlx_kernel():
        windows = teacher_windows(path, model, stream, n=n, length=hp.seq_len + 1, temp=hp.temp, seed=hp.seed,
                                  world=world, cache_dir=cache_dir, progress=bar)
    bar.close()
    desc = f"{len(windows)} windows sampled from {path} (temperature {hp.temp:g})"
    if data is not None:
        windows = np.concatenate([windows, windows_of(stream, hp.seq_len + 1)])
        desc += f" + {what}"
    return windows, desc, str(path), model


def train_lora(model_dir, out, *, teacher=None, data=None, heldout=None, heads=None, top_k: int | None = None,
               candidates: int | None = None, loss: str = "ce", top: int = TOP,
               steps: int = 300, batch: int = 8, seq_len: int = 256, rank: int = RANK, alpha: float = ALPHA,
               lr: float = 1e-3, seed: int = 0, temp: float = 1.0, samples: int = 0, eval_every: int = 50,
               eval_windows: int = 4, resume: bool = False, progress: bool = True, stop_at: int | None = None,
               init=None) -> dict:
    """Train the adapter of `model_dir` for its heads at K = top_k (default the store's); returns the report
    (also written to OUT.json). See the module docstring. stop_at: stop after this step with a checkpoint and
    no output (an interruption, for tests). init: an adapter of this store to start from (another K's, or
    another run's) instead of a fresh one."""
    out, model_dir = Path(out), Path(model_dir)
    report_path = check_out(out, resume, steps, fmt=LORA_FORMAT, inputs={
        "--teacher": teacher, "--data": data, "--heldout": heldout, "--heads": heads, "--init": init},
        ckpt=out.with_name(out.name + ".ckpt"), cache=out.with_name(out.name + ".data"))
    hp = Hyper(steps, batch, seq_len, rank, alpha, lr, seed, temp, samples, loss=loss, top=top)
    world = World.init()
    world.check_batch(batch)
    blas_notice(world, progress)
    student = load_student(model_dir, heads, top_k, candidates)
    try:
        hp = Hyper(**{**asdict(hp), "top_k": student.heads.top_k, "candidates": student.candidates})
        adapter = new_adapter(student, rank=rank, alpha=alpha, seed=seed)
        if init is not None:  # checked before the teacher writes its text
            adapter = warm_start(adapter, student, Path(init))
        pool, desc, teacher_path, tutor = data_windows(model_dir, hp, teacher=teacher, data=data, world=world,
                                                       cache_dir=out.with_name(out.name + ".data"), progress=progress)
        if "kd" not in hp.loss:
            tutor = None  # the teacher's weights are not held through training unless it scores the windows
        held, held_desc = heldout_windows(model_dir, heldout, seq_len, eval_windows)
        student.adapter(adapter)
        before = {"predicted": heldout_ppl(student, held, world), "native": heldout_ppl(student, held, world, True)}
        run = _fit(student, tutor, hp, pool, held, world,
                   out.with_name(out.name + ".ckpt"), resume, eval_every, progress, stop_at)
        report = {"model": str(model_dir), "teacher": teacher_path, "heads": str(student.heads_file),
                  "init": None if init is None else str(init), **asdict(hp),
                  "targets": adapter.kinds(),
                  "ranks": world.size, "blas": blas(), "train": desc, "heldout": held_desc,
                  "heldout_windows": len(held),
                  "heldout_ppl_before": before, **run}
        if world.writer and run["steps_done"] == hp.steps:
            adapter.weights = {k: (m.lora_a, m.lora_b) for k, m in _adapted(student).items()}
            write_outputs(out, report_path, report, lambda p: adapter.save(p, {"report": card(report)}))
        return report
    finally:
        student.close()


def warm_start(fresh: Adapter, student: Student, path: Path) -> Adapter:
    """`fresh` with the weights of the adapter at `path`: trained for this store (its fingerprint), with the same
    rank, alpha and targets; its heads and K may differ (the run binds the result to its own heads)."""
    from ..errors import Edge0Error

    try:
        a = Adapter.read(path)
        a.check_model(path, student.store.manifest, student.store.config)
    except Edge0Error as e:  # no file, not an adapter, another model's: said of --init
        raise Edge0Error(f"--init {e}") from None
    if (a.rank, a.alpha) != (fresh.rank, fresh.alpha):
        raise Edge0Error(f"--init {path}: rank {a.rank}, alpha {a.alpha:g}; this run's are {fresh.rank}, "
                         f"{fresh.alpha:g} (pass --rank {a.rank} --alpha {a.alpha:g})")
    if set(a.weights) != set(fresh.weights):
        raise Edge0Error(f"--init {path}: adapts {sorted(set(a.weights) ^ set(fresh.weights))[:3]} where this run "
                         "does not, or the reverse")
    return replace(fresh, weights=dict(a.weights))


def _adapted(student: Student) -> dict:
    from ..model.lora import adapted

    return adapted(student.model)


def _fit(student: Student, tutor, hp: Hyper, pool: np.ndarray, held: np.ndarray, world: World, ckpt: Path,
         resume: bool, eval_every: int, progress: bool, stop_at: int | None = None) -> dict:
    """The optimisation loop; returns the run's figures (losses, held-out curve, time). tutor: the teacher
    model, scoring each batch (--loss kd), else None."""
    from .teacher import logprobs

    opt = optim.AdamW(learning_rate=schedule(hp.lr, hp.steps, hp.steps // 10), weight_decay=0.0)
    state = {"step": 0, "losses": [], "curve": [], "train_s": 0.0}
    loaded = load_checkpoint(ckpt, opt, asdict(hp)) if resume else None
    if loaded is not None:
        weights, saved = loaded
        student.model.load_weights(list(weights.items()), strict=False)
        state.update({k: saved[k] for k in state})
    if tutor is None:
        loss_grad = nn.value_and_grad(student.model, lambda _, tokens: next_token_loss(student, tokens))
    else:
        kl_grad = nn.value_and_grad(student.model, lambda _, t_lp, tokens: teacher_kl_loss(student, t_lp, tokens, hp.top,
                                                                                 hp.loss == "ce+kd"))

        def loss_grad(model, tokens):
            with mlx_kernel():
                t_lp = mx.stop_gradient(logprobs(tutor, tokens[:, :-1]))
            return kl_grad(model, t_lp, tokens)
    order = np.random.default_rng(hp.seed).permutation(len(pool))
    bar = progress_bar(world, hp.steps, state["step"], f"lora K={hp.top_k}", progress)
    t0 = time.perf_counter() - state["train_s"]
    while state["step"] < min(hp.steps, stop_at or hp.steps):
        step = state["step"]
        rows = [order[(step * hp.batch + j) % len(order)] for j in range(hp.batch)]
        loss, grads = loss_grad(student.model, mx.array(pool[world.share(rows)]))
        grads, _ = optim.clip_grad_norm(world.mean(grads), 1.0)
        opt.update(student.model, grads)
        mx.eval(student.model.trainable_parameters(), opt.state, loss)
        loss = world.sum(loss).item() / world.size  # SYNC: once per step, for the log
        state["losses"].append(finite_loss(loss, step + 1, "adapter"))
        state["step"] = step + 1
        if state["step"] % eval_every == 0 or state["step"] == hp.steps:
            state["curve"].append([state["step"], heldout_ppl(student, held, world)])
        state["train_s"] = time.perf_counter() - t0
        if world.writer and (state["step"] % 25 == 0 or state["step"] in (hp.steps, stop_at)):
            save_checkpoint(ckpt, dict(tree_flatten(student.model.trainable_parameters())), opt,
                            {**asdict(hp), **state})
        bar.update(1)
        bar.set_postfix(loss=f"{state['losses'][-1]:.3f}", heldout=f"{state['curve'][-1][1]:.2f}" if state["curve"] else "-")
    bar.close()
    return {"phase": 2, "steps_done": state["step"], "tokens": state["step"] * hp.batch * hp.seq_len,
            "losses": state["losses"], "heldout_curve": state["curve"],
            "heldout_ppl": state["curve"][-1][1] if state["curve"] else None, "train_s": round(state["train_s"], 1)}
