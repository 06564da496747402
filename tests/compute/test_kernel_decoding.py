"""Edge0's CPU kernels as a model runs them: the fallback to MLX's kernels, greedy decoding against MLX on tiny
models, the decode graph's nodes, `edge0 bench --kernels`, the host eval and the graph hold. Extension tests skip
when it is not built."""

import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from edge0.compute import kernels, qmm
from edge0.compute.kernel_choice import current
from edge0.errors import Edge0Error
from tests.compute.kernel_refs import (  # restore: the settings put back after each test (autouse)
    EXT, IMPLS, needs_ext, quantized, rel, restore)
from tests.helpers import use_kernel


@needs_ext
def test_products_it_does_not_cover_run_on_mlx():
    """2-bit, bf16 activations, D not a multiple of 64: MLX's kernels, bitwise."""
    use_kernel("edge0")
    w2, s2, b2 = mx.quantize(mx.random.normal((4, 64, 256), key=mx.random.key(1)), group_size=64, bits=2)
    x = mx.random.normal((1, 1, 1, 256), key=mx.random.key(2))
    inds = mx.array([[0, 3]], dtype=mx.uint32)
    assert mx.array_equal(qmm.gather_qmm(x, w2, s2, b2, inds, group_size=64, bits=2, mode="affine"),
                          mx.gather_qmm(x, w2, s2, b2, rhs_indices=inds, transpose=True, group_size=64, bits=2))
    w, s, b = mx.quantize(mx.random.normal((64, 96), key=mx.random.key(3)), group_size=32, bits=4)
    xo = mx.random.normal((2, 96), key=mx.random.key(4))
    assert mx.array_equal(qmm.quantized_matmul(xo, w, s, b, group_size=32, bits=4, mode="affine"),
                          mx.quantized_matmul(xo, w, s, b, transpose=True, group_size=32, bits=4))
    xb = mx.random.normal((2, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    w, s, b = (a.astype(mx.bfloat16) if a.dtype == mx.float32 else a
               for a in mx.quantize(mx.random.normal((64, 256), key=mx.random.key(6)), group_size=64, bits=4))
    assert mx.array_equal(qmm.quantized_matmul(xb, w, s, b, group_size=64, bits=4, mode="affine"),
                          mx.quantized_matmul(xb, w, s, b, transpose=True, group_size=64, bits=4))


def test_mlx_kernel_is_mlx_bitwise():
    use_kernel("mlx")
    assert current().name == "mlx"
    w, s, b = quantized((5, 64, 256), 64, seed=0)
    x = mx.random.normal((2, 1, 1, 256), key=mx.random.key(0))
    inds = mx.array([[0, 4, 2], [1, 1, 3]], dtype=mx.uint32)
    assert mx.array_equal(qmm.gather_qmm(x, w, s, b, inds, group_size=64, bits=4, mode="affine"),
                          mx.gather_qmm(x, w, s, b, rhs_indices=inds, transpose=True, group_size=64, bits=4))


def test_missing_extension_falls_back_with_one_notice(monkeypatch, capsys):
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_reason", "not built")
    monkeypatch.setattr(kernels, "_noticed", False)
    with pytest.raises(Edge0Error, match="not built"):
        use_kernel("edge0")
    use_kernel("auto")
    assert current().name == "mlx"
    w, s, b = quantized((64, 128), 64, seed=0)
    x = mx.random.normal((1, 128), key=mx.random.key(0))
    y = qmm.quantized_matmul(x, w, s, b, group_size=64, bits=4, mode="affine")
    assert mx.array_equal(y, mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4))
    use_kernel("auto")
    current().name
    err = capsys.readouterr().err
    assert err.count("edge0: CPU kernels not built; using MLX's kernels") == 1


@needs_ext
def test_version_pin(monkeypatch):
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_reason", None)
    monkeypatch.setattr(EXT, "mlx_version", lambda: "0.0.1")
    assert not kernels.available()
    assert f"built against mlx 0.0.1 but mlx {mx.__version__} is installed" in kernels.reason()


def test_use_kernel_products():
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 64, bias=False))
    nn.quantize(model, group_size=64, bits=4)
    x = mx.random.normal((3, 128), key=mx.random.key(0))
    before = model(x)
    assert qmm.use_kernel_products(model) == 2
    assert all(isinstance(m, qmm.KernelQuantizedLinear) for m in model.layers)
    use_kernel("mlx")
    assert mx.array_equal(model(x), before)
    if EXT is not None:
        use_kernel("edge0")
        assert rel(model(x), np.array(before).astype(np.float64)) < 1e-2


@needs_ext
@pytest.mark.parametrize("arch,isa", [(a, IMPLS[-1]) for a in ("qwen3_moe", "qwen3_5_moe", "bailing_moe")] +
                         [("qwen3_moe", i) for i in IMPLS[:-1]])  # the narrower code paths on one family
def test_greedy_decoding_agrees_with_mlx(models, arch, isa):
    """The same prompt and forced tokens: per step, edge0's argmax equals MLX's on >= 90% of 64 steps and
    the log-probabilities are within relative L2 1e-2 (norms, RoPE, attention and products on edge0's kernels)."""
    from edge0.model.load import load_store
    from edge0.decode.loop import generate_steps

    kernels.set_isa(isa)

    store = models(arch)
    prompt = list(range(3, 19))
    runs = {}
    for kernel in ("mlx", "edge0"):
        use_kernel(kernel)
        assert current().name == kernel
        s = load_store(store, dtype="float32")
        forced = runs["mlx"][0] if kernel == "edge0" else None
        steps = list(generate_steps(s.model, prompt, max_tokens=64, sampler=make_sampler(0.0), forced=forced))
        s.close()
        runs[kernel] = ([t for t, _ in steps], [int(mx.argmax(lp)) for _, lp in steps], [np.array(lp) for _, lp in steps])
    want, got = runs["mlx"][0], runs["edge0"][1]
    agree = np.mean([a == b for a, b in zip(want, got)])
    worst = max(rel(a, b.astype(np.float64)) for a, b in zip(runs["edge0"][2], runs["mlx"][2]))
    print(f"{arch} {isa}: greedy agreement edge0 vs mlx over {len(want)} steps: {agree:.3f}, worst log-prob rel L2 {worst:.1e}")
    assert len(want) == 64 and agree >= 0.9 and worst < 1e-2


@needs_ext
def test_edge0_decode_graph_has_fewer_nodes(models):
    """`edge0 bench --kernels --kernel-graph STORE`: the fused ops leave a fraction of MLX's graph, and the nodes that
    keep their weights list a fraction of its inputs."""
    from edge0.bench.kernels import graph_nodes

    (mlx_nodes, mlx_inputs), (edge0_nodes, edge0_inputs) = (graph_nodes(str(models("qwen3_moe")), k)
                                                            for k in ("mlx", "edge0"))
    assert any(name.startswith("Edge0GLU") or name == "Edge0MoeBlock" for name in edge0_nodes)
    assert "Edge0GLU" not in mlx_nodes and "Edge0MoeBlock" not in mlx_nodes
    assert sum(edge0_nodes.values()) < 0.4 * sum(mlx_nodes.values())
    assert edge0_inputs < 0.08 * mlx_inputs  # listing their weights too: about 0.15x


@needs_ext
def test_decoder_stack_fuses_each_residual_add_with_the_next_norm(models):
    """On the edge0 kernel the qwen3_moe decoder stack runs each residual add with the norm after it (the next
    layer's input norm, the final norm) as one node, logits bit for bit those of mlx-lm's own stack on the same
    kernel, prompt and decode; under --kernel mlx mlx-lm's stack runs as it is."""
    from mlx_lm.models import qwen3_moe
    from mlx_lm.models.cache import make_prompt_cache

    from edge0.bench.kernels import node_counts
    from edge0.compute.dense import KernelQwen3MoeModel
    from edge0.model.load import load_store

    use_kernel("edge0")
    store = load_store(str(models("qwen3_moe")), executor="resident", dtype="float32")
    inner = store.model.model
    assert type(inner) is KernelQwen3MoeModel
    runs = {}
    for fused in (True, False):
        cache = make_prompt_cache(store.model)
        call = inner.__call__ if fused else (lambda *a, **k: qwen3_moe.Qwen3MoeModel.__call__(inner, *a, **k))
        prompt = call(mx.array([list(range(3, 12))]), cache)
        mx.eval(prompt, [c.state for c in cache])
        step = call(mx.array([[7]]), cache)
        runs[fused] = (prompt, step, node_counts(step))
    assert mx.array_equal(runs[True][0], runs[False][0]) and mx.array_equal(runs[True][1], runs[False][1])
    layers = len(inner.layers)
    nodes = runs[True][2]  # a decode step: each add-norm runs the node of its residual (attention, experts)
    assert nodes["Edge0AttentionBlock"] == nodes["Edge0MoeBlock"] == layers and "Add" not in nodes
    assert "Edge0DecodeAttention" not in nodes and "Edge0GLU" not in nodes and "Edge0SoftmaxTopK" not in nodes
    assert runs[False][2]["Add"] >= 2 * layers and "Edge0AddRMSNorm" not in runs[False][2]
    use_kernel("mlx")
    assert "Edge0AddRMSNorm" not in node_counts(store.model(mx.array([[7]]), cache=make_prompt_cache(store.model)))
    store.close()


@needs_ext
def test_bench_kernels_times_attention_on_the_kernel_it_names():
    """`edge0 bench --kernels`' attention rows: the time per call of the active kernel's attention (edge0's is
    one Edge0Attention node per call; MLX's never reaches the extension)."""
    from edge0.bench.kernels import _attention_us

    for kernel, nodes in (("edge0", True), ("mlx", False)):
        use_kernel(kernel)
        EXT.profile(True)
        EXT.set_profile(True)
        us = _attention_us(2, 4, 2, 1, 32, 0.01)
        EXT.set_profile(False)
        assert 0 < us < 1e6
        assert ("Edge0Attention" in EXT.profile(True)) == nodes


@needs_ext
def test_bench_kernels_times_the_embedding_on_the_kernel_it_names():
    """`edge0 bench --kernels`' embedding rows: a lookup under edge0 is one Edge0Embed node, under MLX none."""
    from edge0.bench.kernels import _embedding_us

    for kernel, nodes in (("edge0", True), ("mlx", False)):
        use_kernel(kernel)
        EXT.profile(True)
        EXT.set_profile(True)
        us = _embedding_us(64, 128, 0.01)
        EXT.set_profile(False)
        assert 0 < us < 1e6
        assert ("Edge0Embed" in EXT.profile(True)) == nodes


@pytest.mark.parametrize("spin_us", [0, 1000])
def test_host_eval_gives_the_values_mx_eval_gives(monkeypatch, spin_us):
    """host_eval (the caller spinning for the values, up to SPIN_US, then MLX's own wait; or mx.eval without the
    extension) leaves every array it is given evaluated, with mx.eval's values: arrays and lists of them, a graph
    of MLX and edge0 nodes, and an array whose stream work is still queued behind a long product; after queue (the
    stream held awake for the next graph) the next graph runs and is waited for the same way."""
    monkeypatch.setattr(kernels, "SPIN_US", spin_us)
    if spin_us == 0 and EXT is not None:
        monkeypatch.setattr(kernels, "load", lambda: None)  # the plain mx.eval path

    def graph():
        x = mx.random.normal((3, 512), key=mx.random.key(1))
        w, s, b = mx.quantize(mx.random.normal((2048, 512), key=mx.random.key(2)), group_size=64, bits=4)
        y = qmm.quantized_matmul(x, w, s, b, group_size=64, bits=4, mode="affine")
        return [mx.argmax(y, axis=-1), y.sum(), mx.exp(y[:, :4])]

    want = graph()
    mx.eval(want)
    got = graph()
    if EXT is not None:
        assert not EXT.ready(got)
    kernels.host_eval(got[0], got[1:])
    if EXT is not None:
        assert EXT.ready(got)  # every one waited for, not only scheduled
    for g, v in zip(got, want):
        assert np.array_equal(np.array(g), np.array(v))
    # a graph queued (the stream then held for the next one), another built on it and waited for
    first = graph()
    kernels.queue(first)
    second = [first[0] + 1, first[1] * 2]
    kernels.host_eval(second)
    if EXT is not None:
        assert EXT.ready(first + second)
    assert np.array_equal(np.array(second[0]), np.array(want[0]) + 1)
    assert np.array_equal(np.array(second[1]), np.array(want[1]) * 2)


@needs_ext
@pytest.mark.parametrize("hold", [True, False])
def test_a_hold_delays_an_unreleased_next_graph_and_hold_false_leaves_none(monkeypatch, hold):
    """After host_eval the stream is held for the next graph until a queue or host_eval releases it, at most HOLD_US
    (here 300 ms): a graph evaluated by plain mx.eval waits behind that hold. host_eval(hold=False) (before overlapped
    decode, whose steps go through mx.async_eval) releases the hold before it and leaves none."""
    monkeypatch.setattr(kernels, "HOLD_US", 300_000)
    x = mx.ones((4,))
    kernels.host_eval(x + 1)  # the stream held
    t0 = time.perf_counter()
    if not hold:
        kernels.host_eval(x + 3, hold=False)
    mx.eval(x * 2)
    waited = time.perf_counter() - t0
    assert (waited > 0.2) if hold else (waited < 0.1)
