"""make_model: tiny random checkpoints that mlx-lm loads, converts and runs offline."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.convert import convert
from safetensors import safe_open

from edge0.errors import Edge0Error
from edge0.model import make
from edge0.model.make import BESPOKE as ARCHS, make_model, planned_bytes

# arch -> (name of one routed expert tensor in the hf checkpoint, the router module's path suffix)
HF_EXPERT_KEY = {
    "qwen3_moe": "model.layers.1.mlp.experts.3.down_proj.weight",
    "qwen3_5_moe": "model.language_model.layers.1.mlp.experts.gate_up_proj",
    "bailing_moe": "model.layers.1.mlp.experts.3.down_proj.weight",
}
ROUTER = {"qwen3_moe": "mlp.gate", "qwen3_5_moe": "mlp.gate", "bailing_moe": "mlp.gate.gate_proj"}


def tensors(path: Path) -> dict[str, mx.array]:
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def moe_layers(model):
    return [l for l in model.layers if hasattr(l.mlp, "switch_mlp")]


def check_forward(model, tok):
    ids = tok.encode("def add(a, b):\n    return a + b  # the sum")
    assert tok.decode(ids) == "def add(a, b):\n    return a + b  # the sum"
    logits = model(mx.array([ids]))
    mx.eval(logits)
    assert logits.shape == (1, len(ids), model_vocab(model))
    assert mx.isfinite(logits).all().item()
    assert logits.astype(mx.float32).std(axis=-1).min().item() > 1e-2


def model_vocab(model):
    args = model.args
    return args.text_config["vocab_size"] if hasattr(args, "text_config") else args.vocab_size


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Every arch in both formats, tiny, seed 0: {(arch, fmt): path}."""
    root = tmp_path_factory.mktemp("models")
    return {
        (arch, fmt): make_model(arch, "tiny", root / f"{arch}-{fmt}", fmt=fmt, progress=False)
        for arch in ARCHS
        for fmt in ("mlx", "hf")
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_tiny_loads_quantized_and_runs(made, arch):
    path = made[arch, "mlx"]
    config = json.loads((path / "config.json").read_text())
    q = config["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (64, 4, "affine")
    assert config["quantization_config"] == q
    routers = [k for k in q if k.endswith(ROUTER[arch])]
    assert routers and all(q[k]["bits"] == 8 for k in routers)

    w = tensors(path)
    experts = [k for k in w if ".switch_mlp." in k and k.endswith(".weight")]
    assert experts and all(w[k].dtype == mx.uint32 for k in experts)
    for k in experts:
        scales = w[k.replace(".weight", ".scales")]
        assert scales.dtype == mx.bfloat16 and w[k.replace(".weight", ".biases")].dtype == mx.bfloat16
    floats = [v for k, v in w.items() if mx.issubdtype(v.dtype, mx.floating)]
    assert {v.dtype for v in floats} <= {mx.bfloat16, mx.float32}  # f32: A_log, expert_bias
    if arch == "bailing_moe":
        bias = w["model.layers.1.mlp.gate.expert_bias"]
        assert bias.dtype == mx.float32 and bias.abs().max().item() > 0.01

    model, tok = load(str(path))
    check_forward(model, tok)
    assert tok.eos_token_id == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_tiny_has_hf_layout_and_runs(made, arch):
    path = made[arch, "hf"]
    config = json.loads((path / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    assert config["torch_dtype"] == "bfloat16"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert HF_EXPERT_KEY[arch] in index["weight_map"]
    assert not any("switch_mlp" in k for k in index["weight_map"])
    for f in path.glob("model-*-of-*.safetensors"):
        with safe_open(str(f), "np") as sf:
            assert sf.metadata()["format"] == "pt"
    w = tensors(path)
    assert {v.dtype for v in w.values()} <= {mx.bfloat16, mx.float32}
    if arch == "qwen3_5_moe":
        E, H, D = 16, 64, 128
        assert w[HF_EXPERT_KEY[arch]].shape == (E, 2 * H, D)
        assert w["model.language_model.layers.1.mlp.experts.down_proj"].shape == (E, D, H)
        assert w["model.language_model.layers.0.linear_attn.conv1d.weight"].shape[1:] == (1, 4)
        assert (w["model.language_model.layers.0.input_layernorm.weight"] == 0).all().item()
    if arch == "bailing_moe":
        assert "model.layers.1.mlp.gate.weight" in w and "model.layers.0.mlp.gate_proj.weight" in w

    model, tok = load(str(path))
    model.set_dtype(mx.float32)  # unquantized gather_mm on CPU runs float32 only
    check_forward(model, tok)
    if arch == "qwen3_5_moe":  # sanitize shifted the zero-centred norms back to 1
        assert (model.layers[0].input_layernorm.weight == 1).all().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_router_spreads_tokens(made, arch):
    model, _ = load(str(made[arch, "mlx"]))
    seen = {}

    class Recorder(nn.Module):
        def __init__(self, inner, i):
            super().__init__()
            self.inner, self.i = inner, i

        def __call__(self, x, indices):
            seen[self.i] = indices
            return self.inner(x, indices)

    layers = moe_layers(model)
    for i, layer in enumerate(layers):
        layer.mlp.switch_mlp = Recorder(layer.mlp.switch_mlp, i)
    prompt = np.random.default_rng(1).integers(3, 1000, size=32)
    mx.eval(model(mx.array(prompt)[None]))
    n_experts = 16
    assert len(seen) == len(layers) >= 3
    for i, inds in seen.items():
        used = len(set(np.array(inds).reshape(-1).tolist()))
        assert used >= n_experts // 2, f"layer {i} used {used} of {n_experts} experts"


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_converts_with_mlx_lm_to_the_mlx_flavour(made, arch, tmp_path, monkeypatch):
    # Several shards on both sides, so the index files are exercised.
    monkeypatch.setattr(make, "HF_SHARD_BYTES", 1 << 20)
    monkeypatch.setattr(make, "MLX_SHARD_BYTES", 1 << 19)
    hf = make_model(arch, "tiny", tmp_path / "hf", fmt="hf", progress=False)
    mlx_sharded = make_model(arch, "tiny", tmp_path / "mlx", progress=False)
    assert len(list(hf.glob("model-*.safetensors"))) > 1
    assert len(list(mlx_sharded.glob("model-*-of-*.safetensors"))) > 1

    q = tmp_path / "q"
    convert(str(hf), mlx_path=str(q), quantize=True)
    converted, ours = tensors(q), tensors(made[arch, "mlx"])
    assert converted.keys() == ours.keys() == tensors(mlx_sharded).keys()
    for k in ours:
        assert converted[k].dtype == ours[k].dtype, k
        assert mx.array_equal(converted[k], ours[k]).item(), k
    q_config = json.loads((q / "config.json").read_text())
    our_config = json.loads((made[arch, "mlx"] / "config.json").read_text())
    assert q_config["quantization"] == our_config["quantization"]

    for path in (q, mlx_sharded):
        model, tok = load(str(path))
        check_forward(model, tok)


def test_same_seed_same_bytes_other_seed_differs(made, tmp_path):
    for fmt in ("mlx", "hf"):
        again = make_model("qwen3_5_moe", "tiny", tmp_path / f"again-{fmt}", fmt=fmt, progress=False)
        first = made["qwen3_5_moe", fmt]
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in again.iterdir())
        for name in names:
            assert (first / name).read_bytes() == (again / name).read_bytes(), name
    other = make_model("qwen3_5_moe", "tiny", tmp_path / "other", seed=1, progress=False)
    a, b = tensors(made["qwen3_5_moe", "mlx"]), tensors(other)
    key = "language_model.model.layers.1.mlp.switch_mlp.up_proj.weight"
    assert not mx.array_equal(a[key], b[key]).item()


def test_force_replaces_only_an_earlier_make_model_output(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    for force in (False, True):  # another directory's files are never deleted, even with --force
        with pytest.raises(Edge0Error, match=f"^{out}: exists, is not empty and is not a make-model checkpoint "
                                             r"\(no edge0-make-model.json\)"):
            make_model("qwen3_moe", "tiny", out, force=force, progress=False)
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    make_model("qwen3_moe", "tiny", out, progress=False)
    assert json.loads((out / "edge0-make-model.json").read_text()) == {"arch": "qwen3_moe", "preset": "tiny",
                                                                       "format": "mlx", "seed": 0}
    with pytest.raises(Edge0Error, match="exists and is not empty; pass --force to replace it"):
        make_model("qwen3_moe", "tiny", out, fmt="hf", progress=False)
    make_model("qwen3_moe", "tiny", out, fmt="hf", force=True, progress=False)  # an earlier output: replaced
    assert json.loads((out / "edge0-make-model.json").read_text())["format"] == "hf"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no tmp or old directory left
    empty = tmp_path / "empty"
    empty.mkdir()
    make_model("qwen3_moe", "tiny", empty, progress=False)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(arch="llama", preset="tiny"), "qwen3_moe"),
        (dict(arch="qwen3_moe", preset="huge"), "paper-35b"),
        (dict(arch="qwen3_moe", preset="tiny", fmt="gguf"), "mlx"),
        (dict(arch="qwen3_moe", preset="paper-35b", fmt="hf"), "format mlx"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, kwargs, word):
    with pytest.raises(Edge0Error, match=word):
        make_model(out=tmp_path / "m", progress=False, **kwargs)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_paper_35b_plans_18_to_20_gb(arch):
    total = planned_bytes(arch, "paper-35b")
    assert 18e9 <= total <= 20e9, total / 1e9
    small = planned_bytes(arch, "small")
    assert 0.3e9 <= small <= 1.5e9, small / 1e9


# The real models' published shapes (their config.json), typed here: (layers, experts, K, hidden, expert FFN,
# q heads, kv heads, head dim, norm_topk_prob).
REAL = {"olmoe-1b-7b": (16, 64, 8, 2048, 1024, 16, 16, 128, False),
        "qwen3-30b-a3b": (48, 128, 8, 2048, 768, 32, 4, 128, True)}


@pytest.mark.parametrize("preset", REAL)
def test_real_model_presets_have_the_real_shapes(preset):
    """Without generating them: the config's shapes, and the routed experts' tensors as 4-bit words of group 64."""
    from edge0.model.make import model_config, planned_tensors

    c = model_config("qwen3_moe", preset)
    layers, experts, k, d, f, heads, kv, hd, norm = REAL[preset]
    assert (c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"], c["hidden_size"],
            c["moe_intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
            c["norm_topk_prob"]) == REAL[preset]
    plan = planned_tensors("qwen3_moe", preset)
    last = f"model.layers.{layers - 1}.mlp.switch_mlp"
    assert plan[f"{last}.down_proj.weight"] == ((experts, d, f * 4 // 32), "uint32")
    assert plan[f"{last}.gate_proj.scales"] == ((experts, f, d // 64), "bfloat16")
    assert plan[f"model.layers.{layers - 1}.self_attn.k_proj.weight"][0][0] == kv * hd
    assert preset in make.DIRECT_PRESETS  # its experts are random words, never float tensors quantized
    expert = 3 * d * f // 2 + 3 * 2 * (d * f // 64) * 2  # one bundle: packed words, bf16 scales and biases
    routed = sum(np.prod(s) * (4 if t == "uint32" else 2) for n, (s, t) in plan.items() if ".switch_mlp." in n)
    assert routed == layers * experts * expert


def test_real_model_presets_are_qwen3_moe_only(tmp_path):
    with pytest.raises(Edge0Error, match="real model's shapes on arch qwen3_moe; give --arch qwen3_moe"):
        make_model("bailing_moe", "olmoe-1b-7b", tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def test_experts_written_directly_as_random_words_make_a_store_that_runs(tmp_path, monkeypatch):
    """The real-shape presets' way of writing experts (as paper-35b's), at the tiny preset's scale: the words are
    not a quantized float tensor's, and the store converts and generates (here on a forced routing trace)."""
    from edge0.config import EngineConfig, IOConfig, RoutingConfig
    from edge0.engine import open_engine
    from edge0.io.routetrace import RouteTrace
    from edge0.model.convert import convert as to_store
    from edge0.model.traced import TracedRouting

    monkeypatch.setattr(make, "DIRECT_PRESETS", ("tiny",))
    src = make_model("qwen3_moe", "tiny", tmp_path / "m", progress=False)
    monkeypatch.undo()
    plain = make_model("qwen3_moe", "tiny", tmp_path / "p", progress=False)
    key = "model.layers.0.mlp.switch_mlp.up_proj.weight"
    assert not mx.array_equal(tensors(src)[key], tensors(plain)[key])
    store = to_store(src, tmp_path / "s", progress=False)
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.permutation(16)[:4] for _ in range(8)] for _ in range(4)]).astype(np.int32)
    with open_engine(EngineConfig(model=str(store), routing=RoutingConfig(mode="native"),
                                  io=IOConfig(executor="staged"))) as engine:
        TracedRouting(engine.store.model, trace=RouteTrace(ids, None, [0, 1, 2, 3]), record=False, what="t")
        fig = engine.generate(engine.request([1, 2, 3, 4], max_tokens=4, ignore_eos=True))
    assert len(fig.tokens) == 4 and fig.bytes_read > 0
