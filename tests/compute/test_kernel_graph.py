"""Edge0's CPU kernels in a graph: fused nodes with the bits of the ops they replace, attention over a padded
batch, the quantized embedding, threads, adapters and the per-node profile. Extension tests skip when it is not
built."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from edge0.compute import qmm
from tests.compute.kernel_refs import (  # restore: the settings put back after each test (autouse); every_isa: on
    EXT, needs_ext, quantized, rel, restore, every_isa)  # each code path the build runs
from tests.helpers import use_kernel


@pytest.mark.usefixtures("every_isa")
@needs_ext
@pytest.mark.parametrize("producer", ["qmv", "glu+combine", "qmv+lora"])
def test_add_norm_runs_its_residuals_node_with_the_same_bits(producer):
    """Edge0AddRMSNorm whose r is a product node not yet evaluated computes r inside it (one node where there were
    two), with the bits of r evaluated first and added apart."""
    from edge0.bench.kernels import node_counts

    use_kernel("edge0")
    d, h, e, k, t = 256, 128, 6, 3, 5
    rng = np.random.default_rng(4)
    x, res = (mx.array(rng.standard_normal((t, d)).astype(np.float32)) for _ in range(2))
    w = mx.array(rng.standard_normal((d,)).astype(np.float32))
    q = quantized((d, d), 64, seed=1)
    gate, up, down = (quantized((e, *sh), 64, seed=i) for i, sh in enumerate(((h, d), (h, d), (d, h))))
    inds = mx.array(rng.integers(0, e, size=(t * k,)).astype(np.uint32))
    scores = mx.softmax(mx.array(rng.standard_normal((t, k)).astype(np.float32)), axis=-1)
    a, b = (mx.array(rng.standard_normal(sh).astype(np.float32) * 0.1) for sh in ((d, 8), (8, d)))
    mx.eval(x, res, w, q, gate, up, down, inds, scores, a, b)

    def r():
        if producer == "qmv":
            return EXT.qmv(x, *q)
        if producer == "qmv+lora":
            return EXT.qmv_lora(x, *q, a, b, 2.0, 64)
        return EXT.combine(EXT.glu(x, inds, gate, up, down, 64, [t, k, d]), scores)

    inside = EXT.add_rms_norm(res, r(), w, 1e-6)
    apart_r = r()
    mx.eval(apart_r)
    apart = EXT.add_rms_norm(res, apart_r, w, 1e-6)
    assert sum(node_counts(inside[1]).values()) == 1 and node_counts(apart[1]) == {"Edge0AddRMSNorm": 1}
    assert all(mx.array_equal(i, j) for i, j in zip(inside, apart))


@pytest.mark.usefixtures("every_isa")
@needs_ext
@pytest.mark.parametrize("t", [1, 3])
def test_routed_glu_and_its_combine_are_one_node_with_the_bits_of_two(t):
    """combine() of a GLU node not yet evaluated builds one node that sums the rows as it computes them, with the
    bits of the GLU node and Edge0Combine run apart (the apart case: the GLU's output evaluated first)."""
    from edge0.bench.kernels import node_counts
    from edge0.compute.routing import combine

    use_kernel("edge0")
    d, h, e, k = 256, 128, 6, 3
    parts = {n: quantized((e, *shape), 64, seed=i) for i, (n, shape) in
             enumerate((("gate_proj", (h, d)), ("up_proj", (h, d)), ("down_proj", (d, h))))}
    bank = {f"{n}.{f}": a for n, p in parts.items() for f, a in zip(("weight", "scales", "biases"), p)}
    rng = np.random.default_rng(t)
    inds = mx.array(rng.integers(0, e, size=(1, t, k)).astype(np.uint32))
    x = mx.array(rng.standard_normal((1, t, d)).astype(np.float32))
    scores = mx.softmax(mx.array(rng.standard_normal((1, t, k)).astype(np.float32)), axis=-1)
    mx.eval(inds, x, scores, bank)
    fused = combine(qmm.gather_glu(x, inds, bank, group_size=64, bits=4, mode="affine"), scores, cast_back=False)
    assert node_counts(fused) == {"Edge0GLU": 1}
    y = qmm.gather_glu(x, inds, bank, group_size=64, bits=4, mode="affine")
    mx.eval(y)
    apart = combine(y, scores, cast_back=False)
    assert node_counts(apart) == {"Edge0Combine": 1}
    assert fused.shape == apart.shape == (1, t, d) and mx.array_equal(fused, apart)


@pytest.mark.usefixtures("every_isa")
@needs_ext
def test_a_left_padded_batch_ropes_and_attends_each_row_as_alone():
    """Batched decode over mlx-lm's BatchKVCache: RoPE at each sequence's own offset and attention from its own
    first key (the left padding an input, one node each) give every row the bits of that row run alone, and
    match MLX's masked attention."""
    from mlx_lm.models.base import create_causal_mask

    from edge0.compute import dense

    use_kernel("edge0")
    key = iter(mx.random.split(mx.random.key(1), 8))
    q = mx.random.normal((3, 8, 1, 64), key=next(key))
    offsets = mx.array([40, 3, 17], dtype=mx.int32)
    got = dense.rope(q, 64, traditional=False, base=10000.0, scale=1.0, offset=offsets)
    for b, o in enumerate(offsets.tolist()):
        alone = dense.rope(q[b:b + 1], 64, traditional=False, base=10000.0, scale=1.0, offset=o)
        assert mx.array_equal(got[b:b + 1], alone), b
        want = mx.fast.rope(q[b:b + 1], 64, traditional=False, base=10000.0, scale=1.0, offset=o)
        assert rel(alone, np.array(want).astype(np.float64)) < 1e-5
    k, v = (mx.random.normal((3, 2, 41, 64), key=next(key)) for _ in range(2))
    pads = mx.array([0, 37, 23], dtype=mx.int32)  # each sequence's keys are the last 41 - pad

    class Cache:
        left_padding = pads

    mask = create_causal_mask(1, offset=40, left_padding=pads)
    EXT.profile(True)
    EXT.set_profile(True)
    got = dense.scaled_dot_product_attention(q, k, v, cache=Cache(), scale=0.125, mask=mask)
    mx.eval(got)
    EXT.set_profile(False)
    assert EXT.profile(True)["Edge0Attention"][0] == 1  # the batch in one node
    for b, p in enumerate(pads.tolist()):
        alone = dense.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, p:], v[b:b + 1, :, p:], cache=None,
                                                   scale=0.125, mask=None)
        assert mx.array_equal(got[b:b + 1], alone), b
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert rel(got, np.array(want).astype(np.float64)) < 1e-5


@needs_ext
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (4, 128), (8, 64)])
@pytest.mark.parametrize("dtype", [mx.int32, mx.uint32])
def test_quantized_embedding_is_one_node_with_mlx_bits(bits, gs, dtype):
    """A quantized embedding's lookup on the edge0 kernel: one node, each row bit for bit MLX's dequantized row;
    an id past the table gives zeros (MLX's gather reads out of bounds)."""
    emb = nn.Embedding(40, 256)
    emb.weight = mx.random.normal((40, 256), key=mx.random.key(bits + gs)) * 0.05
    emb = qmm.KernelQuantizedEmbedding.from_embedding(emb, group_size=gs, bits=bits)
    ids = mx.array([[3, 0, 39], [7, 7, 12]], dtype=dtype)
    use_kernel("mlx")
    want = emb(ids)
    use_kernel("edge0")
    EXT.set_profile(True)
    EXT.profile(True)
    got = emb(ids)
    mx.eval(got)
    nodes = EXT.profile(True)
    EXT.set_profile(False)
    assert got.shape == (2, 3, 256) and got.dtype == mx.float32
    assert np.array_equal(np.array(got), np.array(want))
    assert list(nodes) == ["Edge0Embed"] and nodes["Edge0Embed"][0] == 1
    past = emb(mx.array([40, 0], dtype=dtype))
    assert not np.array(past[0]).any() and np.array_equal(np.array(past[1]), np.array(want[0, 1]))


@needs_ext
def test_threads_give_identical_results():
    use_kernel("edge0")
    w, s, b = quantized((16, 256, 1024), 64, seed=3)
    x = mx.random.normal((4, 1, 1, 1024), key=mx.random.key(0))
    inds = mx.array(np.random.default_rng(0).integers(0, 16, (4, 6)).astype(np.uint32))
    outs = []
    for t in (1, 2, 3):
        EXT.set_num_threads(t)
        outs.append(np.array(qmm.gather_qmm(x, w, s, b, inds, group_size=64, bits=4, mode="affine")))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.usefixtures("every_isa")
@needs_ext
def test_prompt_chunks_and_batches_on_prompt_threads_give_identical_results():
    """A node of at least SPREAD_ROWS token rows (a prompt chunk; a served batch's step, one row per sequence)
    runs its products and attention on the prompt threads, one sequence's decode step on the decode threads:
    the numbers are the same on any count."""
    use_kernel("edge0")
    e, d, h, t = 8, 256, 128, 3 * EXT.PROMPT_ROWS + 5
    parts = {n: quantized((e, *shape), 64, seed=i) for i, (n, shape) in
             enumerate((("gate_proj", (h, d)), ("up_proj", (h, d)), ("down_proj", (d, h))))}
    bank = {f"{n}.{f}": a for n, p in parts.items() for f, a in zip(("weight", "scales", "biases"), p)}
    rng = np.random.default_rng(5)
    inds = mx.array(rng.integers(0, e, size=(t, 4)).astype(np.uint32))
    x = mx.array(rng.standard_normal((t, d)).astype(np.float32))
    q, k, v = (mx.array(rng.standard_normal((1, hh, t, 64)).astype(np.float32)) for hh in (4, 2, 2))
    batch = EXT.SPREAD_ROWS + 2  # a batch's decode step: one query row for each of its sequences
    bq = mx.array(rng.standard_normal((batch, 4, 1, 64)).astype(np.float32))
    bk, bv = (mx.array(rng.standard_normal((batch, 2, 40, 64)).astype(np.float32)) for _ in range(2))
    assert EXT.SPREAD_ROWS <= EXT.PROMPT_ROWS
    outs = []
    for decode, prompt in ((1, 1), (1, 2), (1, 3), (2, 1)):
        EXT.set_num_threads(decode, prompt)
        assert (EXT.num_threads(), EXT.prompt_threads()) == (decode, prompt)
        outs.append([np.array(a) for a in (qmm.gather_glu(x, inds, bank, group_size=64, bits=4, mode="affine"),
                                           EXT.attention(q, k, v, 0.125, True),
                                           qmm.gather_glu(x[:1], inds[:1], bank, group_size=64, bits=4,
                                                          mode="affine"),
                                           qmm.gather_glu(x[:batch], inds[:batch], bank, group_size=64, bits=4,
                                                          mode="affine"),
                                           EXT.attention(bq, bk, bv, 0.125, False))])
    assert all(np.array_equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
    EXT.set_num_threads(2)  # an explicit count holds for both
    assert EXT.prompt_threads() == 2


@pytest.mark.usefixtures("every_isa")
@needs_ext
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_lora_linear_is_the_product_plus_the_adapter(rows):
    """An unmerged adapter's projection in one node equals the edge0 product plus MLX's low-rank branch."""
    use_kernel("edge0")
    from edge0.model.lora import LoRALinear

    lin = nn.QuantizedLinear(256, 96, bias=False, group_size=64, bits=4)
    lin.update(dict(zip(("weight", "scales", "biases"), quantized((96, 256), 64, seed=7))))
    assert qmm.use_kernel_products(lin) == 1
    rng = np.random.default_rng(rows)
    a = mx.array(rng.standard_normal((256, 8)).astype(np.float32) * 0.1)
    b = mx.array(rng.standard_normal((8, 96)).astype(np.float32) * 0.1)
    x = mx.array(rng.standard_normal((1, rows, 256)).astype(np.float32))
    layer = LoRALinear(lin, a, b, 2.0)
    got = layer(x)
    want = lin(x) + 2.0 * (np.array(x) @ np.array(a)) @ np.array(b)
    assert got.shape == (1, rows, 96)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert qmm.lora_linear(x, lin, a, b, 2.0) is not None  # the fused node, not MLX's fallback
    with pytest.raises(ValueError, match="lora_a must be"):
        EXT.qmv_lora(x, lin["weight"], lin["scales"], lin["biases"], b, a, 1.0, 64)


@pytest.mark.usefixtures("every_isa")
@needs_ext
@pytest.mark.parametrize("rank", [16, 8])
def test_a_bfloat16_adapter_gives_the_bits_of_its_float32_widening(rank):
    """An adapter served in bfloat16 (half the bytes a step reads for it): its projection, in one node for 1 to 9 rows
    (the rank-16 path's row tiles of 4, 3, 2 and 1; rank 8 the plain loop), equals the same node on lora_a and lora_b
    widened to float32 first, bit for bit; a bfloat16 A with a float32 B is refused."""
    use_kernel("edge0")
    w, s, b = quantized((96, 256), 64, seed=11)
    rng = np.random.default_rng(rank)
    a16 = mx.array(rng.standard_normal((256, rank)).astype(np.float32) * 0.1).astype(mx.bfloat16)
    b16 = mx.array(rng.standard_normal((rank, 96)).astype(np.float32) * 0.1).astype(mx.bfloat16)
    a32, b32 = a16.astype(mx.float32), b16.astype(mx.float32)
    for rows in (1, 2, 3, 4, 5, 9):
        x = mx.array(rng.standard_normal((1, rows, 256)).astype(np.float32))
        got = EXT.qmv_lora(x, w, s, b, a16, b16, 2.0, 64)
        want = EXT.qmv_lora(x, w, s, b, a32, b32, 2.0, 64)
        assert np.array_equal(np.array(got), np.array(want)), rows
        plain = EXT.qmv_lora(x, w, s, b, a32, mx.zeros_like(b32), 2.0, 64)
        assert not np.array_equal(np.array(got), np.array(plain))  # the branch is there
    with pytest.raises(ValueError, match="both float32 or both bfloat16"):
        EXT.qmv_lora(x, w, s, b, a16, b32, 2.0, 64)


@needs_ext
def test_profile_times_each_node_kind_only_while_on():
    use_kernel("edge0")
    w, s, b = quantized((48, 256), 64, seed=2)
    x = mx.random.normal((3, 256), key=mx.random.key(4))
    EXT.profile(True)
    mx.eval(qmm.quantized_matmul(x, w, s, b, group_size=64, bits=4, mode="affine"))
    assert EXT.profile(True) == {}  # off by default
    EXT.set_profile(True)
    try:
        for _ in range(2):
            mx.eval(qmm.quantized_matmul(x, w, s, b, group_size=64, bits=4, mode="affine"))
        mx.eval(EXT.rms_norm(x, mx.ones((256,)), 1e-6))
    finally:
        EXT.set_profile(False)
    got = EXT.profile(True)
    assert set(got) == {"Edge0QMV 48x256", "Edge0RMSNorm"}
    assert got["Edge0QMV 48x256"][0] == 2 and got["Edge0RMSNorm"][0] == 1 and all(t > 0 for _, t in got.values())
    assert EXT.profile(True) == {}  # reset


@pytest.mark.usefixtures("every_isa")
@needs_ext
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 5, 48)])
def test_residual_add_and_norm_are_one_node_with_the_bits_of_two(shape):
    """Edge0AddRMSNorm: (x + r, rms_norm(x + r)) equal to MLX's Add and Edge0RMSNorm run apart."""
    key = iter(mx.random.split(mx.random.key(3), 3))
    x, r = (mx.random.normal(shape, key=next(key)) for _ in range(2))
    w = mx.random.normal(shape[-1:], key=next(key))
    mx.eval(x, r, w)
    h, n = EXT.add_rms_norm(x, r, w, 1e-6)
    from edge0.bench.kernels import node_counts

    assert node_counts(n) == {"Edge0AddRMSNorm": 1}
    assert mx.array_equal(h, x + r) and mx.array_equal(n, EXT.rms_norm(x + r, w, 1e-6))
    with pytest.raises(ValueError, match="add_rms_norm: x and r of one shape"):
        EXT.add_rms_norm(x, r[..., :-1], w, 1e-6)
