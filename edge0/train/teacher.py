"""The teacher of Phases 2 and 3: the float checkpoint the store was made from.

Phase 2 trains on its text: prompts cut from the training split, continued by sampling the teacher
(temperature 1 by default: its own distribution), batched with a KV cache. Phase 3 scores the student's
generations with its log-probabilities. Generated windows are cached next to the output, keyed by
everything that makes them, so a resumed or repeated run does not sample again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_lm.models.switch_layers import SwitchGLU

from ..compute.qmm import swap_classes
from ..errors import Edge0Error
from ..io.atomic import atomic_path
from .loop import World
from .student import grouped_glu

PROMPT_TOKENS = 16  # tokens of real text each generated window starts from
GEN_BATCH = 64  # sequences sampled together
CACHE_VERSION = 2  # 2: the prompts of batch b drawn from default_rng([seed, b])


def resolve_teacher(store: Path, teacher: str | None) -> Path:
    """--teacher, else the demo's fp checkpoint for the demo store, else the source the manifest names."""
    from ..io.manifest import read_manifest
    from ..model.demo import DEMO_FP, DEMO_STORE

    if teacher is None and store.resolve() == DEMO_STORE.resolve():
        teacher = str(DEMO_FP)
    if teacher is None:
        src = (read_manifest(store).source or {}).get("path")
        if not src or not (Path(src) / "config.json").exists() or (Path(src) / "edge0.json").exists():
            raise Edge0Error(f"--teacher DIR: needed for {store}: the float checkpoint it was converted from")
        teacher = src
    path = Path(teacher)
    if not (path / "config.json").exists():
        raise Edge0Error(f"--teacher {path}: no config.json; not a model directory")
    if (path / "edge0.json").exists():
        raise Edge0Error(f"--teacher {path}: an Edge0 store; the teacher is the float checkpoint it was made from")
    return path


def load_teacher(path: Path, vocab: int | None) -> nn.Module:
    """The checkpoint through mlx_lm.load, computing in float32; its vocabulary must be the student's."""
    from mlx_lm import load

    from ..model.arch import read_config, vocab_size
    from ..model.load import cast_floats

    theirs = vocab_size(read_config(path))
    if vocab is not None and theirs != vocab:
        raise Edge0Error(f"--teacher {path}: vocabulary of {theirs} tokens, the store's is {vocab}")
    try:
        model, _ = load(str(path))
    except (ValueError, FileNotFoundError) as e:
        raise Edge0Error(f"--teacher {path}: cannot load with mlx_lm.load ({e})") from None
    model.freeze()
    cast_floats(model, mx.float32)
    swap_classes(model, {SwitchGLU: GroupedSwitchGLU})
    mx.eval(model.parameters())
    return model


class GroupedSwitchGLU(SwitchGLU):
    """mlx-lm's SwitchGLU (float weights (E, out, in)) computed by grouped_glu: same math, faster on CPU."""

    def __call__(self, x, indices):
        t = [self[n].weight.swapaxes(-1, -2) for n in ("gate_proj", "up_proj", "down_proj")]
        return grouped_glu(x, indices, *t)


def sample(model: nn.Module, prompts: np.ndarray, new: int, *, temp: float, key: mx.array) -> np.ndarray:
    """(N, P) prompts continued by `new` sampled tokens each: (N, P + new) int32."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1]
    out = []
    for _ in range(new):
        key, sub = mx.random.split(key)
        tok = mx.random.categorical(logits.astype(mx.float32) * (1 / temp), key=sub)  # (N,)
        out.append(tok)
        logits = model(tok[:, None], cache=cache)[:, -1]
        mx.async_eval(logits)
    return np.concatenate([prompts, np.array(mx.stack(out, axis=1)).astype(np.int32)], axis=1)


def prompts_from(stream: np.ndarray, n: int, length: int, seed) -> np.ndarray:
    """n prompts of `length` tokens at positions drawn from default_rng(seed) (an int or a sequence of them)."""
    starts = np.random.default_rng(seed).integers(0, stream.size - length, size=n)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def teacher_windows(teacher: Path, model: nn.Module, stream: np.ndarray, *, n: int, length: int, temp: float,
                    seed: int, world: World, cache_dir: Path | None, progress=None) -> np.ndarray:
    """(n, length) windows: PROMPT_TOKENS of the stream, the rest sampled from the teacher. Batches are split
    over the ranks and gathered; the writer caches the result in cache_dir."""
    key = _key(teacher, stream, n, length, temp, seed)
    cached = cache_dir / f"teacher-{key}.npy" if cache_dir is not None else None
    if cached is not None and cached.exists():
        return np.load(cached)
    batches = -(-n // GEN_BATCH)
    batches += -batches % world.size  # every rank samples as many batches
    mine = []
    for b in range(world.rank, batches, world.size):  # batch b is the same whoever samples it
        rows = prompts_from(stream, GEN_BATCH, PROMPT_TOKENS, [seed, b])
        mine.append(sample(model, rows, length - PROMPT_TOKENS, temp=temp, key=mx.random.key(seed * 7919 + b)))
        if progress is not None:
            progress.update(world.size)
    got = np.array(world.gather(mx.array(np.concatenate(mine))))  # rank-major: rank r holds batches r, r + size, ...
    per = batches // world.size
    order = [r * per + i for i in range(per) for r in range(world.size)]  # back to batch order
    windows = got.reshape(world.size * per, GEN_BATCH, length)[order].reshape(-1, length)[:n]
    if cached is not None and world.writer:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(cached) as tmp:
            np.save(tmp, windows)
    return windows


def _key(teacher: Path, stream: np.ndarray, n: int, length: int, temp: float, seed: int) -> str:
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in teacher.glob("*.safetensors"))
    blob = json.dumps([str(teacher.resolve()), files, hashlib.sha256(stream.tobytes()).hexdigest(), n, length,
                       temp, seed, PROMPT_TOKENS, GEN_BATCH, CACHE_VERSION])
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def logprobs(model: nn.Module, tokens: mx.array) -> mx.array:
    """(B, T) -> (B, T, V) float32 log-probabilities of the next token."""
    logits = model(tokens).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
