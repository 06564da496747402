"""The exact path with native routing reproduces mlx-lm on the same checkpoint: tokens and logits."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.convert import convert as mlx_lm_convert
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from edge0.model.load import cast_floats, load_store
from edge0.decode.loop import generate_steps

from tests.conftest import ARCHS
from tests.helpers import run_json

PROMPT = "def fibonacci(n):\n    return"
STEPS = 32


def mlx_lm_steps(path, dtype):
    model, tok = load(str(path))
    cast_floats(model, dtype)
    prompt = tok.encode(PROMPT)
    steps = generate_step(mx.array(prompt), model, sampler=make_sampler(0.0))
    out = [(t, np.array(lp.astype(mx.float32))) for (t, lp), _ in zip(steps, range(STEPS))]
    return prompt, out


def edge0_cli_tokens(store, dtype_flag):
    return run_json("--model", str(store), "--prompt", PROMPT, "--max-tokens", str(STEPS), "--ignore-eos",
                    "--routing", "native", "--executor", "exact", "--dtype", dtype_flag)


@pytest.mark.parametrize("fmt", ["mlx", "hf"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_tokens_match_mlx_lm(models, arch, fmt, tmp_path):
    store = models(arch, fmt)
    if fmt == "mlx":
        oracle = models(arch, fmt, "src")
    else:  # the same float model quantized by mlx-lm itself
        oracle = tmp_path / "mlx-lm-q"
        mlx_lm_convert(str(models(arch, fmt, "src")), mlx_path=str(oracle), quantize=True)
    prompt, want = mlx_lm_steps(oracle, mx.float32)
    s = load_store(store, dtype="float32")
    got = [(t, np.array(lp)) for t, lp in generate_steps(s.model, prompt, max_tokens=STEPS, sampler=make_sampler(0.0))]
    s.close()
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-4
    assert len(set(t for t, _ in want)) > 1, "degenerate model: a constant stream proves little"
    # The command a user runs gives the same tokens.
    assert edge0_cli_tokens(store, "float32")["tokens"] == [t for t, _ in want]


@pytest.mark.parametrize("arch", ARCHS)
def test_source_dtype_tokens_match_mlx_lm(models, arch):
    """Without the float32 cast (bf16 as stored), tokens still equal mlx_lm's on the source checkpoint."""
    _, want = mlx_lm_steps(models(arch, "mlx", "src"), None)
    result = edge0_cli_tokens(models(arch, "mlx"), "source")
    assert result["tokens"] == [t for t, _ in want]
    assert result["bytes_read"] > 0 and result["reads"] > 0


MEMORY_PROBE = """
import gc, json, sys
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_sampler
from edge0.model.load import load_store
from edge0.decode.loop import generate_steps
store, executor, text = sys.argv[1:]
before = mx.get_active_memory()
s = load_store(store, dtype="float32", executor=executor)
mx.eval(s.model.parameters())
params = sum(v.nbytes for _, v in tree_flatten(s.model.parameters()))
gc.collect()
mx.reset_peak_memory()
peak = {}
end_prefill = s.runtime.end_prefill
def end():
    peak["prefill"] = mx.get_peak_memory()
    end_prefill()
    mx.reset_peak_memory()
s.runtime.end_prefill = end
prompt = s.tokenizer.encode(text)
for _ in generate_steps(s.model, prompt, max_tokens=8, sampler=make_sampler(0.0), runtime=s.runtime):
    pass
peak["decode"] = mx.get_peak_memory()
print(json.dumps(dict(before=before, params=params, prompt=len(prompt), **peak)))
"""


def expert_memory(store, executor):
    """In a fresh process (nothing else allocating or freeing): the peak MLX memory of loading the store
    and generating 8 tokens after PROMPT * 4, per phase, less the model's own parameters and the KV cache,
    i.e. what the routed experts (and small activations) took at most."""
    from mlx_lm.models.cache import KVCache

    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(store), executor, PROMPT * 4],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.splitlines()[-1])
    c = json.loads((store / "config.json").read_text())
    assert r["prompt"] + 8 <= KVCache.step  # one KV allocation step per layer, float32
    kv = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * KVCache.step * 4
    return {phase: r[phase] - r["before"] - r["params"] - kv for phase in ("prefill", "decode")}


def test_routed_experts_never_all_resident(models):
    """Peak memory of the routed experts stays below all of them in memory (as ResidentExperts holds them:
    packed weights, float32 scales and biases), for the exact executor over prefill and decode, and for
    the staged executor's decode, whose bound is its 2K-slot bank per layer plus one layer read whole.
    Not asserted: staged prefill, which holds two whole-layer banks (half the layers of this 4-layer model)
    plus the same transients as exact, more than all experts of so tiny a model."""
    from edge0.compute.banks import Bank
    from edge0.io.manifest import read_manifest

    store = models("qwen3_moe", "mlx")
    m = read_manifest(store)
    layers, e, k = len(m.layers), m.num_experts, m.top_k
    one = sum(p.nbytes * (2 if w else 1) for p, w in zip(m.pieces, Bank.widened(m.pieces, mx.float32)))
    everything = layers * e * one
    assert layers >= 3 and everything > m.expert_bytes  # float32 scales: wider than stored
    exact = expert_memory(store, "exact")
    assert max(exact.values()) < everything, (exact, everything)
    staged_bound = layers * 2 * k * one + e * one
    assert staged_bound < everything  # else the staged check proves nothing
    staged = expert_memory(store, "staged")
    assert staged["decode"] < staged_bound, (staged, staged_bound)
