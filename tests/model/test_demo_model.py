"""The committed demo model: loads with mlx-lm, Edge0's exact path matches mlx-lm on it, and it learned."""

import json

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.convert import convert as mlx_lm_convert
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from edge0.bench import quality as ev
from edge0.config import EngineConfig, RoutingConfig
from edge0.model.demo import DEMO_DIR, DEMO_FP, DEMO_PROMPT, DEMO_STORE
from edge0.model.load import cast_floats, load_store
from edge0.decode.loop import generate_steps
from edge0.train import base
from edge0.train.corpus import token_stream

STEPS = 24
MAX_BYTES = 64 << 20  # the whole model directory (fp source + int4 store + card) stays small


def test_committed_files_and_size():
    for name in ("edge0.json", "config.json", "resident.safetensors", "tokenizer.json"):
        assert (DEMO_STORE / name).is_file(), name
    assert (DEMO_FP / "model.safetensors").is_file() and (DEMO_DIR / "MODEL_CARD.md").is_file()
    manifest = json.loads((DEMO_STORE / "edge0.json").read_text())
    assert manifest["arch"] == "qwen3_moe" and manifest["quantization"]["bits"] == 4
    assert sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file()) < MAX_BYTES


def test_exact_path_reproduces_mlx_lm_greedy_tokens(tmp_path):
    # mlx-lm's own 4-bit conversion of the committed float source is the oracle for the store.
    model, tok = load(str(DEMO_FP))  # the float source loads as is
    assert model.model_type == "qwen3_moe"
    oracle = tmp_path / "q4"
    mlx_lm_convert(str(DEMO_FP), mlx_path=str(oracle), quantize=True)
    model, tok = load(str(oracle))
    cast_floats(model, mx.float32)
    prompt = tok.encode(DEMO_PROMPT)
    want = [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, sampler=make_sampler(0.0)), range(STEPS))]
    s = load_store(DEMO_STORE, dtype="float32")
    got = [t for t, _ in generate_steps(s.model, prompt, max_tokens=STEPS, sampler=make_sampler(0.0))]
    text = s.tokenizer.decode(got)
    s.close()
    assert got == want
    assert len(set(got)) > 4 and text.strip(), text


def test_heldout_perplexity_far_below_initialisation():
    # the model's own router: what the training taught, in one forward pass per window
    r = ev.evaluate(DEMO_STORE, max_tokens=1024, config=EngineConfig(routing=RoutingConfig(mode="native")))
    stream, _ = token_stream(DEMO_STORE, None)
    config = json.loads((DEMO_FP / "config.json").read_text())
    init = base.build_model(config, seed=0)
    wins = ev.windows_of(stream, ev.SEQ_LEN, 1024)
    init_ppl = float(np.exp(base.heldout_loss(init, [w for w in wins if w.size == ev.SEQ_LEN + 1], 4)))
    assert init_ppl > 0.5 * config["vocab_size"]  # an untrained model is about uniform
    assert r["ppl"] < init_ppl / 50, (r["ppl"], init_ppl)
