"""Edge0's CPU kernels (csrc/) against a float64 dequantized reference, the fallback to MLX's kernels,
and greedy decoding with them on a tiny model. Extension tests skip when it is not built.
Shapes: T tokens, K routed, E experts, D inputs, N outputs."""

import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from edge0.compute import kernels, qmm
from edge0.compute.kernel import current
from edge0.errors import Edge0Error
from tests.helpers import use_kernel

EXT = kernels.load()
needs_ext = pytest.mark.skipif(EXT is None, reason=f"edge0 CPU kernels {kernels.reason()} (built by pip install -e . where a C++ compiler and cmake exist)")
IMPLS = ["portable"] + [i for i in ("avx2", "avx512") if EXT is not None and EXT.set_impl(i)]
TOL = {"portable": 1e-5, "avx2": 1e-2, "avx512": 1e-2}  # int8 activations: about 5e-3 on Gaussian inputs


@pytest.fixture(autouse=True)
def restore():
    yield
    if EXT is not None:
        EXT.set_impl(IMPLS[-1])
        EXT.set_num_threads(kernels.default_threads(), kernels.default_prompt_threads())


def quantized(shape, gs, seed, bits=4):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal(shape).astype(np.float32) * 0.05)
    w, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return w, s, b


def dequantized(w, s, b, gs, bits=4) -> np.ndarray:
    """float64 W from MLX's layout, unpacked by numpy: 32/bits values per uint32, element j in bits j*bits."""
    words = np.array(w)
    per = 32 // bits
    q = (words[..., None] >> (bits * np.arange(per, dtype=np.uint32))) & ((1 << bits) - 1)
    q = q.reshape(*words.shape[:-1], -1).astype(np.float64)
    s64 = np.repeat(np.array(s).astype(np.float64), gs, axis=-1)
    b64 = np.repeat(np.array(b).astype(np.float64), gs, axis=-1)
    return s64 * q + b64


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


GATHER = [  # (D, N, E, K, T, gs)
    (128, 64, 3, 1, 1, 64), (128, 96, 5, 3, 2, 32), (640, 200, 7, 5, 1, 128), (1024, 768, 12, 8, 1, 64),
    (2048, 512, 9, 3, 3, 32), (4096, 256, 6, 7, 1, 128), (384, 130, 10, 4, 2, 64), (256, 64, 33, 5, 4, 128),
    (192, 80, 5, 2, 1, 32), (320, 72, 6, 3, 2, 64), (1088, 64, 4, 2, 1, 32)]  # D % 128 == 64: the AVX-512 tail


@needs_ext
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,n,e,k,t,gs", GATHER)
def test_gather_matches_reference(impl, d, n, e, k, t, gs):
    assert EXT.set_impl(impl)
    use_kernel("edge0")
    w, s, b = quantized((e, n, d), gs, seed=d + n + e)
    ref_w = dequantized(w, s, b, gs)  # (E, N, D)
    rng = np.random.default_rng(k)
    inds = mx.array(rng.integers(0, e, size=(t, k)).astype(np.uint32))
    ii = np.array(inds)
    x = mx.array(rng.standard_normal((t, d)).astype(np.float32))
    xs = np.array(x).astype(np.float64)
    worst = 0.0
    # gate/up: one x row shared by K experts, (T, 1, 1, D) x (T, K) -> (T, K, 1, N)
    y = qmm.gather_qmm(mx.expand_dims(x, (-2, -3)), w, s, b, inds, group_size=gs, bits=4, mode="affine")
    want = np.einsum("tknd,td->tkn", ref_w[ii], xs)[:, :, None, :]
    assert y.shape == want.shape
    worst = max(worst, rel(y, want))
    # down: one x row per expert, (T, K, 1, D) x (T, K)
    xk = mx.array(rng.standard_normal((t, k, 1, d)).astype(np.float32))
    y = qmm.gather_qmm(xk, w, s, b, inds, group_size=gs, bits=4, mode="affine")
    want = np.einsum("tknd,tkd->tkn", ref_w[ii], np.array(xk)[:, :, 0].astype(np.float64))[:, :, None, :]
    worst = max(worst, rel(y, want))
    # switch_glu's sorted path: (T*K, 1, D) rows sorted by expert, indices (T*K,)
    order = np.argsort(ii.ravel(), kind="stable")
    xr = mx.array(np.repeat(np.array(x), k, axis=0)[order][:, None, :])
    y = qmm.gather_qmm(xr, w, s, b, mx.array(ii.ravel()[order]), group_size=gs, bits=4, mode="affine",
                       sorted_indices=True)
    want = np.einsum("rnd,rd->rn", ref_w[ii.ravel()[order]], np.repeat(xs, k, axis=0)[order])[:, None, :]
    worst = max(worst, rel(y, want))
    print(f"{impl} D{d} N{n} E{e} K{k} T{t} gs{gs}: relative L2 {worst:.2e}")
    assert worst < TOL[impl]


@needs_ext
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lead,d,n,gs", [((1,), 128, 256, 64), ((3,), 1024, 512, 32), ((2, 5), 2048, 128, 128),
                                         ((1, 1), 4096, 64, 64), ((67,), 512, 96, 64), ((2,), 576, 40, 64)])
def test_dense_matches_reference(impl, lead, d, n, gs):
    assert EXT.set_impl(impl)
    use_kernel("edge0")
    w, s, b = quantized((n, d), gs, seed=n)
    x = mx.array(np.random.default_rng(1).standard_normal((*lead, d)).astype(np.float32))
    y = qmm.quantized_matmul(x, w, s, b, group_size=gs, bits=4, mode="affine")
    want = np.array(x).astype(np.float64) @ dequantized(w, s, b, gs).T
    assert y.shape == want.shape
    print(f"{impl} dense {lead} D{d} N{n} gs{gs}: relative L2 {rel(y, want):.2e}")
    assert rel(y, want) < TOL[impl]


@needs_ext
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,h,e,k,t,gs", [(256, 128, 6, 3, 1, 64), (192, 320, 5, 2, 2, 32), (512, 256, 9, 4, 3, 128)])
def test_glu_matches_reference(impl, d, h, e, k, t, gs):
    """The fused routed product: down(silu(gate x) * up x) per (token, expert), against float64 (two
    int8 activation stages in a row: within 3% on the SIMD paths) and against the three products run apart."""
    assert EXT.set_impl(impl)
    use_kernel("edge0")
    parts = {n: quantized((e, *shape), gs, seed=i) for i, (n, shape) in
             enumerate((("gate_proj", (h, d)), ("up_proj", (h, d)), ("down_proj", (d, h))))}
    bank = {f"{n}.{f}": a for n, p in parts.items() for f, a in zip(("weight", "scales", "biases"), p)}
    rng = np.random.default_rng(t)
    inds = mx.array(rng.integers(0, e, size=(t, k)).astype(np.uint32))
    x = mx.array(rng.standard_normal((t, d)).astype(np.float32))
    y = qmm.gather_glu(x, inds, bank, group_size=gs, bits=4, mode="affine")
    ref = {n: dequantized(*p, gs)[np.array(inds)] for n, p in parts.items()}  # (T, K, N, D)
    xs = np.array(x).astype(np.float64)
    g, u = (np.einsum("tknd,td->tkn", ref[n], xs) for n in ("gate_proj", "up_proj"))
    want = np.einsum("tknh,tkh->tkn", ref["down_proj"], g / (1 + np.exp(-g)) * u)
    assert y.shape == want.shape
    print(f"{impl} glu D{d} H{h} E{e} K{k} T{t} gs{gs}: relative L2 {rel(y, want):.2e}")
    assert rel(y, want) < (TOL[impl] if impl == "portable" else 3e-2)
    xe = mx.expand_dims(x, (-2, -3))
    proj = {n: qmm.gather_qmm(xe, *parts[n], inds, group_size=gs, bits=4, mode="affine") for n in ("gate_proj", "up_proj")}
    apart = qmm.gather_qmm(nn.silu(proj["gate_proj"]) * proj["up_proj"], *parts["down_proj"], inds, group_size=gs,
                           bits=4, mode="affine")
    assert rel(y, np.array(apart[:, :, 0]).astype(np.float64)) < 1e-5


@needs_ext
@pytest.mark.parametrize("fn", ["exp", "erf"])
def test_exp_and_erf_are_mlx_bitwise(fn):
    """The kernels' exp and erf (attention's softmax, the routed SwiGLU, the heads' gelu), vectorized, give mx.exp's
    and mx.erf's bits: a sweep of [-100, 100] (where the rounding to 2**i changes, the +-88 cut-offs), specials,
    subnormals, and a length that is no multiple of the vector width (the scalar tail)."""
    sweep = np.linspace(-100, 100, 400_003, dtype=np.float32)
    edges = np.array([0.5, -0.5, 88, -88, 1e-30, -1e-30, 1e-45, -1e-45, 0.0, -0.0, np.inf, -np.inf, np.nan,
                      3.4e38, -3.4e38], np.float32)
    near = np.nextafter(np.repeat(edges[:6], 2), np.tile([np.inf, -np.inf], 6).astype(np.float32))
    halves = (np.arange(-130, 130, dtype=np.float32) + 0.5) / np.float32(1.442695)  # x * log2(e) near a half
    x = np.concatenate([sweep, edges, near, halves, np.nextafter(halves, np.float32(np.inf)),
                        np.nextafter(halves, np.float32(-np.inf))])
    got = np.array(EXT.math(mx.array(x), fn))
    want = np.array(getattr(mx, fn)(mx.array(x)))
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])  # -0.0 too
    with pytest.raises(ValueError, match="exp.*erf"):
        EXT.math(mx.array(x), "log")


@needs_ext
def test_log_softmax_is_mlx_bitwise():
    """A step's log-probabilities as one node: the bits of MLX's x - logsumexp(x) (its exp one float at a time, its
    sum in order), for a vocabulary's width and widths no multiple of the vector width, logits far apart, rows
    with infinities and NaN, a strided view; the rows of a batch each as alone. A sum in another order fails it."""
    from edge0.compute.dense import log_softmax

    mx.random.seed(3)
    cases = [mx.random.normal((1, 4096)) * 5, mx.random.normal((6, 4099)) * 40, mx.random.normal((2, 33)) * 300,
             mx.random.normal((3, 5, 64))[:, -1, :],
             mx.array([[-np.inf] * 7, [1.0, np.inf, 0, 0, 0, 0, 0], [0, np.nan, 1, 2, 3, 4, 5]])]
    use_kernel("edge0")
    for x in cases:
        want = np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))
        got = np.array(log_softmax(x))
        assert got.shape == want.shape and np.array_equal(got, want, equal_nan=True)
    rows = cases[1]
    assert np.array_equal(np.array(log_softmax(rows))[2], np.array(log_softmax(rows[2:3]))[0])
    with pytest.raises(ValueError, match="log_softmax"):
        EXT.log_softmax(mx.zeros((2, 3), dtype=mx.float16))


@needs_ext
def test_dense_ops_match_mlx():
    """RMS norm, RoPE and attention (one query, and causal prompts) against MLX's fast ops, views as inputs."""
    from edge0.compute import dense

    use_kernel("edge0")
    key = iter(mx.random.split(mx.random.key(0), 16))
    x = mx.random.normal((2, 5, 4, 64), key=next(key))
    w = mx.random.normal((64,), key=next(key))
    for xv in (x, x.transpose(0, 2, 1, 3)):  # contiguous and a transposed view
        assert rel(dense.rms_norm(xv, w, 1e-6), np.array(mx.fast.rms_norm(xv, w, 1e-6)).astype(np.float64)) < 1e-6
    q = x.transpose(0, 2, 1, 3)  # (B, H, L, Dh), as mlx-lm's attention ropes it
    for dims, trad, scale, offset in ((64, False, 1.0, 0), (32, False, 1.0, 37), (64, True, 0.5, 1000), (48, True, 1.0, 5)):
        got = dense.rope(q, dims, traditional=trad, base=10000.0, scale=scale, offset=offset)
        want = mx.fast.rope(q, dims, traditional=trad, base=10000.0, scale=scale, offset=offset)
        assert rel(got, np.array(want).astype(np.float64)) < 1e-5, (dims, trad, scale, offset)
    buf_k, buf_v = (mx.random.normal((2, 2, 64, 64), key=next(key)) for _ in range(2))  # a KV cache's buffers
    for s in (1, 7, 40):
        qd = mx.random.normal((2, 8, 1, 64), key=next(key))
        k, v = buf_k[..., :s, :], buf_v[..., :s, :]  # views, as KVCache.update_and_fetch returns them
        got = dense.scaled_dot_product_attention(qd, k, v, cache=None, scale=0.125, mask=None)
        want = mx.fast.scaled_dot_product_attention(qd, k, v, scale=0.125)
        assert rel(got, np.array(want).astype(np.float64)) < 1e-5, s
    for l, s, mask in ((9, 9, "causal"), (5, 40, "causal"), (6, 11, None)):  # a prompt, a chunk after a cache, no mask
        qd = mx.random.normal((2, 8, l, 64), key=next(key))
        k, v = buf_k[..., :s, :], buf_v[..., :s, :]
        got = dense.scaled_dot_product_attention(qd, k, v, cache=None, scale=0.125, mask=mask)
        want = mx.fast.scaled_dot_product_attention(qd, k, v, scale=0.125, mask=mask)
        assert rel(got, np.array(want).astype(np.float64)) < 1e-5, (l, s, mask)
    use_kernel("mlx")  # MLX's own ops, bitwise, under --kernel mlx
    assert mx.array_equal(dense.rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6))


@needs_ext
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits,d,gs", [(4, 2048, 64), (4, 1088, 32), (4, 640, 128), (8, 1024, 64), (8, 256, 32)])
def test_bf16_scales_give_the_bits_of_their_float32_widening(impl, bits, d, gs):
    """Scales and biases as stored (bfloat16) and widened to float32 first: the same products, bit for bit, dense,
    gathered and fused (GLU), on every code path; and the edge0 kernel takes them (no MLX fallback)."""
    assert EXT.set_impl(impl)
    use_kernel("edge0")
    rng = np.random.default_rng(d + bits)
    w, s, b = quantized((5, 48, d), gs, seed=d, bits=bits)
    s16, b16 = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    s32, b32 = s16.astype(mx.float32), b16.astype(mx.float32)  # exactly the bf16 values
    x = mx.array(rng.standard_normal((3, d)).astype(np.float32))
    assert qmm.fits(EXT, d, x.dtype, w, s16, b16, gs, bits, "affine")
    dense = [qmm.quantized_matmul(x, w[2], sc[2], bi[2], group_size=gs, bits=bits, mode="affine")
             for sc, bi in ((s16, b16), (s32, b32))]
    assert np.array_equal(np.array(dense[0]), np.array(dense[1]))
    inds = mx.array([[0, 4, 2], [3, 3, 1], [4, 0, 1]], dtype=mx.uint32)
    xe = mx.expand_dims(x, (-2, -3))
    gathered = [qmm.gather_qmm(xe, w, sc, bi, inds, group_size=gs, bits=bits, mode="affine")
                for sc, bi in ((s16, b16), (s32, b32))]
    assert np.array_equal(np.array(gathered[0]), np.array(gathered[1]))
    if bits == 4:
        parts = [quantized((5, *shape), gs, seed=i) for i, shape in enumerate(((256, d), (256, d), (d, 256)))]
        glu = []
        for dtype in (mx.bfloat16, mx.float32):  # as stored, then widened
            bank = {f"{n}.{f}": a if f == "weight" else a.astype(mx.bfloat16).astype(dtype)
                    for n, part in zip(("gate_proj", "up_proj", "down_proj"), parts)
                    for f, a in zip(("weight", "scales", "biases"), part)}
            glu.append(np.array(qmm.gather_glu(x, inds, bank, group_size=gs, bits=4, mode="affine")))
        assert np.array_equal(glu[0], glu[1])


@needs_ext
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_8bit_matches_reference(impl, gs):
    """8-bit weights (the routers): dense and gathered, against float64."""
    assert EXT.set_impl(impl)
    use_kernel("edge0")
    rng = np.random.default_rng(gs)
    w, s, b = quantized((64, 1024), gs, seed=gs, bits=8)
    x = mx.array(rng.standard_normal((3, 1024)).astype(np.float32))
    y = qmm.quantized_matmul(x, w, s, b, group_size=gs, bits=8, mode="affine")
    assert rel(y, np.array(x).astype(np.float64) @ dequantized(w, s, b, gs, bits=8).T) < TOL[impl]
    we, se, be = quantized((5, 96, 256), gs, seed=1, bits=8)
    inds = mx.array([[0, 4, 2], [3, 3, 1]], dtype=mx.uint32)
    xe = mx.array(rng.standard_normal((2, 1, 1, 256)).astype(np.float32))
    y = qmm.gather_qmm(xe, we, se, be, inds, group_size=gs, bits=8, mode="affine")
    want = np.einsum("tknd,td->tkn", dequantized(we, se, be, gs, bits=8)[np.array(inds)],
                     np.array(xe)[:, 0, 0].astype(np.float64))[:, :, None, :]
    assert rel(y, want) < TOL[impl]


@needs_ext
@pytest.mark.parametrize("shape,k,norm", [((5, 64), 4, True), ((2, 3, 60), 8, False), ((1, 128), 1, True)])
def test_softmax_topk_matches_mlx(shape, k, norm):
    """The routing node: the same experts as MLX's softmax/argpartition (as sets; its order is by
    probability), their scores within 1e-6."""
    from edge0.compute.routing import softmax_topk

    logits = mx.random.normal(shape, key=mx.random.key(k)) * 3
    use_kernel("mlx")
    want_i, want_s = softmax_topk(logits, k, norm)
    use_kernel("edge0")
    got_i, got_s = softmax_topk(logits, k, norm)
    assert got_i.shape == want_i.shape and got_i.dtype == mx.uint32 and got_s.dtype == mx.float32
    gi, gs_, wi, ws = (np.array(a).reshape(-1, k) for a in (got_i, got_s, want_i, want_s))
    for row in range(gi.shape[0]):
        assert set(gi[row]) == set(wi[row])
        np.testing.assert_allclose(gs_[row][np.argsort(gi[row])], ws[row][np.argsort(wi[row])], rtol=1e-6, atol=1e-7)
        assert list(gs_[row]) == sorted(gs_[row], reverse=True)


@needs_ext
@pytest.mark.parametrize("norm", [True, False])
def test_choose_among_candidates_matches_mlx(norm):
    """Predicted routing's choice: the router's k likeliest of each row's candidate ids, weighed by the softmax of
    all the logits (renormalised over the chosen when norm): the edge0 node and MLX's ops agree, the chosen are
    candidates and the likeliest of them, and with every expert a candidate it is plain softmax_topk."""
    from edge0.compute.routing import choose_among, softmax_topk

    t, e, m, k = 6, 32, 8, 4
    logits = mx.random.normal((t, 1, e), key=mx.random.key(11)) * 3
    rng = np.random.default_rng(3)
    among = mx.array(np.stack([rng.permutation(e)[:m] for _ in range(t)]).astype(np.uint32).reshape(t, 1, m))
    use_kernel("mlx")
    want_i, want_s = choose_among(logits, among, k, norm)
    use_kernel("edge0")
    got_i, got_s = choose_among(logits, among, k, norm)
    all_i, all_s = softmax_topk(logits, k, norm)
    full = np.array(choose_among(logits, mx.broadcast_to(mx.arange(e, dtype=mx.uint32), (t, 1, e)), k, norm)[1])
    np.testing.assert_array_equal(full, np.array(all_s))
    lg, am = np.array(logits).reshape(t, e), np.array(among).reshape(t, m)
    gi, gs_, wi, ws = (np.array(a).reshape(t, k) for a in (got_i, got_s, want_i, want_s))
    for row in range(t):
        best = am[row][np.argsort(-lg[row][am[row]])[:k]]
        assert set(gi[row]) == set(wi[row]) == set(best)
        np.testing.assert_allclose(gs_[row][np.argsort(gi[row])], ws[row][np.argsort(wi[row])], rtol=1e-6, atol=1e-7)
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    picked = np.take_along_axis(p, gi.astype(np.int64), -1)
    np.testing.assert_allclose(gs_, picked / picked.sum(-1, keepdims=True) if norm else picked, rtol=1e-5)
    assert not np.array_equal(np.sort(gi, -1), np.sort(np.array(all_i).reshape(t, k), -1))  # candidates matter
    with pytest.raises(ValueError, match="among must be uint32"):
        EXT.softmax_topk(logits, k, norm, among[..., :2])


@needs_ext
def test_combine_matches_mlx():
    from edge0.compute.routing import combine

    key = iter(mx.random.split(mx.random.key(3), 4))
    for shape in ((1, 4, 64), (2, 5, 8, 96)):
        y = mx.swapaxes(mx.random.normal(shape[:-2] + shape[:-3:-1], key=next(key)), -1, -2)  # a strided view
        scores = mx.softmax(mx.random.normal(shape[:-1], key=next(key)), axis=-1)
        use_kernel("mlx")
        want = combine(y, scores, cast_back=False)
        use_kernel("edge0")
        got = combine(y, scores, cast_back=False)
        assert got.shape == want.shape == shape[:-2] + shape[-1:]
        assert rel(got, np.array(want).astype(np.float64)) < 1e-6


@needs_ext
@pytest.mark.parametrize("producer", ["qmv", "glu+combine", "qmv+lora"])
def test_add_norm_runs_its_residuals_node_with_the_same_bits(producer):
    """Edge0AddRMSNorm whose r is a product node not yet evaluated computes r inside it (one node where there were
    two), with the bits of r evaluated first and added apart."""
    from edge0.bench_kernels import node_counts

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


@needs_ext
@pytest.mark.parametrize("t", [1, 3])
def test_routed_glu_and_its_combine_are_one_node_with_the_bits_of_two(t):
    """combine() of a GLU node not yet evaluated builds one node that sums the rows as it computes them, with the
    bits of the GLU node and Edge0Combine run apart (the apart case: the GLU's output evaluated first)."""
    from edge0.bench_kernels import node_counts
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


@needs_ext
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("d", [256, 384])
@pytest.mark.parametrize("bf16", [True, False])
def test_rows_sharing_an_expert_get_the_bits_of_each_row_alone(impl, gs, d, bf16):
    """A prompt chunk's (or a batch's) rows that share an expert are multiplied together, each weight row loaded
    once for several of them (the row tile); every output keeps the bits of its row multiplied alone, so prefill,
    batched decode and a sequence decoding alone agree. 19 rows, 2 experts each out of 4: runs of several rows."""
    use_kernel("edge0")
    EXT.set_impl(impl)
    w, s, b = quantized((4, 24, d), gs, seed=11)
    if bf16:
        s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((19, d)).astype(np.float32))
    idx = mx.array(rng.integers(0, 4, (19, 2)).astype(np.uint32))
    together = EXT.qmv(x, w, s, b, idx, gs)
    alone = mx.concatenate([EXT.qmv(x[t:t + 1], w, s, b, idx[t:t + 1], gs) for t in range(19)])
    assert mx.array_equal(together, alone)
    want = np.stack([dequantized(w[e], s[e].astype(mx.float32), b[e].astype(mx.float32), gs) @ np.array(x[t], np.float64)
                     for t in range(19) for e in np.array(idx[t]).tolist()])
    assert rel(together, want) < TOL[impl]



@needs_ext
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("d", [128, 256, 384])
def test_outputs_summed_four_at_once_keep_the_bits_of_one_alone(impl, gs, d):
    """A decode row's outputs are taken four weight rows at a time and their lane sums reduced together (and a
    row tile's four activation rows likewise); a matrix of one row takes the single dot product and its own
    reduction. Each weight row alone must give the bits it gets among the four."""
    use_kernel("edge0")
    EXT.set_impl(impl)
    w, s, b = quantized((8, d), gs, seed=3)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    x = mx.array(np.random.default_rng(9).standard_normal((1, d)).astype(np.float32) * 4)
    four = EXT.qmv(x, w, s, b, None, gs)
    one = mx.concatenate([EXT.qmv(x, w[n:n + 1], s[n:n + 1], b[n:n + 1], None, gs) for n in range(8)], axis=-1)
    assert mx.array_equal(four, one)
    rows = mx.concatenate([x, -x, 2 * x, x + 1])  # four rows sharing the weights: the row tile
    assert mx.array_equal(EXT.qmv(rows, w, s, b, None, gs)[0], four[0])

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


BAD_CALLS = {  # each must raise one ValueError naming the op, never crash or read out of bounds
    "embedding scales not per group": lambda: EXT.embed(mx.array([1]), mx.zeros((4, 32), dtype=mx.uint32),
                                                        mx.zeros((4, 3)), mx.zeros((4, 3)), 64, 4),
    "embedding of float ids": lambda: EXT.embed(mx.array([1.0]), mx.zeros((4, 32), dtype=mx.uint32), mx.zeros((4, 4)),
                                                mx.zeros((4, 4)), 64, 4),
    "no output rows": lambda: EXT.qmv(mx.zeros((1, 128)), mx.zeros((0, 16), dtype=mx.uint32), mx.zeros((0, 2)),
                                      mx.zeros((0, 2))),
    "D not a multiple of the group": lambda: EXT.qmv(mx.zeros((1, 192)), mx.zeros((8, 24), dtype=mx.uint32),
                                                     mx.zeros((8, 1)), mx.zeros((8, 1)), None, 128),
    "negative output shape": lambda: EXT.qmv(mx.zeros((1, 128)), mx.zeros((8, 16), dtype=mx.uint32), mx.zeros((8, 2)),
                                             mx.zeros((8, 2)), None, 64, [-1, -1, 8]),
    "float expert ids": lambda: EXT.qmv(mx.zeros((1, 128)), mx.zeros((3, 8, 16), dtype=mx.uint32), mx.zeros((3, 8, 2)),
                                        mx.zeros((3, 8, 2)), mx.array([1.7]), 64),
    "no x rows": lambda: EXT.qmv(mx.zeros((0, 128)), mx.zeros((8, 16), dtype=mx.uint32), mx.zeros((8, 2)),
                                 mx.zeros((8, 2))),
    "scales of another shape": lambda: EXT.qmv(mx.zeros((1, 128)), mx.zeros((8, 16), dtype=mx.uint32),
                                               mx.zeros((8, 3)), mx.zeros((8, 3))),
    "rms_norm over nothing": lambda: EXT.rms_norm(mx.zeros((2, 0)), mx.zeros((0,)), 1e-6),
    "rms_norm weight length": lambda: EXT.rms_norm(mx.zeros((2, 8)), mx.zeros((7,)), 1e-6),
    "combine of no experts": lambda: EXT.combine(mx.zeros((2, 0, 8)), mx.zeros((2, 0))),
    "top-k above E": lambda: EXT.softmax_topk(mx.zeros((2, 4)), 5, True),
    "rope of odd dims": lambda: EXT.rope(mx.zeros((1, 2, 3, 8)), 5, False, 1e4, 1.0, 0),
    "attention, more queries than keys": lambda: EXT.attention(mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 3, 8)),
                                                               mx.zeros((1, 2, 3, 8)), 1.0),
    "rope offsets of another length": lambda: EXT.rope(mx.zeros((2, 2, 1, 8)), 8, False, 1e4, 1.0, 0,
                                                        mx.zeros((3,), dtype=mx.int32)),
    "attention starts as floats": lambda: EXT.attention(mx.zeros((2, 2, 1, 8)), mx.zeros((2, 2, 3, 8)),
                                                        mx.zeros((2, 2, 3, 8)), 1.0, False, mx.zeros((2,))),
    "linear weight width": lambda: EXT.linear(mx.zeros((2, 8)), mx.zeros((4, 7))),
    "linear bias length": lambda: EXT.linear(mx.zeros((2, 8)), mx.zeros((4, 8)), mx.zeros((3,))),
    "head with float ids": lambda: EXT.head(*_head_args(now=mx.zeros((2, 1, 4)))),
    "head with fewer id rows": lambda: EXT.head(*_head_args(now=mx.zeros((1, 1, 4), dtype=mx.uint32))),
    "head delta width": lambda: EXT.head(*_head_args(delta=mx.zeros((32, 300)))),
}


def _head_args(**over):
    """EXT.head's arguments for 2 rows, D 256, E 32, hidden 64, with some replaced."""
    a = {"x": mx.zeros((2, 1, 256)), "now": mx.zeros((2, 1, 4), dtype=mx.uint32), "prev": None,
         "router": mx.zeros((2, 1, 32)), "delta": mx.zeros((32, 320)), "w1": mx.zeros((64, 320)), "b1": mx.zeros((64,)),
         "w2": mx.zeros((32, 64)), "b2": mx.zeros((32,))}
    a.update(over)
    return list(a.values())


@needs_ext
@pytest.mark.parametrize("rows,d,n,bias", [(1, 320, 96, True), (8, 2112, 512, True), (5, 17, 3, False),
                                           (40, 64, 33, True)])
def test_linear_matches_mlx_and_a_row_does_not_depend_on_the_others(rows, d, n, bias):
    """The heads' float linear: x @ W.T + b within float32 rounding of MLX's, and every row bit for bit what it
    is alone (a batch of sequences routes as each would alone), on one thread or two."""
    rng = np.random.default_rng(d)
    x = mx.array(rng.standard_normal((rows, 1, d)).astype(np.float32))
    w = mx.array(rng.standard_normal((n, d)).astype(np.float32) * 0.05)
    b = mx.array(rng.standard_normal((n,)).astype(np.float32)) if bias else None
    y = EXT.linear(x, w, b)
    want = np.array(x).astype(np.float64) @ np.array(w).astype(np.float64).T + (np.array(b) if bias else 0)
    assert y.shape == (rows, 1, n) and rel(y, want) < 1e-5
    alone = mx.concatenate([EXT.linear(x[i:i + 1], w, b) for i in range(rows)])
    assert np.array_equal(np.array(y), np.array(alone))
    EXT.set_num_threads(2, 2)
    assert np.array_equal(np.array(EXT.linear(x, w, b)), np.array(y))
    w16 = w.astype(mx.bfloat16)  # the served heads' weights: rows four at a time share each widened load
    y16 = EXT.linear(x, w16, b)
    assert np.array_equal(np.array(y16), np.array(EXT.linear(x, w16.astype(mx.float32), b)))
    assert np.array_equal(np.array(y16), np.array(mx.concatenate([EXT.linear(x[i:i + 1], w16, b) for i in range(rows)])))


def dot16_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T in dot16's order, in numpy: 16 float32 lanes (i mod 16), each a chain of fused multiply-adds over i (the
    product exact in float64, one rounding to float32), then the lanes in the tree lane j += lane j + k, k = 8, 4, 2,
    1."""
    rows, d = x.shape
    lanes = np.zeros((rows, w.shape[0], 16), np.float32)
    for i in range(d):
        prod = x[:, None, i].astype(np.float64) * w[None, :, i].astype(np.float64)
        lanes[:, :, i % 16] = (lanes[:, :, i % 16].astype(np.float64) + prod).astype(np.float32)
    for k in (8, 4, 2, 1):
        lanes[:, :, :k] = lanes[:, :, :k] + lanes[:, :, k:2 * k]
    return lanes[:, :, 0]


@needs_ext
@pytest.mark.parametrize("rows,d", [(1, 320), (4, 320), (1, 512), (4, 17)])
def test_linear_sums_in_dot16s_order(rows, d):
    """The heads' float linear, every path (one row 16 outputs at a time, four rows at a time, a tail past the last
    16 inputs), gives the bits of dot16's order computed apart in numpy: a lane tree in another association fails."""
    rng = np.random.default_rng(d + rows)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    w = (rng.standard_normal((32, d)) * 0.05).astype(np.float32)
    for wt in (mx.float32, mx.bfloat16):
        wm = mx.array(w).astype(wt)
        got = np.array(EXT.linear(mx.array(x)[:, None, :], wm, None))[:, 0, :]
        assert np.array_equal(got, dot16_reference(x, np.array(wm.astype(mx.float32)))), wt


@needs_ext
def test_heads_on_the_edge0_kernel_are_row_independent():
    """A prerouter head over a batch equals it over each row (edge0 kernel); under MLX's it is nn.Linear's."""
    from edge0.model.heads import Head

    head = Head(256, 32, 32, hidden=128)
    head.update({"fc2": {"weight": mx.random.normal((32, 128)) * 0.1, "bias": mx.zeros((32,))},
                 "delta": {"weight": mx.random.normal((32, 320)) * 0.1}})
    feats, router = mx.random.normal((8, 1, 320)), mx.random.normal((8, 1, 32))
    use_kernel("edge0")
    EXT.profile(True)
    EXT.set_profile(True)
    try:
        batch = head(feats, router)
        mx.eval(batch)
    finally:
        EXT.set_profile(False)
    assert EXT.profile(True)["Edge0Linear"][0] == 3  # the batch's three linears, one node each (MLX's matmul could
    # be row-independent too on some BLAS: equality alone would not show which ran)
    alone = mx.concatenate([head(feats[i:i + 1], router[i:i + 1]) for i in range(8)])
    assert np.array_equal(np.array(batch), np.array(alone))
    use_kernel("mlx")
    plain = router + head.delta(feats) + head.fc2(nn.gelu(head.fc1(feats)))
    assert np.array_equal(np.array(head(feats, router)), np.array(plain))
    assert rel(batch, np.array(plain).astype(np.float64)) < 1e-5


def random_head(rng):
    """A prerouter head for D 256, E 32, hidden 128, with random weights."""
    from edge0.model.heads import Head

    head = Head(256, 32, 32, hidden=128)
    head.update({"fc1": {"weight": mx.array(rng.standard_normal((128, 320)).astype(np.float32) * 0.1),
                         "bias": mx.array(rng.standard_normal(128).astype(np.float32) * 0.1)},
                 "fc2": {"weight": mx.array(rng.standard_normal((32, 128)).astype(np.float32) * 0.1),
                         "bias": mx.array(rng.standard_normal(32).astype(np.float32) * 0.1)},
                 "delta": {"weight": mx.array(rng.standard_normal((32, 320)).astype(np.float32) * 0.1)}})
    return head


@needs_ext
@pytest.mark.parametrize("prev", [True, False])
def test_routing_runs_the_router_and_head_nodes_it_decides_from(prev):
    """Edge0SoftmaxTopK whose logits are the router's product, not yet evaluated, runs that product inside it; a head
    whose router input is such a product runs it too, and a SoftmaxTopK deciding from that head runs the head: one
    node each way (Edge0QMV+SoftmaxTopK, Edge0QMV+Head+SoftmaxTopK), the bits of the nodes evaluated apart."""
    from edge0.bench_kernels import node_counts

    rng = np.random.default_rng(7)
    head = random_head(rng)
    w = quantized((32, 256), 64, seed=2, bits=8)
    x = mx.array(rng.standard_normal((3, 1, 256)).astype(np.float32))
    now = mx.array(rng.choice(32, size=(3, 1, 4)).astype(np.uint32))
    before = mx.array(rng.choice(33, size=(3, 1, 4)).astype(np.uint32)) if prev else None
    mx.eval(head.parameters(), w, x, now, before)
    use_kernel("edge0")

    def router():
        return EXT.qmv(x, *w, None, 64, [3, 1, 32])

    def apart(a):
        mx.eval(a)
        return a

    inside = EXT.softmax_topk(router(), 4, True)
    assert node_counts(inside[0]) == {"Edge0QMV+SoftmaxTopK": 1}
    assert all(mx.array_equal(i, j) for i, j in zip(inside, EXT.softmax_topk(apart(router()), 4, True)))
    logits = head.predict(x, now, before, router())
    assert node_counts(logits) == {"Edge0QMV+Head": 1}
    decided = EXT.softmax_topk(head.predict(x, now, before, router()), 4, True)
    assert node_counts(decided[0]) == {"Edge0QMV+Head+SoftmaxTopK": 1}
    want_logits = head.predict(x, now, before, apart(router()))
    want = EXT.softmax_topk(apart(want_logits), 4, True)
    assert mx.array_equal(logits, want_logits) and all(mx.array_equal(i, j) for i, j in zip(decided, want))


@needs_ext
@pytest.mark.parametrize("rows,prev,served", [(1, True, False), (1, False, False), (6, True, False), (1, True, True),
                                              (6, False, True)])
def test_a_served_head_is_one_node_with_the_bits_of_features_then_the_head(rows, prev, served):
    """Head.predict on the edge0 kernel (one Edge0Head node: the multi-hot features built inside, the same products
    and MLX's gelu) gives bit for bit what features() then the head's linears give, ids >= E naming no expert
    (a batch row that joined without a previous token); under MLX's kernel it is that composition itself. Served
    (HeadSet.served: the weight matrices bfloat16) it is bit for bit the float32 head of the widened weights."""
    from edge0.model.heads import HeadSet, features

    rng = np.random.default_rng(rows)
    head = random_head(rng)
    if served:
        HeadSet({2: head}, {2: 1}, 4, 512, "").served()
        assert head.fc1.weight.dtype == head.fc2.weight.dtype == head.delta.weight.dtype == mx.bfloat16
        widened = random_head(rng)
        for lin, src in ((widened.fc1, head.fc1), (widened.fc2, head.fc2), (widened.delta, head.delta)):
            lin.weight = src.weight.astype(mx.float32)
            if "bias" in src:
                lin.bias = src.bias
    x = mx.array(rng.standard_normal((rows, 1, 256)).astype(np.float32))
    router = mx.array(rng.standard_normal((rows, 1, 32)).astype(np.float32))
    now = mx.array(rng.choice(32, size=(rows, 1, 4)).astype(np.uint32))
    before = mx.array(rng.choice(33, size=(rows, 1, 4)).astype(np.uint32)) if prev else None  # 32: no expert
    use_kernel("edge0")
    EXT.profile(True)
    EXT.set_profile(True)
    try:
        got = head.predict(x, now, before, router)
        mx.eval(got)
    finally:
        EXT.set_profile(False)
    nodes = EXT.profile(True)
    assert nodes["Edge0Head"][0] == 1 and "Edge0Linear" not in nodes
    want = head(features(x, now, before, 32), router)  # the composition, on Edge0Linear nodes
    assert np.array_equal(np.array(got), np.array(want))
    if served:
        assert np.array_equal(np.array(got), np.array(widened.predict(x, now, before, router)))
    use_kernel("mlx")
    plain = head.predict(x, now, before, router)
    assert rel(plain, np.array(want).astype(np.float64)) < 1e-5


@needs_ext
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_inputs_raise_one_clear_error(name):
    with pytest.raises(ValueError, match=r"^edge0 \w+"):
        mx.eval(BAD_CALLS[name]())


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
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "bailing_moe"])
def test_greedy_decoding_agrees_with_mlx(models, arch):
    """The same prompt and forced tokens: per step, edge0's argmax equals MLX's on >= 90% of 64 steps and
    the log-probabilities are within relative L2 1e-2 (norms, RoPE, attention and products on edge0's kernels)."""
    from edge0.model.load import load_store
    from edge0.pipeline.steps import generate_steps

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
    print(f"{arch}: greedy agreement edge0 vs mlx over {len(want)} steps: {agree:.3f}, worst log-prob rel L2 {worst:.1e}")
    assert len(want) == 64 and agree >= 0.9 and worst < 1e-2


@needs_ext
def test_edge0_decode_graph_has_fewer_nodes(models):
    """`edge0 bench --kernels --kernel-graph STORE`: the fused ops leave a fraction of MLX's graph, and the nodes that
    keep their weights list a fraction of its inputs."""
    from edge0.bench_kernels import graph_nodes

    (mlx_nodes, mlx_inputs), (edge0_nodes, edge0_inputs) = (graph_nodes(str(models("qwen3_moe")), k)
                                                            for k in ("mlx", "edge0"))
    assert any(name.startswith("Edge0GLU") or name == "Edge0MoeBlock" for name in edge0_nodes)
    assert "Edge0GLU" not in mlx_nodes and "Edge0MoeBlock" not in mlx_nodes
    assert sum(edge0_nodes.values()) < 0.4 * sum(mlx_nodes.values())
    assert edge0_inputs < 0.08 * mlx_inputs  # listing their weights too: about 0.15x


@needs_ext
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 5, 48)])
def test_residual_add_and_norm_are_one_node_with_the_bits_of_two(shape):
    """Edge0AddRMSNorm: (x + r, rms_norm(x + r)) equal to MLX's Add and Edge0RMSNorm run apart."""
    key = iter(mx.random.split(mx.random.key(3), 3))
    x, r = (mx.random.normal(shape, key=next(key)) for _ in range(2))
    w = mx.random.normal(shape[-1:], key=next(key))
    mx.eval(x, r, w)
    h, n = EXT.add_rms_norm(x, r, w, 1e-6)
    from edge0.bench_kernels import node_counts

    assert node_counts(n) == {"Edge0AddRMSNorm": 1}
    assert mx.array_equal(h, x + r) and mx.array_equal(n, EXT.rms_norm(x + r, w, 1e-6))
    with pytest.raises(ValueError, match="add_rms_norm: x and r of one shape"):
        EXT.add_rms_norm(x, r[..., :-1], w, 1e-6)


@needs_ext
def test_decoder_stack_fuses_each_residual_add_with_the_next_norm(models):
    """On the edge0 kernel the qwen3_moe decoder stack runs each residual add with the norm after it (the next
    layer's input norm, the final norm) as one node, logits bit for bit those of mlx-lm's own stack on the same
    kernel, prompt and decode; under --kernel mlx mlx-lm's stack runs as it is."""
    from mlx_lm.models import qwen3_moe
    from mlx_lm.models.cache import make_prompt_cache

    from edge0.bench_kernels import node_counts
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
    from edge0.bench_kernels import _attention_us

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
    from edge0.bench_kernels import _embedding_us

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


def _copies(*arrays):
    """New arrays of the same values (a packed copy belongs to the arrays it was made from)."""
    out = [mx.array(np.array(a.astype(mx.float32))).astype(a.dtype) if a.dtype == mx.bfloat16 else mx.array(np.array(a))
           for a in arrays]
    mx.eval(out)
    return out


@needs_ext
@pytest.mark.skipif(EXT is None or "avx512" not in IMPLS, reason="the packed layout is the AVX-512 VNNI path's")
@pytest.mark.parametrize("d,gs", [(128, 32), (256, 64), (384, 128), (1024, 32), (1024, 64)])
@pytest.mark.parametrize("experts", [1, 5])
@pytest.mark.parametrize("bf16", [True, False])
def test_packed_weights_give_the_bits_of_the_row_layout(d, gs, experts, bf16):
    """Weights packed 16 outputs to a vector (a model's dense linears, resident experts) give every output the
    bits the row layout gives it, for any rows (1: a decode step, 8 and 13: a batch's, the 8-row and smaller
    tiles), any experts and threads; set_packed(False) runs the same weights on the row layout."""
    use_kernel("edge0")
    EXT.set_impl("avx512")
    shape = (experts, 48, d) if experts > 1 else (48, d)
    w, s, b = quantized(shape, gs, seed=d + experts)
    if bf16:
        s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    pw, ps, pb = _copies(w, s, b)
    assert not EXT.packed(pw, ps, pb, gs)
    assert EXT.pack(pw, ps, pb, gs) and EXT.packed(pw, ps, pb, gs)
    assert not EXT.packed(w, s, b, gs)  # equal values, other arrays: not theirs
    rng = np.random.default_rng(d)
    for rows in (1, 3, 8, 13):
        x = mx.array(rng.standard_normal((rows, d)).astype(np.float32) * 3)
        idx = mx.array(rng.integers(0, experts, (rows, 2)).astype(np.uint32)) if experts > 1 else None
        for threads in (1, 2):
            EXT.set_num_threads(threads, threads)
            row, packed = EXT.qmv(x, w, s, b, idx, gs), EXT.qmv(x, pw, ps, pb, idx, gs)
            assert mx.array_equal(row, packed), (rows, threads)
        EXT.set_packed(False)
        try:
            assert mx.array_equal(EXT.qmv(x, pw, ps, pb, idx, gs), row)
        finally:
            EXT.set_packed(True)
        if experts == 1:
            want = dequantized(w, s.astype(mx.float32), b.astype(mx.float32), gs) @ np.array(x, np.float64).T
            assert rel(packed, want.T) < TOL["avx512"]


@needs_ext
def test_pack_declines_what_the_layout_cannot_serve():
    """Not 4-bit, outputs not a multiple of 16, rows not a multiple of 128 or longer than the layout pays for:
    no packed copy (False), and the products stay what they were."""
    for shape, gs, bits in [((40, 256), 64, 4), ((32, 192), 64, 4), ((32, 2048), 64, 4), ((32, 256), 64, 8)]:
        w, s, b = quantized(shape, gs, seed=1, bits=bits)
        assert not EXT.pack(w, s, b, gs), (shape, bits)
        assert not EXT.packed(w, s, b, gs)


@needs_ext
@pytest.mark.skipif(EXT is None or "avx512" not in IMPLS, reason="the packed layout is the AVX-512 VNNI path's")
def test_a_freed_weights_packed_copy_serves_no_other_array():
    """A packed copy is found by its weight's address, but only while the arrays it was made from live: arrays
    made after they are freed (which the allocator may place at the same address) are never served the old copy."""
    use_kernel("edge0")

    def address(a) -> int:
        return np.array(a, copy=False).__array_interface__["data"][0]  # a view of the array's own buffer

    mx.clear_cache()  # no buffer freed by earlier tests for the allocator to hand out before this one's
    x = mx.array(np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32))
    w, s, b = quantized((64, 256), 64, seed=7)
    mx.eval(w, s, b)
    assert EXT.pack(w, s, b, 64)
    freed = address(w)
    del w, s, b
    reused = 0
    for seed in range(20):
        w, s, b = quantized((64, 256), 64, seed=100 + seed)
        mx.eval(w, s, b)
        reused += address(w) == freed
        assert not EXT.packed(w, s, b, 64)
        want = dequantized(w, s, b, 64) @ np.array(x[0], np.float64)
        assert rel(EXT.qmv(x, w, s, b, None, 64)[0], want) < TOL["avx512"]
    assert reused  # MLX's allocator gave a new weight the freed one's buffer: the case this test is about


@needs_ext
def test_pack_and_packed_answer_false_for_what_is_not_a_4bit_weight():
    """pack and packed take any arrays: what is not a 4-bit weight with its scales and biases is no copy (False),
    never an error from inside the extension."""
    w, s, b = quantized((32, 256), 64, seed=2)
    for args in [(w.reshape(-1), s, b, 64), (w, s.reshape(-1), b, 64), (w, s, b[:, :2], 64), (w, s, b, 0),
                 (w, s, b, 32), (w.astype(mx.int32), s, b, 64), (w, s.astype(mx.float16), b.astype(mx.float16), 64),
                 (w[None], s, b, 64), (w, s.T, b.T, 64)]:
        assert EXT.pack(*args) is False and EXT.packed(*args) is False
