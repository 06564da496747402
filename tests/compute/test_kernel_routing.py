"""Edge0's CPU kernels for routing: softmax-top-k, candidates, the combine, the heads' linear and the heads as
one node, against MLX and numpy; bad calls raise one clear error. Extension tests skip when it is not built."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.compute.kernel_refs import (  # restore: the settings put back after each test (autouse); every_isa: on
    EXT, needs_ext, quantized, rel, restore, every_isa)  # each code path the build runs
from tests.helpers import use_kernel


@pytest.mark.usefixtures("every_isa")
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


@pytest.mark.usefixtures("every_isa")
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


@pytest.mark.usefixtures("every_isa")
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


@pytest.mark.usefixtures("every_isa")
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


def dot16_reference(x: np.ndarray, w: np.ndarray, fused: bool = True) -> np.ndarray:
    """x @ w.T in dot16's order, in numpy: 16 float32 lanes (i mod 16), each a chain of fused multiply-adds over i (the
    product exact in float64, one rounding to float32; not fused: the product rounded too), then the lanes in the
    tree lane j += lane j + k, k = 8, 4, 2, 1."""
    rows, d = x.shape
    lanes = np.zeros((rows, w.shape[0], 16), np.float32)
    for i in range(d):
        prod = x[:, None, i].astype(np.float64) * w[None, :, i].astype(np.float64)
        prod = prod if fused else prod.astype(np.float32).astype(np.float64)
        lanes[:, :, i % 16] = (lanes[:, :, i % 16].astype(np.float64) + prod).astype(np.float32)
    for k in (8, 4, 2, 1):
        lanes[:, :, :k] = lanes[:, :, :k] + lanes[:, :, k:2 * k]
    return lanes[:, :, 0]


@pytest.mark.usefixtures("every_isa")
@needs_ext
@pytest.mark.parametrize("rows,d", [(1, 320), (4, 320), (1, 512), (4, 17)])
def test_linear_sums_in_dot16s_order(rows, d, every_isa):
    """The heads' float linear, every path (one row 16 outputs at a time, four rows at a time, a tail past the last
    16 inputs), gives the bits of dot16's order computed apart in numpy: a lane tree in another association fails.
    The SIMD builds fuse each multiply-add; the plain C++ one cannot on x86 without FMA (elsewhere it may)."""
    fused = (True, False) if every_isa == "portable" else (True,)
    rng = np.random.default_rng(d + rows)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    w = (rng.standard_normal((32, d)) * 0.05).astype(np.float32)
    for wt in (mx.float32, mx.bfloat16):
        wm = mx.array(w).astype(wt)
        got = np.array(EXT.linear(mx.array(x)[:, None, :], wm, None))[:, 0, :]
        assert any(np.array_equal(got, dot16_reference(x, np.array(wm.astype(mx.float32)), f)) for f in fused), wt


@pytest.mark.usefixtures("every_isa")
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
    from edge0.bench.kernels import node_counts

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


@pytest.mark.usefixtures("every_isa")
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
