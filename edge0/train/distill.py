"""Phase 3: on-policy distillation of the adapter (`edge0 train distill`).

    edge0 train distill --model edge0/model/demo/store --out runs/lora-k4-distill.safetensors

Starts from the Phase 2 adapter (--init, default STORE/lora-k{K}.safetensors). Every step the student
(the store on its served path, predicted routing and the current adapter: edge0/train/student.py)
continues prompts of the training split by sampling; the float teacher scores those continuations,
and the loss is the reverse KL, KL(student || teacher), over the teacher's top-k tokens plus one tail
bucket holding the rest of both distributions' mass. Reverse KL is mode-seeking: the student is pulled
toward what the teacher finds likely on the text the student itself produces, where its own errors
compound. Held-out perplexity, reverse KL to the teacher and top-1 agreement are reported every
--eval-every steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..compute.machine import blas
from ..errors import Edge0Error
from ..model.lora import FORMAT as LORA_FORMAT, Adapter, adapted
from .loop import (World, blas_notice, card, check_out, finite_loss, heldout_windows, load_checkpoint,
                   progress_bar, save_checkpoint, schedule, write_outputs)
from .student import Student, load_student, mlx_kernel

TOP = 32  # teacher tokens the KL is taken over, besides the tail bucket


@dataclass(frozen=True)
class Hyper:
    """The settings a run's checkpoint must be resumed with."""

    steps: int = 60  # optimizer steps
    batch: int = 8  # generations per step (over all ranks)
    prompt_len: int = 16  # tokens of training text each generation starts from
    new: int = 112  # tokens the student samples per generation
    top: int = TOP  # teacher's top-k of the KL
    lr: float = 5e-5  # peak AdamW learning rate, a sixth of Phase 2's: on the demo's K = 4 adapter 5e-4 made every figure
    # worse; 1.5e-4 and 5e-5 raised agreement with the teacher and cut KL, 5e-5 at the least perplexity (MODEL_CARD.md)
    temp: float = 1.0  # the student's sampling temperature
    seed: int = 0  # prompts, sampling, batch order
    top_k: int = 0  # K of the heads (set from them)
    candidates: int = 0  # experts each head names, its layer's router choosing K (set from the student)


def _kl_top_tail(p_lp: mx.array, q_lp: mx.array, teacher_lp: mx.array, top: int) -> mx.array:
    """KL(p || q) over the teacher's `top` tokens plus one bucket holding the rest of each distribution's mass."""
    top = min(top, teacher_lp.shape[-1])
    idx = mx.stop_gradient(mx.argpartition(-teacher_lp, kth=top - 1, axis=-1)[..., :top])
    p, q = mx.take_along_axis(p_lp, idx, axis=-1), mx.take_along_axis(q_lp, idx, axis=-1)
    pp = mx.exp(p)
    p_tail = mx.maximum(1 - pp.sum(-1), 1e-6)
    q_tail = mx.maximum(1 - mx.exp(q).sum(-1), 1e-6)
    return (pp * (p - q)).sum(-1) + p_tail * (mx.log(p_tail) - mx.log(q_tail))


def reverse_kl(s_lp: mx.array, t_lp: mx.array, top: int) -> mx.array:
    """KL(student || teacher) over the teacher's `top` tokens plus one bucket for all others; (..., V) -> (...)."""
    return _kl_top_tail(s_lp, t_lp, t_lp, top)


def forward_kl(s_lp: mx.array, t_lp: mx.array, top: int) -> mx.array:
    """KL(teacher || student) over the teacher's `top` tokens plus one bucket for all others; (..., V) -> (...).
    Mean-seeking (the student spreads over what the teacher finds likely): Phase 2's distillation loss."""
    return _kl_top_tail(t_lp, s_lp, t_lp, top)


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def distill_loss(student: Student, teacher_lp: mx.array, seqs: mx.array, prompt_len: int, top: int) -> mx.array:
    """Mean reverse KL at the generated positions of (B, P + N) sequences; teacher_lp (B, N, V)."""
    s_lp = log_softmax(student.logits(seqs[:, :-1], prefix=prompt_len)[:, prompt_len - 1:])
    return reverse_kl(s_lp, teacher_lp, top).mean()


def heldout_figures(student: Student, teacher: nn.Module, windows: np.ndarray, world: World) -> dict:
    """On held-out windows (student path, position 0 routed natively): perplexity, reverse KL(student ||
    teacher) over the whole vocabulary, and top-1 agreement with the teacher; windows shared over the ranks."""
    sums = mx.zeros((4,))
    for w in world.share(list(windows)):
        tokens = mx.array(w[None])
        s_lp, t_lp = log_softmax(student.logits(tokens[:, :-1])), log_softmax(teacher(tokens[:, :-1]).astype(mx.float32))
        nll = -mx.take_along_axis(s_lp, tokens[:, 1:, None], axis=-1).sum()
        rkl = (mx.exp(s_lp) * (s_lp - t_lp)).sum()
        agree = (mx.argmax(s_lp, -1) == mx.argmax(t_lp, -1)).sum()
        sums = sums + mx.stack([nll, rkl, agree.astype(mx.float32), mx.array(w.size - 1.0)])
    nll, rkl, agree, n = world.sum(sums).tolist()  # SYNC: once per evaluation
    return {"ppl": math.exp(nll / n), "reverse_kl": rkl / n, "top1_agreement": agree / n}


def initial_adapter(student: Student, model_dir: Path, init) -> tuple[Adapter, Path]:
    """The Phase 2 adapter the run starts from, checked against the store and the heads."""
    path = Path(init) if init else model_dir / f"lora-k{student.heads.top_k}.safetensors"
    if not path.exists() and init:
        raise Edge0Error(f"--init {path}: no such file")
    if not path.exists():
        raise Edge0Error(f"{path}: no Phase 2 adapter to start from; train it first: edge0 train lora --model "
                         f"{model_dir} --out {path} --k {student.heads.top_k}")
    s = student.store
    return Adapter.load(path, s.manifest, s.config, heads_file=student.heads_file), path


def train_distill(model_dir, out, *, init=None, teacher=None, data=None, heads=None, heldout=None, top_k: int | None = None,
                  candidates: int | None = None,
                  steps: int = 60, batch: int = 8, prompt_len: int = 16, new: int = 112, top: int = TOP,
                  lr: float = Hyper.lr, temp: float = 1.0, seed: int = 0, eval_every: int = 20, eval_windows: int = 4,
                  resume: bool = False, progress: bool = True) -> dict:
    """Distil the adapter of `model_dir` on-policy; returns the report (also written to OUT.json)."""
    from ..model.arch import read_config, vocab_size
    from .corpus import train_stream
    from .teacher import load_teacher, resolve_teacher

    out, model_dir = Path(out), Path(model_dir)
    report_path = check_out(out, resume, steps, fmt=LORA_FORMAT, inputs={
        "--teacher": teacher, "--data": data, "--heldout": heldout, "--heads": heads, "--init": init},
        ckpt=out.with_name(out.name + ".ckpt"))
    world = World.init()
    world.check_batch(batch)
    blas_notice(world, progress)
    student = load_student(model_dir, heads, top_k, candidates)
    try:
        hp = Hyper(steps, batch, prompt_len, new, top, lr, temp, seed, student.heads.top_k, student.candidates)
        adapter, init_path = initial_adapter(student, model_dir, init)
        student.adapter(adapter)
        teacher_path = resolve_teacher(model_dir, teacher)
        tutor = load_teacher(teacher_path, vocab_size(read_config(model_dir)))
        stream, desc = train_stream(model_dir, data)
        held, held_desc = heldout_windows(model_dir, heldout, 256, eval_windows)
        with mlx_kernel():
            before = heldout_figures(student, tutor, held, world)
            run = _fit(student, tutor, hp, stream, held, world, out.with_name(out.name + ".ckpt"), resume, eval_every,
                       progress)
        report = {"model": str(model_dir), "teacher": str(teacher_path), "heads": str(student.heads_file),
                  "init": str(init_path), **asdict(hp), "ranks": world.size, "blas": blas(), "prompts": desc,
                  "heldout": held_desc,
                  "heldout_windows": len(held), "heldout_before": before, **run}
        if world.writer:
            adapter.weights = {k: (m.lora_a, m.lora_b) for k, m in adapted(student.model).items()}
            write_outputs(out, report_path, report, lambda p: adapter.save(p, {"report": card(report)}))
        return report
    finally:
        student.close()


def _fit(student: Student, tutor: nn.Module, hp: Hyper, stream: np.ndarray, held: np.ndarray, world: World,
         ckpt: Path, resume: bool, eval_every: int, progress: bool) -> dict:
    """The on-policy loop: sample, score, step; returns the run's figures."""
    from .teacher import prompts_from

    opt = optim.AdamW(learning_rate=schedule(hp.lr, hp.steps, hp.steps // 10), weight_decay=0.0)
    state = {"step": 0, "losses": [], "curve": [], "train_s": 0.0}
    loaded = load_checkpoint(ckpt, opt, asdict(hp)) if resume else None
    if loaded is not None:
        student.model.load_weights(list(loaded[0].items()), strict=False)
        state.update({k: loaded[1][k] for k in state})
    loss_grad = nn.value_and_grad(student.model,
                                  lambda _, t_lp, seqs: distill_loss(student, t_lp, seqs, hp.prompt_len, hp.top))
    bar = progress_bar(world, hp.steps, state["step"], f"distill K={hp.top_k}", progress)
    t0 = time.perf_counter() - state["train_s"]
    while state["step"] < hp.steps:
        step = state["step"]
        prompts = world.share(list(prompts_from(stream, hp.batch, hp.prompt_len, seed=[hp.seed, step])))
        key = mx.random.key(hp.seed * 100_003 + step * 97 + world.rank)  # each rank samples its own continuations
        seqs = student.generate(np.stack(prompts), hp.new, temp=hp.temp, key=key)
        tokens = mx.array(seqs)
        t_lp = mx.stop_gradient(log_softmax(tutor(tokens[:, :-1]).astype(mx.float32))[:, hp.prompt_len - 1:])
        loss, grads = loss_grad(student.model, t_lp, tokens)
        grads, _ = optim.clip_grad_norm(world.mean(grads), 1.0)
        opt.update(student.model, grads)
        mx.eval(student.model.trainable_parameters(), opt.state, loss)
        loss = world.sum(loss).item() / world.size  # SYNC: once per step, for the log
        state["losses"].append(finite_loss(loss, step + 1, "adapter"))
        state["step"] = step + 1
        if state["step"] % eval_every == 0 or state["step"] == hp.steps:
            state["curve"].append([state["step"], heldout_figures(student, tutor, held, world)])
        state["train_s"] = time.perf_counter() - t0
        if world.writer and (state["step"] % 10 == 0 or state["step"] == hp.steps):
            save_checkpoint(ckpt, dict(tree_flatten(student.model.trainable_parameters())), opt, {**asdict(hp), **state})
        bar.update(1)
        bar.set_postfix(rkl=f"{state['losses'][-1]:.4f}")
    bar.close()
    return {"phase": 3, "losses": state["losses"], "heldout_curve": state["curve"],
            "heldout_after": state["curve"][-1][1], "heldout_ppl": state["curve"][-1][1]["ppl"],
            "train_s": round(state["train_s"], 1)}
