"""A decode step's blocks from one call each on the edge0 kernel (compute/dense.py attention_block, model/blocks.py
SoftmaxMoeBlock.add_norm): the nodes the step builds one call at a time, so the same bits, in every routing the
built-in model serves resident; their remembered arguments follow weights that are replaced."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler

from edge0.compute import dense, kernels
from edge0.model import blocks
from tests.helpers import use_kernel

EXT = kernels.load()
pytestmark = pytest.mark.skipif(EXT is None, reason=f"edge0 CPU kernels {kernels.reason()}")

TEXT = Path(json.__file__).parent / "decoder.py"  # real text: varied routing, unlike a greedy loop


def _run(engine, ids: list[int], fused: bool, monkeypatch) -> tuple[np.ndarray, dict]:
    """Log-probabilities of 48 decode steps forced along `ids`, with the one-call blocks or without them; and how
    often each one-call block ran."""
    from edge0.decode.loop import generate_steps

    ran = {"attention": 0, "moe": 0}
    attention_block, add_norm = dense.attention_block, blocks.SoftmaxMoeBlock.add_norm

    def counted(name, fn):
        def call(*a):
            out = fn(*a) if fused else None
            ran[name] += out is not None
            return out
        return call

    monkeypatch.setattr(dense, "attention_block", counted("attention", attention_block))
    monkeypatch.setattr(blocks.SoftmaxMoeBlock, "add_norm", counted("moe", add_norm))
    with engine.kernel.active():
        steps = generate_steps(engine.store.model, ids[:40], max_tokens=48, sampler=make_sampler(0.0),
                               runtime=engine.store.runtime, forced=ids[40:88])
        out = np.stack([np.array(lp) for _, lp in steps])
    monkeypatch.undo()
    return out, ran


@pytest.mark.parametrize("config", [{}, {"routing.lora": "none"}, {"routing.mode": "native"}])
def test_a_step_of_one_call_blocks_is_the_bits_of_the_step_built_call_by_call(config, monkeypatch):
    """The default (predicted routing, the heads deciding in the graph, the adapter), predicted without the adapter,
    and native routing: every decode step's log-probabilities equal the step built one call at a time, bit for bit,
    and every decode step of every layer took both one-call blocks."""
    from edge0.config import EngineConfig
    from edge0.engine import demo_store, open_engine

    with open_engine(EngineConfig.of({"model": str(demo_store()), "kernel.name": "edge0", "serving.prompt_cache_gib": 0,
                                      **config})) as engine:
        ids = engine.encode_text(TEXT.read_text()[:2000])
        got, ran = _run(engine, ids, True, monkeypatch)
        want, apart = _run(engine, ids, False, monkeypatch)
    layers = 6
    assert ran == {"attention": 48 * layers, "moe": 48 * layers}  # the prompt's chunks (40 ids) take neither
    assert apart == {"attention": 0, "moe": 0}
    assert got.shape == (48, 4096) and np.array_equal(got, want)


def _layer_step(model, cache, tok: int, fused: bool, monkeypatch) -> np.ndarray:
    """Logits of one decode step from a copy of `cache`, with or without the one-call blocks."""
    if not fused:
        monkeypatch.setattr(dense, "attention_block", lambda *a: None)
        monkeypatch.setattr(blocks.SoftmaxMoeBlock, "add_norm", lambda *a: None)
    copy = []
    for c in cache:
        k = KVCache()
        k.keys, k.values, k.offset = mx.array(c.keys), mx.array(c.values), c.offset
        copy.append(k)
    out = np.array(model(mx.array([[tok]], dtype=mx.uint32), cache=copy))
    monkeypatch.undo()
    return out


def test_the_blocks_arguments_follow_replaced_weights(monkeypatch):
    """The one-call blocks remember their checked arguments per module; an adapter's weights or a norm's weight
    replaced (a training step, load_weights) are taken at the next step, as the step built call by call takes
    them."""
    from edge0.config import EngineConfig, KernelConfig, RoutingConfig, ServingConfig
    from edge0.engine import demo_store, open_engine

    use_kernel("edge0")
    with open_engine(EngineConfig(model=str(demo_store()), routing=RoutingConfig(mode="native"),
                                  kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine, engine.kernel.active():
        model = engine.store.model
        cache = [KVCache() for _ in model.layers]
        mx.eval(model(mx.array([engine.encode_text("def f(x):\n    return")], dtype=mx.uint32), cache=cache))
        before = _layer_step(model, cache, 7, True, monkeypatch)
        layer = model.model.layers[2]
        layer.self_attn.q_proj.scales = layer.self_attn.q_proj.scales * 1.5
        layer.post_attention_layernorm.weight = layer.post_attention_layernorm.weight * 0.5
        model.model.layers[4].input_layernorm.weight = model.model.layers[4].input_layernorm.weight * 2.0
        after = _layer_step(model, cache, 7, True, monkeypatch)
        want = _layer_step(model, cache, 7, False, monkeypatch)
    assert not np.array_equal(before, after)
    assert np.array_equal(after, want)


def test_a_decode_step_is_one_node_for_each_layers_attention_and_one_for_its_moe_block():
    """The default step's graph: per layer one Edge0AttentionBlock (both cache writes, the attention, its output
    projection with the adapter's branches, served in bfloat16, the add-norm) and one Edge0MoeBlock (router, top-k,
    experts, the adapter's branch beside the block, add-norm); no other node of a layer."""
    from edge0.bench.kernels import node_counts
    from edge0.config import EngineConfig, KernelConfig, ServingConfig
    from edge0.engine import demo_store, open_engine
    from edge0.model.lora import adapted

    with open_engine(EngineConfig(model=str(demo_store()), kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine, \
            engine.kernel.active():
        model, cache = engine.store.model, None
        served = adapted(model)
        assert len(served) == 24 + 6 and {m["lora_a"].dtype for m in served.values()} == {mx.bfloat16}
        assert sum(name.endswith(".mlp.branch") for name in served) == 6
        cache = [KVCache() for _ in model.layers]
        mx.eval(model(mx.array([engine.encode_text("def f(x):\n    return")], dtype=mx.uint32), cache=cache))
        nodes = node_counts(model(mx.array([[7]], dtype=mx.uint32), cache=cache))
    layers = 6
    assert nodes["Edge0AttentionBlock"] == nodes["Edge0MoeBlock"] == layers
    heads = {"Edge0QMV+Head+SoftmaxTopK"}  # (a step built outside generation may not run the heads)
    assert set(nodes) - heads == {"Edge0AttentionBlock", "Edge0MoeBlock", "Edge0Embed", "Edge0RMSNorm", "Edge0QMV"}


def test_the_layer_blocks_hold_their_weights_and_list_for_mlx_only_what_it_must_order():
    """The default step's Edge0AttentionBlock and Edge0MoeBlock nodes keep their evaluated inputs (the layer's
    weights, the adapter's) themselves: MLX sees, of the arrays with no node, only the cache's two buffers (which it
    must see to pass them on to the node's outputs), and the cache's buffers are passed on, never copied."""
    from edge0.bench.kernels import listed_inputs
    from edge0.config import EngineConfig, KernelConfig, ServingConfig
    from edge0.engine import demo_store, open_engine

    with open_engine(EngineConfig(model=str(demo_store()), kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine, \
            engine.kernel.active():
        model, ids = engine.store.model, engine.encode_text("def f(x):\n    return")
        cache = [KVCache() for _ in model.layers]
        mx.eval(model(mx.array([ids], dtype=mx.uint32), cache=cache))
        copies = EXT.kv_copies()
        out = model(mx.array([[7]], dtype=mx.uint32), cache=cache)
        found = {name: [leaves for leaves, _ in each] for name, each in listed_inputs(out).items()}
        mx.eval(out)
        assert EXT.kv_copies() == copies
    assert found["Edge0AttentionBlock"] == [2] * 6 and found["Edge0MoeBlock"] == [0] * 6


@pytest.mark.parametrize("bad, match", [
    (dict(among=mx.zeros((1, 1, 8), dtype=mx.int32)), "among must be uint32"),
    (dict(k=33), "1 <= k <= E"),
    (dict(h=mx.zeros((1, 1, 128))), "h must be x's shape"),
    (dict(lora=(mx.zeros((256, 16)), mx.zeros((16, 128)), 2.0)), "the branch must be lora_a"),
    (dict(lora=(mx.zeros((256, 16)), None, 2.0)), "lora_a and lora_b come together"),
    (dict(table=mx.zeros((16,), dtype=mx.uint32)), "the table must be uint32 \\(E,\\)"),
    (dict(table=mx.zeros((32,), dtype=mx.int32)), "the table must be uint32 \\(E,\\)"),
])
def test_moe_block_refuses_bad_arguments_with_one_clear_error(bad, match):
    """ext.moe_block names what is wrong (the extension's message), never a crash in the kernel."""
    from edge0.config import EngineConfig, KernelConfig, ServingConfig
    from edge0.engine import demo_store, open_engine

    with open_engine(EngineConfig(model=str(demo_store()), kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        block = engine.store.model.model.layers[0].mlp
        args = blocks._moe_args(EXT, block, block.executor.resident, mx.ones((256,)), mx.zeros((1, 1, 256)))
        router, router_gs, parts, gs = args
        call = dict(x=mx.zeros((1, 1, 256)), h=mx.zeros((1, 1, 256)), k=4, among=None, lora=(None, None, 0.0),
                    table=None)
        call.update(bad)
        with pytest.raises(ValueError, match=f"moe_block: .*{match}"):
            EXT.moe_block(call["x"], call["h"], router, router_gs, call["k"], True, call["among"], *parts, gs,
                          mx.ones((256,)), 1e-6, *call["lora"], call["table"])


def test_moe_block_over_a_slot_bank_reads_each_expert_where_the_table_puts_it():
    """Edge0MoeBlock over a bank of S slots holding some experts in another order, with the table of each one's slot:
    the node of every expert resident, bit for bit, for candidates the bank holds (one row and a batch's); a table
    that puts the experts elsewhere changes the answer (the table is read)."""
    from edge0.config import EngineConfig, KernelConfig, RoutingConfig, ServingConfig
    from edge0.engine import demo_store, open_engine

    with open_engine(EngineConfig(model=str(demo_store()), routing=RoutingConfig(mode="native"),
                                  kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        block = engine.store.model.model.layers[1].mlp
        resident = block.executor.resident
        norm = mx.random.uniform(0.5, 1.5, (256,), key=mx.random.key(3))
        router, router_gs, parts, gs = blocks._moe_args(EXT, block, resident, norm, mx.zeros((1, 1, 256)))
        held = np.array([9, 30, 2, 17, 5, 21, 12, 0], dtype=np.uint32)  # slot i holds expert held[i]
        slots = [[mx.take(a, mx.array(held), axis=0) for a in part] for part in parts]
        table = np.zeros(32, dtype=np.uint32)
        table[held] = np.arange(len(held), dtype=np.uint32)
        for rows in (1, 3):
            x = mx.random.normal((rows, 1, 256), key=mx.random.key(rows))
            h = mx.random.normal((rows, 1, 256), key=mx.random.key(10 + rows))
            among = mx.array(np.stack([np.roll(held, r)[:6] for r in range(rows)])[:, None, :])
            want = EXT.moe_block(x, h, router, router_gs, 4, True, among, *parts, gs, norm, 1e-6)
            got = EXT.moe_block(x, h, router, router_gs, 4, True, among, *slots, gs, norm, 1e-6, None, None, 0.0,
                                mx.array(table))
            wrong = EXT.moe_block(x, h, router, router_gs, 4, True, among, *slots, gs, norm, 1e-6, None, None, 0.0,
                                  mx.array((table + 1) % len(held)))
            mx.eval(want, got, wrong)
            for w, g in zip(want, got):
                assert np.array_equal(np.array(w), np.array(g))
            assert not np.array_equal(np.array(want[0]), np.array(wrong[0]))


def test_a_steps_log_probabilities_are_one_node_running_the_lm_head():
    """step_log_softmax: the LM head's product and the log-softmax of the step's one position in one node, with the
    bits of the product, the slice and log_softmax run apart, for one sequence and a batch; (V,) the first row."""
    from edge0.bench.kernels import node_counts
    from edge0.config import EngineConfig, KernelConfig, RoutingConfig, ServingConfig
    from edge0.engine import demo_store, open_engine

    use_kernel("edge0")
    with open_engine(EngineConfig(model=str(demo_store()), routing=RoutingConfig(mode="native"),
                                  kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        head = engine.store.model["lm_head"]
        for rows in (1, 3):
            x = mx.random.normal((rows, 1, 256), key=mx.random.key(rows))
            mx.eval(x)
            lp, first = dense.step_log_softmax(head(x))
            assert node_counts(lp) == {"Edge0QMV+LogSoftmax": 1}
            want = head(x)
            mx.eval(want)
            want = dense.log_softmax(want[:, -1, :])
            assert lp.shape == (rows, 4096) and first.shape == (4096,)
            assert mx.array_equal(lp, want) and mx.array_equal(first, want[0])
    with pytest.raises(ValueError, match="edge0 step_log_softmax: x \\(B, 1, V\\)"):
        EXT.step_log_softmax(mx.zeros((1, 2, 8)))


@pytest.mark.parametrize("bad, match", [
    (dict(h=mx.zeros((1, 1, 128))), "h \\(B, 1, N\\)"),
    (dict(offset=64), "0 <= offset < C"),
    (dict(keys=mx.zeros((2, 2, 64, 64))), "keys and values"),
    (dict(x=mx.zeros((2, 1, 256))), "a row per sequence"),
    (dict(dims=63), "rope dims even"),
    (dict(positions=mx.zeros((1,), dtype=mx.uint32)), "positions must be int32"),
])
def test_attention_block_refuses_bad_arguments_with_one_clear_error(bad, match):
    """ext.attention_block checks what the nodes it stands for would check, each with one message."""
    from edge0.config import EngineConfig, KernelConfig, RoutingConfig, ServingConfig
    from edge0.engine import demo_store, open_engine

    with open_engine(EngineConfig(model=str(demo_store()), routing=RoutingConfig(mode="native"),
                                  kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        layer = engine.store.model.model.layers[0]
        attn, post = layer["self_attn"], layer["post_attention_layernorm"]
        x = mx.zeros((1, 1, 256))
        q, k, v, o, lora_scale, gs, qw, qeps, kw, keps, turn, scale, pw, peps = dense._block_args(EXT, attn, post, x)
        call = dict(x=x, h=mx.zeros((1, 1, 256)), keys=mx.zeros((1, 2, 64, 64)), values=mx.zeros((1, 2, 64, 64)),
                    offset=3, dims=turn[0], positions=None)
        call.update(bad)
        with pytest.raises(ValueError, match=f"edge0 attention_block: .*{match}"):
            EXT.attention_block(call["x"], call["h"], q, k, v, o, lora_scale, gs, qw, qeps, kw, keps, call["keys"],
                                call["values"], call["offset"], call["dims"], *turn[1:], scale, pw, peps,
                                call["positions"], None)


def _triples(bank: dict) -> list[tuple]:
    return [tuple(bank[f"{p}.{k}"] for k in ("weight", "scales", "biases")) for p in ("gate_proj", "up_proj", "down_proj")
            if f"{p}.biases" in bank]


@pytest.mark.skipif(not kernels.available() or kernels.load().impl() != "avx512",
                    reason="the packed layout is the AVX-512 VNNI path's")
def test_the_default_run_packs_fixed_weights_and_no_bank_of_small_bundles():
    """The default engine on the demo packs its 4-bit dense linears and its resident experts (weights that never
    change) for the kernel as it loads (not inside the first prompt), and the tokens are those of the row layout; a
    staged engine's decode banks of bundles this
    small keep none (a fill's repack costs more than their products gain; larger bundles' banks keep one, rewritten
    slot by slot as fills land, test_executors), nor do its whole-layer prefill banks."""
    import gc

    from edge0.compute.banks import Bank
    from edge0.compute.qmm import KernelQuantizedLinear
    from edge0.config import EngineConfig, IOConfig, KernelConfig, ServingConfig
    from edge0.engine import open_engine
    from edge0.decode.request import GenRequest

    ext = kernels.load()
    with open_engine(EngineConfig(kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        model = engine.store.model  # loaded, nothing run yet: the copies are made
        linears = [m for _, m in model.named_modules() if isinstance(m, KernelQuantizedLinear) and m.bits == 4]
        assert linears and all(ext.packed(m["weight"], m["scales"], m["biases"], m.group_size) for m in linears)
        banks = [getattr(m.executor, "resident", None) for _, m in model.named_modules() if hasattr(m, "executor")]
        assert banks and all(r is not None for r in banks)
        assert all(ext.packed(*t, r.quant.group_size) for r in banks for t in _triples(r.bank))
        req = GenRequest(prompt=engine.encode_text("def parse(text):\n    return"), max_tokens=12)
        packed_tokens = engine.generate(req).tokens
        ext.set_packed(False)
        try:
            assert engine.generate(req).tokens == packed_tokens
        finally:
            ext.set_packed(True)
    del model, linears, banks
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, Bank)}
    # a budget that holds the experts once but not twice: resident, and no copy beside them
    with open_engine(EngineConfig(io=IOConfig(memory_budget_gib=0.015), kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        assert engine.store.runtime.executor == "resident"
        assert engine.generate(req).tokens == packed_tokens
        banks = [m.executor.resident for _, m in engine.store.model.named_modules() if hasattr(m, "executor")]
        assert banks and not any(ext.packed(*t, r.quant.group_size) for r in banks for t in _triples(r.bank))
    # bfloat16 activations: the kernel's products never run (MLX's do), so the load makes no copy for them
    with open_engine(EngineConfig(kernel=KernelConfig(name="edge0", dtype="bfloat16"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        model = engine.store.model
        linears = [m for _, m in model.named_modules() if isinstance(m, KernelQuantizedLinear) and m.bits == 4]
        banks = [m.executor.resident for _, m in model.named_modules() if hasattr(m, "executor")]
        assert linears and not any(ext.packed(m["weight"], m["scales"], m["biases"], m.group_size) for m in linears)
        assert banks and not any(ext.packed(*t, r.quant.group_size) for r in banks for t in _triples(r.bank))
        engine.generate(req)  # nor do their first products
        assert not any(ext.packed(*t, r.quant.group_size) for r in banks for t in _triples(r.bank))
    with open_engine(EngineConfig(io=IOConfig(executor="staged"), kernel=KernelConfig(name="edge0"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        assert engine.generate(req).tokens == packed_tokens
        decode = {id(b) for b in engine.store.runtime.banks}  # bundles under PACK_BANK_BYTES: refilled, not packed
        assert decode and all(b.packed == 0 for b in engine.store.runtime.banks)
        prefill = [o for o in gc.get_objects() if isinstance(o, Bank) and o._arrays is not None
                   and id(o) not in before and id(o) not in decode]  # whole-layer prefill: refilled whole, not packed
        assert prefill
        assert not any(ext.packed(*t, gs) for bank in prefill for t in _triples(bank._arrays) for gs in (32, 64, 128))
