"""Edge0's CPU kernels (csrc/): the quantized products against a float64 dequantized reference, element-wise
ops against MLX's bits, and the packed weight layout. Extension tests skip when it is not built.
Shapes: T tokens, K routed, E experts, D inputs, N outputs."""

import os
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from edge0.compute import kernels, qmm
from tests.compute.kernel_refs import (  # restore: the settings put back after each test (autouse)
    EXT, needs_ext, IMPLS, TOL, VNNI, every_isa, quantized, dequantized, rel, restore)
from tests.helpers import use_kernel


GATHER = [  # (D, N, E, K, T, gs)
    (128, 64, 3, 1, 1, 64), (128, 96, 5, 3, 2, 32), (640, 200, 7, 5, 1, 128), (1024, 768, 12, 8, 1, 64),
    (2048, 512, 9, 3, 3, 32), (4096, 256, 6, 7, 1, 128), (384, 130, 10, 4, 2, 64), (256, 64, 33, 5, 4, 128),
    (192, 80, 5, 2, 1, 32), (320, 72, 6, 3, 2, 64), (1088, 64, 4, 2, 1, 32)]  # D % 128 == 64: the AVX-512 tail


@needs_ext
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,n,e,k,t,gs", GATHER)
def test_gather_matches_reference(impl, d, n, e, k, t, gs):
    kernels.set_isa(impl)
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
    kernels.set_isa(impl)
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
    kernels.set_isa(impl)
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
@pytest.mark.usefixtures("every_isa")
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
@pytest.mark.usefixtures("every_isa")
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
@pytest.mark.usefixtures("every_isa")
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
    kernels.set_isa(impl)
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
    kernels.set_isa(impl)
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
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("d", [256, 384])
@pytest.mark.parametrize("bf16", [True, False])
def test_rows_sharing_an_expert_get_the_bits_of_each_row_alone(impl, gs, d, bf16):
    """A prompt chunk's (or a batch's) rows that share an expert are multiplied together, each weight row loaded
    once for several of them (the row tile); every output keeps the bits of its row multiplied alone, so prefill,
    batched decode and a sequence decoding alone agree. 19 rows, 2 experts each out of 4: runs of several rows."""
    use_kernel("edge0")
    kernels.set_isa(impl)
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
    kernels.set_isa(impl)
    w, s, b = quantized((8, d), gs, seed=3)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    x = mx.array(np.random.default_rng(9).standard_normal((1, d)).astype(np.float32) * 4)
    four = EXT.qmv(x, w, s, b, None, gs)
    one = mx.concatenate([EXT.qmv(x, w[n:n + 1], s[n:n + 1], b[n:n + 1], None, gs) for n in range(8)], axis=-1)
    assert mx.array_equal(four, one)
    rows = mx.concatenate([x, -x, 2 * x, x + 1])  # four rows sharing the weights: the row tile
    assert mx.array_equal(EXT.qmv(rows, w, s, b, None, gs)[0], four[0])


def _copies(*arrays):
    """New arrays of the same values (a packed copy belongs to the arrays it was made from)."""
    out = [mx.array(np.array(a.astype(mx.float32))).astype(a.dtype) if a.dtype == mx.bfloat16 else mx.array(np.array(a))
           for a in arrays]
    mx.eval(out)
    return out


@needs_ext
@pytest.mark.skipif(not VNNI, reason="the packed layout is the AVX-512 VNNI path's")
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


def _mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping that holds `address` (its fields, as text)."""
    entry, found = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            if found:
                break
            lo, hi = (int(x, 16) for x in head.split("-"))
            found, entry = lo <= address < hi, {}
        elif found:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return entry


def _thp() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


PACKED_SMAPS = [needs_ext,  # tests that read a packed copy's mapping
                pytest.mark.skipif(not VNNI, reason="the packed layout is the VNNI path's"),
                pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the copy's mapping")]


def _marked(test):
    for mark in reversed(PACKED_SMAPS):
        test = mark(test)
    return test


@_marked
@pytest.mark.skipif(_thp() == "never", reason="no transparent huge pages here (Linux, THP madvise or always)")
def test_large_packed_copies_lie_on_huge_pages():
    """A packed copy of 2 MiB or more starts on a 2 MiB page and is advised onto transparent huge pages (csrc/qmv.h
    LineAligned): products stream an expert's rows through one TLB entry a 2 MiB page instead of 512. A small copy
    starts on a 64-byte line."""
    use_kernel("edge0")
    w, s, b = _copies(*quantized((8, 4096, 256), 64, seed=3))  # the copy's words: 4 MiB
    assert EXT.pack(w, s, b, 64)
    at = EXT.packed_address(w, s, b, 64)
    assert at % (2 << 20) == 0
    mapping = _mapping_of(at)
    assert mapping.get("THPeligible") == "1"  # under THP madvise: only advised memory is
    assert int(mapping["AnonHugePages"].split()[0]) >= 4096  # its whole 2 MiB pages (all there was room for)
    small = _copies(*quantized((48, 256), 64, seed=4))
    assert EXT.pack(*small, 64) and EXT.packed_address(*small, 64) % 64 == 0
    assert EXT.packed_address(*_copies(*small), 64) == 0  # equal values, other arrays: no copy of theirs


def _zero_bank(experts: int, n: int, d: int, gs: int):
    """A new slot bank's arrays of 4-bit weights: zeros, in MLX's memory."""
    w = mx.array(np.zeros((experts, n, d // 8), np.uint32))
    s, b = (mx.array(np.zeros((experts, n, d // gs), np.float32)) for _ in range(2))
    mx.eval(w, s, b)
    return w, s, b


def _rss_kb(address: int) -> int:
    return int(_mapping_of(address)["Rss"].split()[0])


def _fill_and_compare(bank, gs: int, expert: int, other: int):
    """A fill of `expert` (its rows written as a read lands, then repacked): products of it and of `other` (never
    filled) equal the row layout's, and `other`'s are zeros."""
    w, s, b = bank
    n, d = w.shape[1], w.shape[2] * 8
    for dst, src in zip(bank, quantized((n, d), gs, seed=11)):
        row = np.array(src).view(np.uint8).ravel()
        memoryview(dst).cast("B")[expert * row.size:(expert + 1) * row.size] = row.tobytes()
    assert EXT.repack(w, s, b, gs, [expert])
    x = mx.array(np.random.default_rng(2).standard_normal((1, d)).astype(np.float32))
    idx = mx.array(np.array([[expert, other]], np.uint32))
    packed = EXT.qmv(x, w, s, b, idx, gs)
    EXT.set_packed(False)
    try:
        assert mx.array_equal(packed, EXT.qmv(x, w, s, b, idx, gs))
    finally:
        EXT.set_packed(True)
    out = np.array(packed).reshape(2, n)
    assert out[0].any() and not out[1].any()


@_marked
def test_a_new_banks_packed_copy_has_its_pages_before_its_first_fill():
    """A new slot bank's packed copy (all zeros) has its pages mapped in when made: pages first touched inside fills
    made the workload's native streamed decode 0.92x slower (tools/pipeline_ab.py, 10 rounds from the disk). Its
    products are the row layout's: the filled expert's, and zeros for the others."""
    use_kernel("edge0")
    bank = _zero_bank(8, 4096, 256, 64)  # the copy's words: 4 MiB
    assert EXT.pack(*bank, 64, zeros=True)
    assert _rss_kb(EXT.packed_address(*bank, 64)) >= 4096
    _fill_and_compare(bank, 64, 3, 5)


@_marked
def test_a_reserved_packed_copy_is_made_ahead_and_taken_by_its_bank():
    """reserve_pack makes a new bank's zero copy on a thread of its own (while the prompt computes: mapping in its
    pages at the bank's first use held up the prompt's last token); the bank's pack takes it where its shape is the
    bank's, once, and leaves one of another shape alone."""
    use_kernel("edge0")
    reserved, other = EXT.reserve_pack(8, 4096, 256, 64, False), EXT.reserve_pack(8, 2048, 256, 64, False)
    made, other_made = reserved.address(), other.address()
    assert made % (2 << 20) == 0 and _rss_kb(made) >= 4096  # mapped in already, on a 2 MiB boundary
    bank = _zero_bank(8, 4096, 256, 64)
    assert EXT.pack(*bank, 64, zeros=True, reserved=other)
    assert EXT.packed_address(*bank, 64) != other_made and other.address() == other_made  # not its shape: not taken
    again = _zero_bank(8, 4096, 256, 64)
    assert EXT.pack(*again, 64, zeros=True, reserved=reserved)
    assert EXT.packed_address(*again, 64) == made and reserved.address() == 0  # taken, once
    _fill_and_compare(again, 64, 6, 1)
    assert EXT.reserve_pack(8, 40, 256, 64, False) is None  # outputs not a multiple of 16: no packed layout


@_marked
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the copies are made at SCHED_IDLE on Linux only")
def test_a_bank_waiting_for_its_reserved_copy_gets_it_on_a_busy_machine():
    """A reserved copy is made at idle priority (the prompt's compute goes first), but a bank whose first use finds it
    unmade puts its thread back at normal priority: with every core busy, an idle thread waits for them (without the
    boost this test failed its 5 s bound)."""
    use_kernel("edge0")
    bank = _zero_bank(64, 4096, 256, 64)  # 40 MiB of copy to map in
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        time.sleep(0.5)  # they hold every core
        t0 = time.perf_counter()
        reserved = EXT.reserve_pack(64, 4096, 256, 64, False)
        assert EXT.pack(*bank, 64, zeros=True, reserved=reserved)
        took = time.perf_counter() - t0
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert reserved.address() == 0 and EXT.packed_address(*bank, 64)  # the reserved copy, taken
    assert took < 5, took


@needs_ext
def test_pack_declines_what_the_layout_cannot_serve():
    """Not 4-bit, outputs not a multiple of 16, rows not a multiple of 128 or longer than the layout pays for:
    no packed copy (False), and the products stay what they were."""
    for shape, gs, bits in [((40, 256), 64, 4), ((32, 192), 64, 4), ((32, 2048), 64, 4), ((32, 256), 64, 8)]:
        w, s, b = quantized(shape, gs, seed=1, bits=bits)
        assert not EXT.pack(w, s, b, gs), (shape, bits)
        assert not EXT.packed(w, s, b, gs)


@needs_ext
@pytest.mark.skipif(not VNNI, reason="the packed layout is the AVX-512 VNNI path's")
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

