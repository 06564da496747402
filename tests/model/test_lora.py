"""The unmerged recovery adapter in serving: its math, where it goes in each architecture, its binding to a
store and its heads, the default file next to the store, and that the training graph (the student path)
is the served one bit for bit."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig
from edge0.engine import open_engine, resolve
from edge0.errors import Edge0Error
from edge0.io.manifest import read_manifest
from edge0.model.arch import read_config
from edge0.model.heads import HeadSet, model_fingerprint
from edge0.model.load import load_store
from edge0.model.lora import Adapter, LoRALinear, adapted, heads_fingerprint, targets
from tests import helpers
from tests.conftest import ARCHS


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    """A copy of the tiny qwen3_moe store with (untrained) heads for its K, a zero adapter and a random one."""
    store = tmp_path_factory.mktemp("lora") / "store"
    shutil.copytree(models("qwen3_moe"), store)
    m, config = read_manifest(store), read_config(store)
    heads = store / f"heads-k{m.top_k}.safetensors"
    mx.random.seed(0)
    HeadSet.create(m, config, top_k=m.top_k, hidden=16).save(heads)
    s = load_store(store)
    zero = Adapter.create(s.model, rank=4, alpha=8.0, fingerprint=model_fingerprint(m, config),
                          heads=heads_fingerprint(heads), top_k=m.top_k)
    s.close()
    zero.save(store.parent / "zero.safetensors")
    rand = Adapter(zero.weights, zero.rank, zero.alpha, zero.fingerprint, zero.heads, zero.top_k)
    rand.weights = {k: (a, mx.random.normal(b.shape) * 0.5) for k, (a, b) in zero.weights.items()}
    rand.save(store.parent / "rand.safetensors")
    return store, heads, store.parent / "zero.safetensors", store.parent / "rand.safetensors"


def test_branch_is_base_plus_scaled_low_rank_product():
    base = nn.Linear(8, 6, bias=False)
    a, b = mx.random.normal((8, 2)), mx.random.normal((2, 6))
    x = mx.random.normal((3, 5, 8))
    y = LoRALinear(base, a, b, 1.5)(x)
    want = np.array(x) @ np.array(base.weight).T + 1.5 * (np.array(x) @ np.array(a)) @ np.array(b)
    assert np.allclose(np.array(y), want, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_adapters_go_on_dense_projections_never_routers_or_routed_experts(models, arch):
    s = load_store(models(arch))
    try:
        found = targets(s.model)
        kinds = {k for _, k in found.values()}
        names = set(found)
    finally:
        s.close()
    assert not any(n.endswith((".mlp.gate", ".gate_proj.gate_proj", "shared_expert_gate")) or "mlp.gate." in n
                   or "switch" in n for n in names), names
    if arch == "qwen3_moe":  # every layer MoE without a shared expert: attention, and a branch beside each block
        layers = s.config["num_hidden_layers"]
        assert names == ({f"layers.{i}.self_attn.{p}_proj" for i in range(layers) for p in "qkvo"}
                         | {f"layers.{i}.mlp.branch" for i in range(layers)})
    elif arch == "qwen3_5_moe":
        assert kinds == {"attention", "linear_attention", "shared_expert", "moe_block"}
        assert "layers.0.linear_attn.out_proj" in names and "layers.0.mlp.shared_expert.down_proj" in names
    else:  # bailing: its first layer is dense (no block, no branch)
        assert kinds == {"attention", "shared_expert", "dense_mlp", "moe_block"}
        assert "layers.0.mlp.up_proj" in names and "layers.1.attention.query_key_value" in names
        assert "layers.1.mlp.branch" in names and "layers.0.mlp.branch" not in names


def test_zero_adapter_changes_nothing_and_no_adapter_costs_nothing(served):
    store, _, zero, rand = served
    tokens = list(range(3, 40))
    out = {}
    for name, lora in (("none", "none"), ("zero", str(zero)), ("rand", str(rand))):
        with open_engine(EngineConfig(model=str(store), routing=RoutingConfig(lora=lora),
                                      kernel=KernelConfig(name="mlx"))) as e:
            assert e.config.routing.mode == "predicted"
            assert len(adapted(e.store.model)) == (0 if lora == "none" else 5 * e.store.config["num_hidden_layers"])
            out[name] = np.array(e.forced_logprobs(tokens))
    assert np.array_equal(out["none"], out["zero"])  # a zero branch adds exact zeros
    assert np.abs(out["rand"] - out["none"]).max() > 1e-2


def test_training_graph_is_the_served_graph(served):
    """The student path (dequantized base, routing predicted by the heads) gives the served log-probabilities
    with the adapter in place, for a fresh window and for a prompt then generated tokens."""
    from edge0.train.student import load_student

    store, heads, _, rand = served
    tokens = list(range(5, 45))
    with open_engine(EngineConfig(model=str(store), routing=RoutingConfig(lora=str(rand)),
                                  kernel=KernelConfig(name="mlx"))) as e:
        want = np.array(e.forced_logprobs(tokens))
    student = load_student(store, heads)
    try:
        student.adapter(Adapter.read(rand))
        logits = student.logits(mx.array([tokens[:-1]]))[0]
        got = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        prompts = np.array([tokens[:6], tokens[10:16]], dtype=np.int32)
        seqs = student.generate(prompts, 5, temp=1.0, key=mx.random.key(3))
        parallel = student.logits(mx.array(seqs[:, :-1]), prefix=6)
    finally:
        student.close()
    assert np.allclose(got, want, atol=1e-5)
    assert seqs.shape == (2, 11) and np.array_equal(seqs[:, :6], prompts)
    with open_engine(EngineConfig(model=str(store), routing=RoutingConfig(lora=str(rand)),
                                  kernel=KernelConfig(name="mlx"))) as e:
        from mlx_lm.sample_utils import make_sampler

        from edge0.decode.loop import generate_steps

        for row, seq in enumerate(seqs):
            with e.kernel.active():
                steps = generate_steps(e.store.model, seq[:6].tolist(), max_tokens=5, sampler=make_sampler(0.0),
                                       runtime=e.store.runtime, forced=seq[6:].tolist())
                served_lp = np.array(mx.stack([lp for _, lp in steps]))
            p = np.array(parallel[row, 5:])
            assert np.allclose(served_lp, p - np.log(np.exp(p).sum(-1, keepdims=True)), atol=1e-4)


def test_adapter_files_round_trip_and_are_bound(served, models, tmp_path):
    store, heads, _, rand = served
    a = Adapter.read(rand)
    assert (a.rank, a.alpha, a.top_k, a.scale) == (4, 8.0, read_manifest(store).top_k, 2.0)
    m, config = read_manifest(store), read_config(store)
    assert Adapter.load(rand, m, config, heads_file=heads).heads == heads_fingerprint(heads)
    other = models("bailing_moe")
    with pytest.raises(Edge0Error, match="adapter trained for another model"):
        Adapter.load(rand, read_manifest(other), read_config(other), heads_file=heads)
    retrained = tmp_path / "heads.safetensors"
    mx.random.seed(5)
    HeadSet.create(m, config, top_k=m.top_k, hidden=16).save(retrained)
    with pytest.raises(Edge0Error, match=f"trained with other heads .* routes with {retrained}"):
        Adapter.load(rand, m, config, heads_file=retrained)
    with pytest.raises(Edge0Error, match="use --routing predicted, or --lora none"):
        Adapter.load(rand, m, config, heads_file=None)
    junk = tmp_path / "junk.safetensors"
    mx.save_safetensors(str(junk), {"x": mx.zeros(2)}, metadata={"format": "other"})
    with pytest.raises(Edge0Error, match="not an Edge0 adapter"):
        Adapter.read(junk)
    with pytest.raises(Edge0Error, match="no such adapter file"):
        Adapter.read(tmp_path / "missing.safetensors")


def test_default_adapter_is_the_one_beside_the_store_with_its_heads(served, tmp_path):
    store, heads, _, rand = served
    k = read_manifest(store).top_k
    assert resolve(EngineConfig(model=str(store))).routing.lora == "none"  # nothing beside the store yet
    shutil.copy(rand, store / f"lora-k{k}.safetensors")
    try:
        assert resolve(EngineConfig(model=str(store))).routing.lora == str(store / f"lora-k{k}.safetensors")
        assert resolve(EngineConfig(model=str(store), routing=RoutingConfig(mode="native"))).routing.lora == "none"
        assert resolve(EngineConfig(model=str(store), routing=RoutingConfig(lora="none"))).routing.lora == "none"
        other = tmp_path / "other-heads.safetensors"
        shutil.copy(heads, other)  # heads of one's own: the store's adapter is not theirs
        assert resolve(EngineConfig(model=str(store),
                                    routing=RoutingConfig(mode="predicted", heads=str(other)))).routing.lora == "none"
        named = resolve(EngineConfig(model=str(store),
                                     routing=RoutingConfig(heads=str(other))))  # the heads named route by default too
        assert (named.routing.mode, named.routing.heads, named.routing.lora) == ("predicted", str(other), "none")
        with pytest.raises(Edge0Error, match="routing.mode native does not apply"):
            resolve(EngineConfig(model=str(store), routing=RoutingConfig(mode="native", lora=str(rand))))
        out = helpers.run_json("--model", str(store), "--max-tokens", "4", "--prompt", "def f(x):")
        assert out["lora"] == str(store / f"lora-k{k}.safetensors") and out["routing"] == "predicted"
    finally:
        (store / f"lora-k{k}.safetensors").unlink()


def test_built_in_model_serves_its_adapters_by_default():
    """The demo store ships lora-k4 and lora-k2 (edge0/model/demo/MODEL_CARD.md): the default run uses the one for
    its K, and on held-out text the adapter repays part of what predicted routing costs."""
    from edge0.bench.quality import evaluate
    from edge0.model.demo import DEMO_STORE

    for k in (4, 2):
        c = resolve(EngineConfig(routing=RoutingConfig(top_k=None if k == 4 else k))).routing
        assert c.mode == "predicted" and c.lora == str(DEMO_STORE / f"lora-k{k}.safetensors")
        assert Adapter.read(c.lora).top_k == k
    ppl = {lora: evaluate(DEMO_STORE, max_tokens=512, config=EngineConfig(routing=RoutingConfig(lora=lora)))["ppl"]
           for lora in ("none", str(DEMO_STORE / "lora-k4.safetensors"))}
    assert ppl[str(DEMO_STORE / "lora-k4.safetensors")] < ppl["none"] * 0.99, ppl


def test_student_path_follows_the_heads_routes(served, tmp_path):
    """A head file whose `routes` leave a consumer out: served, that layer routes by its own router; so does the
    student path."""
    from edge0.train.student import load_student

    store, heads, _, _ = served
    hs = HeadSet.load(heads, read_manifest(store), read_config(store))
    hs.routes = []
    only = tmp_path / "routes-none.safetensors"
    hs.save(only)
    tokens = list(range(7, 40))
    with open_engine(EngineConfig(model=str(store), routing=RoutingConfig(mode="predicted", heads=str(only)),
                                  kernel=KernelConfig(name="mlx"))) as e:
        want = np.array(e.forced_logprobs(tokens))
    with open_engine(EngineConfig(model=str(store), routing=RoutingConfig(mode="predicted"),
                                  kernel=KernelConfig(name="mlx"))) as e:
        assert not np.allclose(np.array(e.forced_logprobs(tokens)), want, atol=1e-3)  # the heads did route
    student = load_student(store, only)
    try:
        logits = student.logits(mx.array([tokens[:-1]]))[0]
    finally:
        student.close()
    assert np.allclose(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)), want, atol=1e-5)


def test_moe_branch_in_the_block_node_and_as_its_own_node_agree(tmp_path):
    """The branch beside each MoE block (kind moe_block) on the built-in model: added inside the block's one node
    (resident: Edge0MoeBlock) and as a node of its own after the experts (staged: Edge0AdaptAdd), the same bits; and
    it changes the output. (MLX's kernels run it too: test_training_graph_is_the_served_graph.)"""
    from edge0.model.demo import DEMO_STORE

    m, config = read_manifest(DEMO_STORE), read_config(DEMO_STORE)
    heads = DEMO_STORE / f"heads-k{m.top_k}.safetensors"
    s = load_store(DEMO_STORE)
    try:
        a = Adapter.create(s.model, fingerprint=model_fingerprint(m, config), heads=heads_fingerprint(heads),
                           top_k=m.top_k, seed=1)
    finally:
        s.close()
    layers = config["num_hidden_layers"]
    assert a.kinds() == {"attention": 4 * layers, "moe_block": layers}
    a.weights = {k: (w_a, mx.random.normal(w_b.shape, key=mx.random.key(2)) * 0.05 if k.endswith(".branch") else w_b)
                 for k, (w_a, w_b) in a.weights.items()}  # only the branches do anything
    a.save(tmp_path / "branch.safetensors")
    tokens = list(range(100, 150))
    out = {}
    arms = (("fused", "resident", "branch"), ("nodes", "staged", "branch"), ("none", "resident", "none"))
    for name, ex, lora in arms:
        adapter = str(tmp_path / "branch.safetensors") if lora == "branch" else "none"
        c = EngineConfig(routing=RoutingConfig(candidates=2 * m.top_k, lora=adapter), io=IOConfig(executor=ex),
                         kernel=KernelConfig(name="edge0"))
        with open_engine(c) as e:
            out[name] = np.array(e.forced_logprobs(tokens))
    assert np.array_equal(out["fused"], out["nodes"])
    assert np.abs(out["fused"] - out["none"]).max() > 1e-2
