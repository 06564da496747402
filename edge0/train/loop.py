"""What the training phases share: the data-parallel world, checkpoints for --resume, output checks.

Data parallel (mlx.launch starts one process per rank, `mx.distributed` connects them):

    mlx.launch -n 2 --backend ring -- edge0 train lora --model STORE --out STORE/lora-k4.safetensors

Every rank holds the whole model and computes its share of each batch; gradients are averaged with
all_sum (so the update is the one a single process makes on the whole batch, up to summation order),
and only rank 0 (the writer) writes checkpoints, outputs and progress. A single process is a world of 1.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..compute.machine import blas
from ..errors import Edge0Error
from ..io.atomic import atomic_path, write_atomic
from ..io.manifest import MANIFEST, record_files
from ..io.outputs import check_trained_out
from ..log import log


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel ranks."""

    rank: int
    size: int
    group: object = None  # mx.distributed.Group when size > 1

    @classmethod
    def init(cls) -> "World":
        """The world mlx.launch set up, or a world of one (no launcher, or no distributed backend)."""
        if not mx.distributed.is_available():
            return cls(0, 1)
        group = mx.distributed.init()
        return cls(group.rank(), group.size(), group if group.size() > 1 else None)

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's items of a batch (every size-th from its rank)."""
        return items[self.rank::self.size]

    def mean(self, tree):
        """The mean over ranks of a tree of arrays (gradients); the tree itself in a world of one."""
        if self.size == 1:
            return tree
        return tree_map(lambda g: mx.distributed.all_sum(g, group=self.group) / self.size, tree)

    def sum(self, x: mx.array) -> mx.array:
        return x if self.size == 1 else mx.distributed.all_sum(x, group=self.group)

    def gather(self, x: mx.array) -> mx.array:
        """Every rank's x, concatenated along the first axis in rank order."""
        return x if self.size == 1 else mx.distributed.all_gather(x, group=self.group)

    def check_batch(self, batch: int) -> None:
        if batch % self.size:
            raise Edge0Error(f"--batch {batch}: must be a multiple of the {self.size} data-parallel ranks")


CHECKPOINT_NAMES = r"weights\.safetensors|opt\.safetensors|state\.json"  # what save_checkpoint writes
TEACHER_CACHE_NAMES = r"teacher-[0-9a-f]+\.npy"  # train/teacher.py's cached windows


def check_out(out: Path, resume: bool, steps: int, *, fmt: str, inputs: dict, ckpt: Path, cache: Path | None = None
              ) -> Path:
    """Refuse before anything loads: --steps below 1, an existing OUT or OUT.json without --resume, a missing
    or read-only directory; and (io/outputs.check_trained_out) OUT in an input ({flag: path}), over a file of
    another format than fmt, or a checkpoint or cache directory holding other files. Returns OUT.json's path."""
    report = Path(str(out) + ".json")
    if steps < 1:
        raise Edge0Error(f"--steps {steps}: must be at least 1")
    for path in (out, report):
        if path.exists() and not resume:
            raise Edge0Error(f"{path}: exists; pass --resume to continue its checkpoint, or choose another --out")
    parent = out.parent
    if not parent.is_dir():
        raise Edge0Error(f"--out {out}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise Edge0Error(f"--out {out}: the directory {parent} is not writable")
    sides = {ckpt: (CHECKPOINT_NAMES, "a training checkpoint")}
    if cache is not None:
        sides[cache] = (TEACHER_CACHE_NAMES, "the teacher's text cache")
    check_trained_out(out, report, resume, fmt, inputs, sides)
    return report


def finite_loss(loss: float, step: int, what: str) -> float:
    """The step's loss, or a refusal once it is not a number: the weights would be NaN, saved and then served."""
    if not math.isfinite(loss):
        raise Edge0Error(f"step {step} of the {what}: the loss is {loss}; lower --lr (--out is not written)")
    return loss


def save_checkpoint(ckpt: Path, arrays: dict, opt: optim.Optimizer, state: dict) -> None:
    """Weights, optimizer state, then state.json, which marks the checkpoint complete; each atomic."""
    ckpt.mkdir(parents=True, exist_ok=True)
    for name, tree in (("weights", arrays), ("opt", dict(tree_flatten(opt.state)))):
        with atomic_path(ckpt / f"{name}.safetensors") as tmp:
            mx.save_safetensors(str(tmp), tree)
    write_atomic(ckpt / "state.json", json.dumps(state).encode())


def load_checkpoint(ckpt: Path, opt: optim.Optimizer, same: dict) -> tuple[dict, dict] | None:
    """(weights, state) of a complete checkpoint, the optimizer state restored; None when there is none.
    `same`: flags that must equal the checkpoint's (named in the refusal, as --flag)."""
    if not (ckpt / "state.json").exists():
        return None
    state = json.loads((ckpt / "state.json").read_text())
    diff = [f"--{n.replace('_', '-')} {state[n]} (now {v})" for n, v in same.items() if n in state and state[n] != v]
    if diff:
        raise Edge0Error(f"{ckpt}: was trained with {', '.join(diff)}; resume with the same flags or choose another --out")
    opt.state = tree_unflatten(list(mx.load(str(ckpt / "opt.safetensors")).items()))
    return mx.load(str(ckpt / "weights.safetensors")), state


def write_outputs(out: Path, report_path: Path, report: dict, save) -> None:
    """save(out), then the report; both listed in the store's manifest when written into a store."""
    save(out)
    write_atomic(report_path, json.dumps(report, indent=1).encode())
    if (out.parent / MANIFEST).exists():
        record_files(out.parent, [out.name, report_path.name])


OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"  # Debian's libopenblas0-pthread


def blas_notice(world: World, enabled: bool) -> None:
    """One line on stderr (the writer, with progress shown) when training would run on the reference BLAS."""
    if enabled and world.writer and blas().startswith("reference"):
        log.info(f"MLX's CPU wheel multiplies float matrices with the reference BLAS; training steps run about "
                 f"4.5x faster with OpenBLAS preloaded: apt-get install libopenblas0-pthread, then put "
                 f"LD_PRELOAD={OPENBLAS} OPENBLAS_NUM_THREADS=1 before the command")


def progress_bar(world: World, total: int, initial: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=not (enabled and world.writer), file=sys.stderr,
                dynamic_ncols=True)


def schedule(lr: float, steps: int, warmup: int):
    """Linear warmup to lr, then cosine decay to lr / 10."""
    warmup = max(1, min(warmup, steps - 1)) if steps > 1 else 1
    warm = optim.linear_schedule(lr * 0.01, lr, warmup)
    decay = optim.cosine_decay(lr, max(steps - warmup, 1), end=lr * 0.1)
    return optim.join_schedules([warm, decay], [warmup])


def windows_of(stream: np.ndarray, length: int) -> np.ndarray:
    """Consecutive windows of `length` tokens, (N, length) int32."""
    n = stream.size // length
    return stream[:n * length].astype(np.int32).reshape(n, length)


def heldout_windows(model_dir: Path, heldout, seq_len: int, n: int) -> tuple[np.ndarray, str]:
    """The first n windows of seq_len + 1 tokens of the held-out text (default the stdlib held-out split)."""
    from .corpus import token_stream

    stream, desc = token_stream(model_dir, heldout)
    held = windows_of(stream, seq_len + 1)[:n]
    if len(held) == 0:
        raise Edge0Error(f"{desc}: fewer than {seq_len + 1} tokens, not one held-out window")
    return held, desc


def card(report: dict) -> str:
    """The few figures an adapter file carries in its metadata."""
    keys = ("phase", "loss", "top_k", "candidates", "steps", "batch", "seq_len", "rank", "alpha", "teacher", "heldout_ppl_before",
            "heldout_before", "heldout_ppl", "heldout_after")
    return json.dumps({k: report[k] for k in keys if k in report})
