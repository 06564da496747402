"""Every mlx-lm MoE family Edge0 takes: a tiny random checkpoint of each (make-model, through the family's own
ModelArgs), converted, runs token for token as mlx-lm runs it (exact and staged executors, prefetch as native);
router descriptions select what the family's own code selects; predicted routing trains heads and runs."""

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from edge0.compute import expert_math
from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.model.adapter import FamilyBlock, StreamedExperts, expert_slots
from edge0.io.manifest import read_manifest
from edge0.model.arch import FAMILIES, read_config, text_config
from edge0.model.consistency import config_problems
from edge0.model.load import cast_floats, load_store
from edge0.model.routers import ROUTERS
from edge0.model.route_stats import moe_blocks
from edge0.decode.loop import generate_steps
from edge0.sched.trace import Trace
from edge0.train.head_phase import train_heads

from tests.helpers import use_kernel

STEPS = 8
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
GREEDY = make_sampler(0.0)
FAMILY_ARCHS = sorted(FAMILIES, key=str.lower)
# Families whose heads train and run: a router description, the block at layers[i].mlp (where train heads
# looks for it), and router logits over the stored experts only. Ten by default; EDGE0_FAMILIES=all runs all 29.
PREDICTED_ALL = ("deepseek_v3", "glm4_moe", "gpt_oss", "olmoe", "qwen2_moe", "qwen3_next", "dots1", "Klear",
                 "kimi_linear", "ernie4_5_moe", "afmoe", "bailing_moe_linear", "bailing_moe_v3", "deepseek",
                 "deepseek_v2", "deepseek_v32", "exaone_moe", "glm4_moe_lite", "glm_moe_dsa", "hunyuan", "laguna",
                 "mellum", "mimo_v2_flash", "mistral4", "solar_open", "step3p5", "qwen3_vl_moe", "kimi_vl", "kimi_k25")
PREDICTED = PREDICTED_ALL if os.environ.get("EDGE0_FAMILIES") == "all" else PREDICTED_ALL[:10]
_mlx_lm: dict = {}


def mlx_lm_run(src) -> tuple[list[int], list[int], list[np.ndarray]]:
    """The prompt ids and mlx-lm's greedy tokens and logits on the source checkpoint (float32, as Edge0 on CPU)."""
    if src not in _mlx_lm:
        model, tok = load(str(src))
        cast_floats(model, mx.float32)
        prompt = tok.encode(PROMPT)
        steps = zip(generate_step(mx.array(prompt), model, sampler=GREEDY), range(STEPS))
        out = [(t, np.array(lp.astype(mx.float32))) for (t, lp), _ in steps]
        _mlx_lm[src] = prompt, [t for t, _ in out], [lp for _, lp in out]
    return _mlx_lm[src]


def edge0_run(engine, prompt) -> tuple[list[int], list[np.ndarray]]:
    with engine.kernel.active():
        out = [(t, np.array(lp)) for t, lp in generate_steps(engine.store.model, prompt, max_tokens=STEPS,
                                                             sampler=GREEDY, runtime=engine.store.runtime)]
    return [t for t, _ in out], [lp for _, lp in out]


def engine(store, settings: dict):
    return open_engine(EngineConfig.of({"model": str(store), "kernel.dtype": "float32", "kernel.name": "mlx",
                                        **settings}))


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_tokens_match_mlx_lm_exact_staged_and_prefetch(models, arch):
    prompt, want, want_logits = mlx_lm_run(models(arch, "mlx", "src"))
    store = models(arch)
    assert config_problems(read_manifest(store), read_config(store)) == []  # what edge0 verify checks
    predictor = "next-router" if arch in ROUTERS else "repeat"
    runs = {}
    for name, fields in {"exact": {"routing.mode": "native", "io.executor": "exact"},
                         "staged": {"routing.mode": "native", "io.executor": "staged"},
                         # read ahead at every step: a warm page cache or the gate would pause it
                         "prefetch": {"routing.mode": "prefetch", "routing.predictor": predictor,
                                      "routing.read_ahead": "always"}}.items():
        with engine(store, fields) as e:
            runs[name] = edge0_run(e, prompt)
            if name == "prefetch":
                assert e.store.runtime.sched.stats.loads > 0
    for name, (tokens, logits) in runs.items():
        assert tokens == want, name
        for a, b in zip(logits, want_logits):
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-4, name


def _block_and_input(store, arch):
    """One MoE block of the store (every expert resident) and a batch of inputs that spreads its routing."""
    s = load_store(store, dtype="float32", executor="resident")
    layer, (_, block, attr) = next(iter(expert_slots(s.model).items()))
    fields = text_config(s.config)
    x = mx.random.normal((1, 24, fields.get("hidden_size") or fields["model_dim"]), key=mx.random.key(3))
    return s, block, block[attr], x


class _Spy:
    def __init__(self, executor):
        self.executor, self.inds = executor, []

    def __call__(self, x, inds):
        self.inds.append(inds)
        return self.executor(x, inds)


@pytest.mark.parametrize("arch", sorted(ROUTERS, key=str.lower))
def test_router_description_selects_as_the_family(models, arch):
    """route(x) names the experts the family's own code sends x to, and a block given its own logits as the
    decided routing (predicted routing's hook) computes what it computes natively."""
    s, block, experts, x = _block_and_input(models(arch), arch)
    assert isinstance(block, FamilyBlock) and isinstance(experts, StreamedExperts)
    experts.executor = spy = _Spy(experts.executor)
    native = block(x)
    inds, weights = block.route(x)
    own = spy.inds[0].reshape(inds.shape)
    assert np.array_equal(np.sort(np.array(inds), -1), np.sort(np.array(own), -1))
    assert weights.shape == inds.shape
    decided_inds, plan = block.decide(block.logits(x))
    if ROUTERS[arch].gate is None:  # the ids the family's own code picks, in its order
        assert np.array_equal(np.array(decided_inds), np.array(own))
    block.planned = lambda: (decided_inds, plan)
    decided = block(x)
    assert np.allclose(np.array(decided), np.array(native), rtol=1e-5, atol=1e-6)
    assert len(np.unique(np.array(own))) > 1  # the routing spreads: a constant one would prove little
    s.close()


@pytest.mark.parametrize("arch", PREDICTED)
def test_predicted_routing_trains_heads_and_routes_as_they_decide(models, arch, tmp_path):
    """Heads train on the family's store; under predicted routing each consumer layer routes exactly the experts
    its owner's head decided a step ahead (the staged set is the routed set: no prediction misses)."""
    store = models(arch)
    heads = tmp_path / "heads.safetensors"
    text = __file__  # a small text to train on (the default, the stdlib's sources, takes long to tokenize)
    report = train_heads(store, heads, data=text, heldout=text, steps=2, hidden=16, eval_windows=1, progress=False,
                         seq_len=32)
    consumers = set(report["consumers"])
    assert consumers and report["recall"]
    trace = Trace()
    with open_engine(EngineConfig(model=str(store), routing=RoutingConfig(mode="predicted", heads=str(heads)),
                                  io=IOConfig(executor="staged"),
                                  kernel=KernelConfig(dtype="float32", name="mlx")), trace=trace) as e:
        tokens, _ = edge0_run(e, e.encode_text(PROMPT))
    assert len(tokens) == STEPS
    preds = [ev["args"] for ev in trace.events if ev.get("name") == "prediction" and ev["args"]["layer"] in consumers
             and ev["args"]["step"] > 0]  # step 0 (the last prompt token) routes natively
    assert len(preds) == len(consumers) * (STEPS - 1) and all(p["misses"] == 0 for p in preds)


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_expert_kernel_path(models, arch):
    """Plain SwiGLU experts take Edge0's fused kernel node; the others their family's activation and biases,
    equal to MLX's kernels within int8 rounding."""
    s, block, experts, x = _block_and_input(models(arch), arch)
    inds = mx.random.randint(0, s.manifest.num_experts, (1, 24, s.manifest.top_k), key=mx.random.key(4))
    want = experts(x, inds)
    kernel = use_kernel("edge0")
    with kernel.active():
        got = experts(x, inds)
    plain = experts.fn is None
    # Not plain: biases and a clamped SwiGLU, MLPs, clamped or GELU-gated, an 8-bit down projection.
    assert plain == (arch not in ("gpt_oss", "nemotron_h", "phixtral", "step3p5", "gemma4_text", "gemma4",
                                  "granitemoe"))
    err = float(mx.linalg.norm(got - want) / mx.linalg.norm(want))
    assert err < 2e-2
    if plain and kernel.ext is not None:
        assert err > 0  # computed by the edge0 kernel, not MLX's
    if not plain:
        assert isinstance(experts.fn, expert_math.ExpertFn)
    s.close()


def test_moe_blocks_are_found_wherever_the_family_keeps_them(models):
    s = load_store(models("mixtral"), dtype="float32", executor="exact")
    blocks = moe_blocks(s.model)
    assert sorted(blocks) == sorted(expert_slots(s.model)) and all(isinstance(b, FamilyBlock) for b in blocks.values())
    for b in blocks.values():
        b.top_k = 3
    assert all(b.num_experts_per_tok == 3 for b in blocks.values())  # mixtral keeps K under its own name
    s.close()


HF = ("mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe", "olmoe", "minimax")  # w1/w2/w3 and per-expert projections


@pytest.mark.parametrize("arch", HF)
def test_hugging_face_layout_converts_as_mlx_lm_quantizes_it(models, arch, tmp_path):
    """The family's Hugging Face layout (one tensor per expert, stacked by its sanitize) converts to a store whose
    tokens are mlx-lm's on its own 4-bit conversion of the same checkpoint."""
    from mlx_lm.convert import convert as mlx_lm_convert

    src = models(arch, "hf", "src")
    assert not [n for n in mx.load(str(next(src.glob("model-*.safetensors")))) if ".switch_mlp." in n]
    oracle = tmp_path / "mlx-lm-q"
    mlx_lm_convert(str(src), mlx_path=str(oracle), quantize=True)
    prompt, want, _ = mlx_lm_run(oracle)
    with engine(models(arch, "hf"), {"routing.mode": "native", "io.executor": "exact"}) as e:
        assert edge0_run(e, prompt)[0] == want


def test_a_layout_not_understood_is_one_line_naming_family_and_tensor(models, tmp_path):
    import shutil

    from edge0.errors import Edge0Error
    from edge0.model.convert import convert
    from edge0.model.make import make_model

    src = tmp_path / "src"
    shutil.copytree(models("mixtral", "hf", "src"), src)
    shard = next(src.glob("model-*.safetensors"))
    weights = mx.load(str(shard))
    name = next(n for n in weights if ".experts.3.w1." in n)
    weights[name.replace(".w1.", ".w9.")] = weights.pop(name)  # a spelling mixtral's sanitize does not know
    mx.save_safetensors(str(shard), weights, metadata={"format": "pt"})
    with pytest.raises(Edge0Error) as e:
        convert(src, tmp_path / "out", progress=False)
    assert str(e.value) == f"{src}: a mixtral checkpoint (mlx-lm's mixtral layout): tensor {name!r} is missing"
    assert not (tmp_path / "out").exists()
    with pytest.raises(Edge0Error, match="arch gpt_oss: make-model knows no Hugging Face layout"):
        make_model("gpt_oss", "tiny", tmp_path / "gpt-oss-hf", fmt="hf", progress=False)


def test_prefetch_without_a_router_description_is_refused(models):
    from edge0.errors import Edge0Error

    assert "gemma4_text" not in ROUTERS and "gemma4" not in ROUTERS  # the router is in the decoder layer
    with pytest.raises(Edge0Error, match="no router description for this family .* use --predictor repeat"):
        engine(models("gemma4_text"), {"routing.mode": "prefetch", "routing.predictor": "next-router"})


@pytest.mark.parametrize("alias, arch", [("kimi_k2", "deepseek_v3"), ("minimax_m2", "minimax")])
def test_model_type_aliases_run_their_family(models, alias, arch, tmp_path):
    """A checkpoint whose model_type mlx-lm maps to another module (Kimi K2 is DeepSeek-V3's) converts and runs."""
    import json
    import shutil

    from edge0.model.convert import convert

    src = tmp_path / alias
    shutil.copytree(models(arch, "mlx", "src"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": alias}))
    store = convert(src, tmp_path / f"{alias}-store", progress=False)
    prompt, want, _ = mlx_lm_run(src)
    with engine(store, {"routing.mode": "prefetch", "routing.predictor": "next-router"}) as e:
        assert e.store.manifest.arch == alias and edge0_run(e, prompt)[0] == want
