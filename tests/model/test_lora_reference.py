"""The served adapter against references that share none of its code: each adapted projection of the built-in model,
as `edge0 run` attaches it, gives W x + (alpha / r) B (A x) with alpha, r, A and B read from the adapter file itself;
and the whole model's log-probabilities depend on alpha and B only through (alpha / r) B, on every served path.
(The other adapter tests compare two paths that share the branch's scale: a scale of 1 passed them all.)"""

import json
import struct

import mlx.core as mx
import numpy as np
import pytest

from edge0.compute import kernels
from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.model.demo import DEMO_STORE
from edge0.model.lora import LoRABranch, LoRALinear, adapted

LORA = DEMO_STORE / "lora-k4.safetensors"
KERNELS = ["mlx"] + (["edge0"] if kernels.available() else [])


def _file(path):
    """(tensors, alpha, rank) of a safetensors adapter, its metadata read from the header bytes."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    meta = header["__metadata__"]
    return mx.load(str(path)), float(meta["alpha"]), int(meta["rank"])


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_served_projection_is_its_base_plus_alpha_over_r_times_b_a_x(kernel):
    tensors, alpha, rank = _file(LORA)
    assert alpha / rank != 1  # a scale of 1 must be told apart from the file's
    rng = np.random.default_rng(0)
    with open_engine(EngineConfig(routing=RoutingConfig(lora=str(LORA)),
                                  kernel=KernelConfig(name=kernel))) as engine, engine.kernel.active():
        assert engine.kernel.name == kernel
        mods = adapted(engine.store.model)
        assert sorted(f"{k}.lora_{ab}" for k in mods for ab in "ab") == sorted(tensors)
        for name, m in mods.items():
            # as served: A and B rounded to the dtype they are served in (bfloat16 under float32 compute)
            a, b = (_f64(tensors[f"{name}.lora_{ab}"].astype(m.lora_a.dtype)) for ab in "ab")
            for rows in (1, 5):  # a decode step, a prompt chunk
                x = mx.array(rng.standard_normal((1, rows, a.shape[0])).astype(np.float32))
                if isinstance(m, LoRALinear):
                    base = m.base(x)
                    got = m(x)
                else:
                    assert isinstance(m, LoRABranch)
                    base = mx.array(rng.standard_normal((1, rows, b.shape[1])).astype(np.float32))
                    got = m.add(base, x)
                lora = alpha / rank * (_f64(x) @ a) @ b
                err = np.abs(_f64(got) - (_f64(base) + lora)).max()
                assert err <= 1e-3 * np.abs(lora).max() + 1e-6, (name, rows, err, np.abs(lora).max())


def _rescaled(src, dest, factor: float) -> None:
    """The adapter src with alpha divided by `factor` and every B multiplied by it: (alpha / r) B unchanged, and
    exactly so in bfloat16 for a power of 2."""
    tensors, alpha, _ = _file(src)
    _, meta = mx.load(str(src), return_metadata=True)
    out = {k: v * factor if k.endswith(".lora_b") else v for k, v in tensors.items()}
    mx.save_safetensors(str(dest), out, metadata={**meta, "alpha": repr(alpha / factor)})


@pytest.mark.parametrize("executor,kernel", [("resident", k) for k in KERNELS] + [("staged", KERNELS[-1])])
def test_only_alpha_over_r_times_b_reaches_the_output(tmp_path, executor, kernel):
    """On every served path (the resident one adds the branches inside its block nodes, the staged one as nodes of
    their own): the same log-probabilities for (alpha, B) and (alpha / 2, 2 B), and others without the adapter."""
    half = tmp_path / "lora-half-alpha.safetensors"
    _rescaled(LORA, half, 2.0)
    tokens = list(range(100, 140))
    out = {}
    for name, lora in (("file", str(LORA)), ("half", str(half)), ("none", "none")):
        with open_engine(EngineConfig(routing=RoutingConfig(lora=lora), io=IOConfig(executor=executor),
                                      kernel=KernelConfig(name=kernel))) as engine:
            out[name] = np.array(engine.forced_logprobs(tokens))
    assert np.abs(out["file"] - out["none"]).max() > 1e-2  # the adapter does something
    assert np.abs(out["file"] - out["half"]).max() <= 1e-4, np.abs(out["file"] - out["half"]).max()
