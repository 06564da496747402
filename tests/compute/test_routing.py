"""Edge0's MoE blocks against mlx-lm's own blocks: routing and combination bit for bit."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import bailing_moe, qwen3_5, qwen3_moe, qwen3_next

from edge0.compute.experts import Quant, ResidentExperts, bank_of
from edge0.compute.routing import sigmoid_group_topk, softmax_topk
from edge0.model.blocks import make_block

D, H, E = 128, 64, 16


def qwen3_moe_block(k):
    args = qwen3_moe.ModelArgs(model_type="qwen3_moe", hidden_size=D, num_hidden_layers=1, intermediate_size=256,
                               num_attention_heads=2, num_experts=E, num_experts_per_tok=k, decoder_sparse_step=1,
                               mlp_only_layers=[], moe_intermediate_size=H, rms_norm_eps=1e-6, vocab_size=64,
                               num_key_value_heads=1, head_dim=64, rope_theta=1e4, tie_word_embeddings=False,
                               max_position_embeddings=512, norm_topk_prob=True)
    return qwen3_moe.Qwen3MoeSparseMoeBlock(args)


def qwen3_5_block(k):
    args = qwen3_5.TextModelArgs(model_type="qwen3_5_moe_text", hidden_size=D, num_experts=E, num_experts_per_tok=k,
                                 moe_intermediate_size=H, shared_expert_intermediate_size=H, norm_topk_prob=True)
    return qwen3_next.Qwen3NextSparseMoeBlock(args)


def bailing_block(k):
    args = bailing_moe.ModelArgs(model_type="bailing_moe", hidden_size=D, intermediate_size=256,
                                 max_position_embeddings=512, moe_intermediate_size=H, num_experts=E,
                                 num_shared_experts=1, norm_topk_prob=True, num_attention_heads=2,
                                 num_experts_per_tok=k, num_hidden_layers=1, num_key_value_heads=1, rms_norm_eps=1e-6,
                                 rope_theta=1e4, vocab_size=64, first_k_dense_replace=0, score_function="sigmoid",
                                 n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                 moe_router_enable_expert_bias=True)
    block = bailing_moe.BailingMoeSparseMoeBlock(args)
    block.gate.expert_bias = mx.random.normal((E,)) * 0.05
    return block


BLOCKS = {"qwen3_moe": qwen3_moe_block, "qwen3_5_moe": qwen3_5_block, "bailing_moe": bailing_block}


def quantized(block, dtype):
    """Quantize like mlx-lm's convert (experts 4-bit, router 8-bit) and cast floats to dtype."""
    block.set_dtype(dtype)
    nn.quantize(block, group_size=64, bits=4,
                class_predicate=lambda p, m: {"group_size": 64, "bits": 8} if p.endswith("gate") or p.endswith("gate_proj") and "switch" not in p else hasattr(m, "to_quantized"))
    mx.eval(block.parameters())
    return block


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])  # 40 tokens x K >= 64 takes the sorted gather
@pytest.mark.parametrize("arch", list(BLOCKS))
def test_block_matches_mlx_lm_bitwise(arch, tokens, dtype):
    mx.random.seed(7)
    k = 4 if arch == "bailing_moe" else 2
    block = quantized(BLOCKS[arch](k), dtype)
    x = (mx.random.normal((1, tokens, D)) * 2).astype(dtype)
    captured = []
    original = block.switch_mlp

    class Capture(nn.Module):
        def __call__(self, h, inds):
            captured.append(inds)
            return original(h, inds)

    want = block(x)
    block.switch_mlp = Capture()
    block(x)
    block.switch_mlp = original
    edge0 = make_block(arch, block, ResidentExperts(bank_of(original), Quant(4, 64, "affine")))
    inds, _ = edge0.route(x)
    got = edge0(x)
    mx.eval(want, got, inds, captured[0])
    assert np.array_equal(np.array(inds), np.array(captured[0]))
    assert got.dtype == want.dtype
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_routing_selects_what_it_should():
    # A hand-made case: softmax top-2 of known logits, renormalised.
    logits = mx.array([[0.0, 3.0, 1.0, 2.0]])
    inds, scores = softmax_topk(logits, 2, True)
    assert sorted(np.array(inds)[0].tolist()) == [1, 3]
    p = np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum()
    order = np.argsort(np.array(inds)[0])
    np.testing.assert_allclose(np.array(scores)[0][order], [p[0], p[1]], rtol=1e-6)
    # Group-limited: the best single expert sits in a group whose top-2 sum loses, so it is never chosen.
    logits = mx.array([[5.0, -9.0, 1.0, 1.0, 0.5, 0.5, -9.0, -9.0]])
    inds, scores = sigmoid_group_topk(logits, None, 2, 4, 1, 2.5, True, "sigmoid")
    assert sorted(np.array(inds)[0].tolist()) == [2, 3]
    np.testing.assert_allclose(np.array(scores).sum(), 2.5, rtol=1e-6)
