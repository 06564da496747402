"""A decode token's attention as three nodes on the edge0 kernel (Edge0KVWrite for k and v, Edge0DecodeAttention),
for one sequence and for a left-padded batch: the bits of mlx-lm's own attention code on the same kernel, its
numbers on MLX's, the KV cache written in place unless something else holds it."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen3_moe
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from edge0.bench.kernels import node_counts
from edge0.compute import dense, kernels
from edge0.compute.qmm import use_kernel_products
from tests.compute.kernel_refs import every_isa  # noqa: F401 (a fixture: each code path the build runs)
from tests.helpers import use_kernel

EXT = kernels.load()
pytestmark = pytest.mark.skipif(EXT is None, reason=f"edge0 CPU kernels {kernels.reason()}")


def attention_module(seed: int = 0, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    """A Qwen3-MoE attention module with float32 weights (norm weights away from 1, so the norms matter)."""
    args = qwen3_moe.ModelArgs(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
                               num_attention_heads=heads, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                               mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=32,
                               num_key_value_heads=kv_heads, head_dim=16, rope_theta=10000.0,
                               tie_word_embeddings=False, max_position_embeddings=4096, norm_topk_prob=True)
    mx.random.seed(seed)
    attn = qwen3_moe.Attention(args, 0)
    attn.q_norm.weight = 1 + 0.5 * mx.random.normal((16,))
    attn.k_norm.weight = 1 + 0.5 * mx.random.normal((16,))
    dense.use_kernel_ops(attn)
    return attn


def decode(attn, steps: int, prompt: int, fused: bool, seed: int = 1):
    """Outputs of `steps` one-token calls after a `prompt`-token one, and the cache; mlx-lm's own code unless fused."""
    call = type(attn).__call__ if fused else qwen3_moe.Attention.__call__
    key = iter(mx.random.split(mx.random.key(seed), steps + 1))
    cache = KVCache()
    x = mx.random.normal((1, prompt, 64), key=next(key))
    mx.eval(call(attn, x, "causal" if prompt > 1 else None, cache))
    outs = []
    for _ in range(steps):
        outs.append(call(attn, mx.random.normal((1, 1, 64), key=next(key)), None, cache))
        mx.eval(outs[-1], cache.keys, cache.values)
    return np.concatenate([np.array(o) for o in outs]), cache


@pytest.mark.usefixtures("every_isa")
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_the_three_nodes_give_the_bits_of_mlx_lm_code_on_the_same_kernel(heads, kv_heads):
    """Across the cache's growth at 256 rows (that step runs mlx-lm's code, the next ones the nodes again): every
    output and every cache row equals mlx-lm's attention code run on the edge0 kernel's separate nodes, bit for bit."""
    use_kernel("edge0")
    attn = attention_module(heads=heads, kv_heads=kv_heads)
    got, c1 = decode(attn, 12, 250, fused=True)
    want, c2 = decode(attn, 12, 250, fused=False)
    assert c1.offset == c2.offset == 262 and c1.keys.shape == c2.keys.shape
    assert np.array_equal(got, want)
    for a, b in ((c1.keys, c2.keys), (c1.values, c2.values)):
        assert np.array_equal(np.array(a[..., :262, :]), np.array(b[..., :262, :]))


@pytest.mark.usefixtures("every_isa")
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1)])
def test_a_left_padded_batch_gets_the_bits_of_mlx_lm_code_on_the_same_kernel(heads, kv_heads):
    """Three sequences in mlx-lm's BatchKVCache, left-padded by 0, 3 and 1, across the cache's growth: each step's
    outputs and every cache row equal mlx-lm's code on the edge0 kernel's separate nodes (each sequence rotated at
    its own position, attending from its own first key), bit for bit; the cache's offsets advance as mlx-lm's."""
    use_kernel("edge0")
    attn = attention_module(heads=heads, kv_heads=kv_heads)
    runs = []
    for fused in (True, False):
        call = type(attn).__call__ if fused else qwen3_moe.Attention.__call__
        key = iter(mx.random.split(mx.random.key(5), 13))
        cache = BatchKVCache([0, 3, 1])
        x = mx.random.normal((3, 250, 64), key=next(key))
        mx.eval(call(attn, x, create_attention_mask(x, cache), cache))
        outs = []
        for _ in range(12):
            x = mx.random.normal((3, 1, 64), key=next(key))
            outs.append(call(attn, x, create_attention_mask(x, cache), cache))
            mx.eval(outs[-1], cache.keys, cache.values, cache.offset)
        runs.append((np.concatenate([np.array(o) for o in outs]), cache))
    (got, c1), (want, c2) = runs
    assert c1._idx == c2._idx == 262 and c1.offset.tolist() == c2.offset.tolist() == [262, 259, 261]
    assert np.array_equal(got, want)
    for a, b in ((c1.keys, c2.keys), (c1.values, c2.values)):
        assert np.array_equal(np.array(a[..., :262, :]), np.array(b[..., :262, :]))


@pytest.mark.usefixtures("every_isa")
def test_the_nodes_match_mlx_kernels():
    """Against mlx-lm's attention on MLX's own kernels (mx.fast norms, RoPE, attention): float32 rounding apart."""
    use_kernel("edge0")
    attn = attention_module()
    got, _ = decode(attn, 6, 9, fused=True)
    use_kernel("mlx")
    want, _ = decode(attn, 6, 9, fused=False)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def served_module(lora: bool) -> nn.Module:
    """attention_module quantized as a store serves it (one Edge0QMV node per projection), with a recovery adapter on
    each projection (Edge0QMVLoRA nodes) when `lora`."""
    from edge0.model.lora import LoRALinear

    attn = attention_module()
    nn.quantize(attn, group_size=32)
    use_kernel_products(attn)
    if lora:
        for i, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
            base = getattr(attn, name)
            n, d = base.weight.shape[0], base.weight.shape[1] * 8
            key = iter(mx.random.split(mx.random.key(10 + i), 2))
            setattr(attn, name, LoRALinear(base, 0.1 * mx.random.normal((d, 4), key=next(key)),
                                           0.1 * mx.random.normal((4, n), key=next(key)), 2.0))
    return attn


@pytest.mark.parametrize("lora", [False, True])
def test_a_decode_step_is_three_nodes_and_no_slice_update(lora):
    """The q, k and v projections run inside the attention and the KV writes, o_proj inside the attention after it
    (absorbed: one node fewer each): the layer's whole attention in three nodes."""
    use_kernel("edge0")
    attn = served_module(lora)
    cache = KVCache()
    mx.eval(attn(mx.random.normal((1, 3, 64)), "causal", cache))
    x = mx.random.normal((1, 1, 64))
    mx.eval(x)
    nodes = node_counts(attn(x, None, cache))
    assert nodes == {"Edge0KVWrite": 2, "Edge0DecodeAttention": 1}


@pytest.mark.usefixtures("every_isa")
@pytest.mark.parametrize("lora", [False, True])
def test_absorbed_projections_give_the_bits_of_their_own_nodes(lora):
    """Served projections (quantized, with and without an adapter) run inside the KV writes and the attention (o_proj
    after it): every output and cache row equals mlx-lm's attention code on the same kernel, where each projection
    is its own node; a projection or an attention already evaluated is taken as it is."""
    use_kernel("edge0")
    attn = served_module(lora)
    got, c1 = decode(attn, 6, 20, fused=True)
    want, c2 = decode(attn, 6, 20, fused=False)
    assert np.array_equal(got, want)
    assert np.array_equal(np.array(c1.keys[..., :26, :]), np.array(c2.keys[..., :26, :]))
    assert np.array_equal(np.array(c1.values[..., :26, :]), np.array(c2.values[..., :26, :]))
    x = mx.random.normal((1, 1, 64))
    mx.eval(x)
    q = attn.q_proj(x)
    mx.eval(q)
    args = (attn.q_norm.weight, c1.keys, c1.values, 25, 1e-6, 16, False, 10000.0, 1.0, 0.25, None, None)
    apart = EXT.decode_attention(q, *args)  # q evaluated: nothing to absorb
    inside = EXT.decode_attention(attn.q_proj(x), *args)
    assert node_counts(apart) == node_counts(inside) == {"Edge0DecodeAttention": 1}
    assert np.array_equal(np.array(apart), np.array(inside))
    assert node_counts(attn.o_proj(apart)) == {"Edge0QMVLoRA" if lora else "Edge0QMV": 1}  # evaluated: its own node
    projected = attn.o_proj(EXT.decode_attention(q, *args))
    assert node_counts(projected) == {"Edge0DecodeAttention": 1}
    assert np.array_equal(np.array(projected), np.array(attn.o_proj(apart)))


def test_the_cache_is_written_in_place_unless_held():
    """A buffer only the cache holds passes to the next step's output (no copy); one held elsewhere (a snapshot of
    the cache, say) is copied first and keeps its rows."""
    use_kernel("edge0")
    attn = attention_module()
    cache = KVCache()
    mx.eval(attn(mx.random.normal((1, 4, 64)), "causal", cache), cache.keys, cache.values)
    before = EXT.kv_copies()
    for _ in range(3):
        mx.eval(attn(mx.random.normal((1, 1, 64)), None, cache), cache.keys, cache.values)
    assert EXT.kv_copies() == before
    held = cache.keys
    rows = np.array(held)
    mx.eval(attn(mx.random.normal((1, 1, 64)), None, cache), cache.keys, cache.values)
    assert EXT.kv_copies() == before + 1  # the keys; the values were the cache's alone
    assert np.array_equal(np.array(held), rows)
    assert not np.array_equal(np.array(cache.keys[..., 7, :]), rows[..., 7, :])  # the new row went to the copy



def test_a_view_of_a_cache_is_copied_whole_and_right():
    """A batch's caches become views when a sequence leaves (BatchKVCache.filter trims the left padding: keys[..., a:,
    :]) or rows are taken: the write copies the view into fresh storage by contiguous runs. Every kind of view (a
    trimmed front, rows taken with a step, a transpose, a broadcast, unit axes of odd strides) gives the bits of the
    same values made contiguous first, the new row in place."""
    key = iter(mx.random.split(mx.random.key(5), 9))
    buf = mx.random.normal((3, 2, 40, 16), key=next(key))
    views = [buf[..., 7:, :], buf[..., 3:30, :], buf[::2], buf[1:2, :, 5:], buf[:, ::-1], buf.transpose(0, 1, 3, 2),
             mx.broadcast_to(buf[:1, :1], (3, 2, 40, 16)), buf[:, :1][:, :, 2:][..., ::2]]
    for view in views:
        x = mx.random.normal((view.shape[0], 1, view.shape[1] * view.shape[3]), key=next(key))
        before = EXT.kv_copies()
        got = EXT.kv_write(x, None, view, 2)
        want = EXT.kv_write(x, None, mx.contiguous(view) + 0, 2)
        mx.eval(got, want)
        assert EXT.kv_copies() == before + 1, view.shape  # the view was copied; its contiguous twin written in place
        assert np.array_equal(np.array(got), np.array(want)), view.shape
        rows = np.array(view).copy()
        rows[:, :, 2, :] = np.array(x).reshape(view.shape[0], view.shape[1], view.shape[3])
        assert np.array_equal(np.array(got), rows), view.shape

def test_other_caches_and_prompts_take_mlx_lm_code():
    """A prompt, a batch of two in a single sequence's cache, a cache that must grow, and MLX's kernel: no edge0
    attention node."""
    use_kernel("edge0")
    attn = attention_module()
    cache = KVCache()
    assert dense.decode_attention(attn, mx.zeros((1, 1, 64)), None, cache) is None  # empty: must grow first
    mx.eval(attn(mx.random.normal((1, 3, 64)), "causal", cache))
    assert dense.decode_attention(attn, mx.zeros((1, 2, 64)), None, cache) is None
    assert dense.decode_attention(attn, mx.zeros((2, 1, 64)), None, cache) is None
    use_kernel("mlx")
    assert dense.decode_attention(attn, mx.zeros((1, 1, 64)), None, cache) is None


@pytest.mark.parametrize("call", [
    lambda: EXT.kv_write(mx.zeros((1, 1, 32)), None, mx.zeros((1, 2, 8, 16)), 8),  # row past the buffer
    lambda: EXT.kv_write(mx.zeros((1, 1, 48)), None, mx.zeros((1, 2, 8, 16)), 0),  # 3 heads for a 2-head buffer
    lambda: EXT.kv_write(mx.zeros((1, 1, 32)), mx.ones((8,)), mx.zeros((1, 2, 8, 16)), 0),  # norm of another width
    lambda: EXT.kv_write(mx.zeros((1, 1, 32)), None, mx.zeros((1, 2, 8, 16)), 0, 1e-6, 5),  # odd rope dims
    lambda: EXT.decode_attention(mx.zeros((1, 1, 48)), None, mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 8, 16)), 0,
                                 1e-6, 16, False, 1e4, 1.0, 0.25),  # 3 query heads over 2 KV heads
    lambda: EXT.decode_attention(mx.zeros((1, 1, 64)), None, mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 9, 16)), 0,
                                 1e-6, 16, False, 1e4, 1.0, 0.25),  # keys and values of two shapes
])
def test_bad_inputs_raise_one_clear_error(call):
    with pytest.raises(ValueError, match="edge0 (kv_write|decode_attention)"):
        call()


def test_overlapped_decode_of_the_built_in_model_writes_its_cache_in_place():
    """Resident decode builds step n+1 while step n computes: each layer's KV write still finds its buffer held by
    nothing else (no copy of the cache per step), and the tokens are those of mlx-lm's attention code on the same
    kernel."""
    from mlx_lm.sample_utils import make_sampler

    from edge0.model.demo import DEMO_PROMPT, DEMO_STORE
    from edge0.model.load import load_store
    from edge0.decode.loop import generate_steps
    from edge0.decode.step import overlaps

    kernel = use_kernel("edge0")
    runs = []
    for fused in (True, False):
        with kernel.active():
            store = load_store(DEMO_STORE, executor="resident")
            if not fused:
                for _, m in store.model.named_modules():
                    if type(m) is dense.KernelQwen3Attention:
                        m.__class__ = qwen3_moe.Attention  # its norms and RoPE stay on the kernel
            prompt = store.tokenizer.encode(DEMO_PROMPT)
            before = EXT.kv_copies()
            EXT.profile(True)
            EXT.set_profile(True)
            runs.append([t for t, _ in generate_steps(store.model, prompt, max_tokens=40, sampler=make_sampler(0.0),
                                                      runtime=store.runtime)])
            EXT.set_profile(False)
            profile = EXT.profile(True)
            copies = EXT.kv_copies() - before
            writes = sum(profile.get(name, (0, 0))[0] for name in ("Edge0KVWrite", "Edge0AttentionBlock"))
            assert overlaps(store.runtime, [KVCache()])
            store.close()
        assert (writes > 0) == fused
        if fused:
            assert copies == 0
    assert runs[0] == runs[1]
