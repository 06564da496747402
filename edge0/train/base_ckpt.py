"""Checkpoints and the step log of `edge0 train base` (edge0/train/base.py).

OUT/ckpt/step_N.safetensors (weights), step_N.opt.safetensors (AdamW state), step_N.json (written last: marks
the checkpoint complete); OUT/log.jsonl one line per step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from edge0.io.atomic import atomic_path, write_atomic
from edge0.io.outputs import check_own_dir

KEEP_CKPTS = 2  # older complete checkpoints are deleted
RUN_NAMES = r"data|ckpt|fp|store|log\.jsonl|summary\.json"  # what a run writes in OUT
CKPT_NAMES = r"step_\d+(\.json|\.safetensors|\.opt\.safetensors)"
CORPUS_NAMES = r"train\.npy|heldout\.npy|tokenizer\.json|corpus\.json"  # train/corpus.py's cache


def check_run_dir(out: Path) -> None:
    """OUT, OUT/ckpt and OUT/data hold only what a run writes (it writes among no other files, and deletes
    old checkpoints by name)."""
    for path, own in ((out, RUN_NAMES), (out / "ckpt", CKPT_NAMES), (out / "data", CORPUS_NAMES)):
        check_own_dir(path, own, "`edge0 train base`")


def latest_checkpoint(ckpt_dir: Path) -> int | None:
    """Step of the newest complete checkpoint (its json written last), or None."""
    steps = [int(p.stem.split("_")[1]) for p in ckpt_dir.glob("step_*.json")] if ckpt_dir.is_dir() else []
    return max(steps) if steps else None


def save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, opt: optim.Optimizer, state: dict) -> None:
    """Weights, optimizer state, then the json that marks the checkpoint complete; each written atomically."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    base = ckpt_dir / f"step_{step}"
    _save_arrays(Path(f"{base}.safetensors"), dict(tree_flatten(model.parameters())))
    _save_arrays(Path(f"{base}.opt.safetensors"), dict(tree_flatten(opt.state)))
    _write_atomic(Path(f"{base}.json"), json.dumps(state, indent=1) + "\n")
    done = sorted(int(p.stem.split("_")[1]) for p in ckpt_dir.glob("step_*.json"))
    for old in done[:-KEEP_CKPTS]:
        for suffix in (".json", ".safetensors", ".opt.safetensors"):  # json first: never a complete-looking stub
            Path(f"{ckpt_dir / f'step_{old}'}{suffix}").unlink(missing_ok=True)


def load_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, opt: optim.Optimizer) -> dict:
    base = ckpt_dir / f"step_{step}"
    model.load_weights(list(mx.load(f"{base}.safetensors").items()), strict=True)
    opt.state = tree_unflatten(list(mx.load(f"{base}.opt.safetensors").items()))
    mx.eval(model.parameters(), opt.state)
    return json.loads(Path(f"{base}.json").read_text())


def _save_arrays(path: Path, arrays: dict) -> None:
    with atomic_path(path) as tmp:
        mx.save_safetensors(str(tmp), arrays)


def _write_atomic(path: Path, text: str) -> None:
    write_atomic(path, text.encode())


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint a run resumes from, so the log is the run's one curve."""
    if not path.exists():
        return
    kept = [ln for ln in path.read_text().splitlines() if _log_step(ln) is not None and _log_step(ln) <= step]
    _write_atomic(path, "".join(ln + "\n" for ln in kept))


def _log_step(line: str) -> int | None:
    """The step of a log line; None for a line a killed run left half-written (the log is appended to)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def read_log(out: str | os.PathLike) -> list[dict]:
    path = Path(out) / "log.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln] if path.exists() else []
