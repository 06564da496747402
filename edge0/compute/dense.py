"""The per-token dense ops of a decoder layer (RMS norm, rotary embedding, attention; the prerouter heads'
float linears) on Edge0's CPU kernels when the `edge0` kernel is in use.

On the CPU, MLX runs its fast ops (mx.fast.rms_norm, rope, scaled_dot_product_attention) as their
composed fallbacks: 10-20 graph nodes each, at a few microseconds of dispatch per node, about a third
of a decode step on a small model, and prefill attention on the wheel's reference BLAS. The extension
runs each as one node, with the same math in float32. Anything it does not cover (other dtypes, an
array offset, mask arrays, attention sinks, a quantized KV cache) runs on MLX's ops, as it does under
`--kernel mlx`.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base, qwen3_moe
from mlx_lm.models.cache import BatchKVCache, KVCache

from .kernel_choice import current, remembered
from .qmm import KernelQuantizedLinear, fits, swap_classes

_mlx_attention = base.scaled_dot_product_attention  # mlx-lm's own, for everything else


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    ext = current().ext
    if ext is not None and x.dtype == mx.float32 and weight.dtype == mx.float32 and weight.ndim == 1:
        return ext.rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


def log_softmax(logits: mx.array) -> mx.array:
    """logits - logsumexp(logits) over the last axis: the log-probabilities a step samples from and returns. One node
    on the edge0 kernel with MLX's bits, where MLX runs a LogSumExp (its exp one float at a time on Linux) and a
    Subtract; not differentiable there (training builds its own)."""
    ext = current().ext
    if ext is not None and logits.dtype == mx.float32:
        return ext.log_softmax(logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def step_log_softmax(logits: mx.array) -> tuple[mx.array, mx.array]:
    """A decode step's log-probabilities from its logits (B, L, V): those of the last position (B, V), and of the
    first row's as (V,). One node on the edge0 kernel for one new token a row (it runs the LM head's product too,
    where MLX adds a slice, a squeeze and the product's node), log_softmax's bits."""
    ext = current().ext
    if ext is not None and logits.dtype == mx.float32 and logits.ndim == 3 and logits.shape[1] == 1:
        lp, first = ext.step_log_softmax(logits)
        return lp, first
    lp = log_softmax(logits[:, -1, :])
    return lp, lp[0]


def linear(x: mx.array, layer: nn.Linear) -> mx.array:
    """layer(x) for a float nn.Linear; on the edge0 kernel one node whose every output is one fixed-order sum, so
    a batch's rows equal the same rows run alone (MLX's matmul may round a batch otherwise, per BLAS)."""
    ext = current().ext
    w, b = layer["weight"], layer.get("bias")
    if (ext is not None and x.dtype == mx.float32 and w.dtype in (mx.float32, mx.bfloat16)
            and (b is None or b.dtype == mx.float32)):
        return ext.linear(x, w, b)  # bfloat16 weights (a served head's) widened exactly
    return layer(x)


def rope(x: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float, offset) -> mx.array:
    """mx.fast.rope; offset an int, or (B,) ints, one per sequence of a batch (mlx-lm's BatchKVCache.offset)."""
    ext = current().ext
    if (ext is not None and x.dtype == mx.float32 and x.ndim == 4 and base is not None and dims % 2 == 0
            and dims <= x.shape[-1]):
        if isinstance(offset, int):
            return ext.rope(x, dims, traditional, float(base), float(scale), offset)
        if isinstance(offset, mx.array) and offset.shape == (x.shape[0],) and offset.dtype == mx.int32:
            return ext.rope(x, dims, traditional, float(base), float(scale), 0, offset)
    return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's models.base.scaled_dot_product_attention in one node, without mask or causal."""
    if _left_padded_decode(queries, cache, mask):
        return _per_row_attention(queries, keys, values, cache, scale, sinks)
    causal = isinstance(mask, str) and mask == "causal"
    ext = current().ext
    if (ext is not None and queries.ndim == 4 and sinks is None and (mask is None or causal)
            and not hasattr(cache, "bits") and queries.dtype == keys.dtype == values.dtype == mx.float32
            and keys.shape == values.shape and queries.shape[-1] == keys.shape[-1]
            and queries.shape[1] % keys.shape[1] == 0 and queries.shape[2] <= keys.shape[2]):
        return ext.attention(queries, keys, values, float(scale), causal)
    return _mlx_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _left_padded_decode(queries, cache, mask) -> bool:
    """One query per sequence of a batch whose KV cache is left-padded (mlx-lm's BatchKVCache)."""
    return (mask is not None and not isinstance(mask, str) and queries.ndim == 4
            and queries.shape[2] == 1 and getattr(cache, "left_padding", None) is not None)


def _per_row_attention(queries, keys, values, cache, scale, sinks):
    """Each sequence attends to its own keys, padding left out, with no mask: the same computation as that
    sequence decoding alone, so a batched sequence rounds (and answers) as it does alone. With one query the
    causal mask hides nothing: the padding is all the batch's mask hides. On the edge0 kernel one node for the
    batch (the padding an input array); otherwise a slice and an attention per sequence."""
    ext = current().ext
    pads = cache.left_padding
    if (ext is not None and sinks is None and pads.dtype == mx.int32 and pads.shape == (queries.shape[0],)
            and queries.dtype == keys.dtype == values.dtype == mx.float32 and keys.shape == values.shape
            and queries.shape[-1] == keys.shape[-1] and queries.shape[1] % keys.shape[1] == 0):
        return ext.attention(queries, keys, values, float(scale), False, pads)
    pads = pads.tolist()  # SYNC: B small ints, computed long before (the cache's bookkeeping)
    return mx.concatenate([scaled_dot_product_attention(queries[i:i + 1], keys[i:i + 1, :, p:], values[i:i + 1, :, p:],
                                                        None, scale, None, sinks) for i, p in enumerate(pads)])


def decode_attention(attn: nn.Module, x: mx.array, mask, cache):
    """One new token's attention for a Qwen3-style module (q/k RMS norms, plain RoPE) over mlx-lm's KVCache, or a
    batch's over its left-padded BatchKVCache: the norms, rotation, cache writes and attention as three nodes
    (Edge0KVWrite for k and for v, then Edge0DecodeAttention) where mlx-lm builds 17 (its reshapes, transposes,
    slice updates and slices among them), the cache's buffers written in place as mlx-lm's slice updates write
    them; the result is theirs bit for bit (a batch's as _per_row_attention computes it). None where these nodes
    do not apply (another kernel, a prompt, another cache type, a cache that must grow first): the caller runs
    mlx-lm's code."""
    ext = current().ext
    if ext is None or cache is None or cache.keys is None or x.shape[1] != 1 or x.dtype != mx.float32:
        return None
    rope, qn, kn = attn["rope"], attn["q_norm"], attn["k_norm"]
    qw, kw = qn["weight"], kn["weight"]
    turn = remembered(attn, "_edge0_turn", (rope, qw, kw), (ext,), lambda: _turn(rope, qw, kw))
    if turn is None or cache.keys.dtype != mx.float32:
        return None
    where = _decode_position(cache, x, mask)
    if where is None:
        return None
    at, positions, starts = where
    cache.keys = ext.kv_write(attn["k_proj"](x), kw, cache.keys, at, kn.eps, *turn, positions)
    cache.values = ext.kv_write(attn["v_proj"](x), None, cache.values, at)
    out = ext.decode_attention(attn["q_proj"](x), qw, cache.keys, cache.values, at, qn.eps, *turn,
                               float(attn.scale), positions, starts)
    _advance(cache, positions)
    return attn["o_proj"](out)


def _decode_position(cache, x: mx.array, mask) -> tuple | None:
    """(the cache row the new token goes to, each sequence's position (B,) or None, each sequence's first key (B,)
    or None) for one new token a sequence: mlx-lm's KVCache with one sequence, or its left-padded BatchKVCache; None
    for anything else, or where the cache must grow first (mlx-lm's code does that)."""
    if type(cache) is KVCache and x.shape[0] == 1 and mask is None:
        at, positions, starts = cache.offset, None, None
    elif (type(cache) is BatchKVCache and getattr(cache, "_right_padding", None) is None
            and isinstance(getattr(cache, "_idx", None), int) and cache.offset.dtype == mx.int32
            and cache.left_padding.dtype == mx.int32 and cache.offset.shape == (x.shape[0],)):
        at, positions = cache._idx, cache.offset
        starts = cache.left_padding if mask is not None and not isinstance(mask, str) else None
    else:
        return None
    return (at, positions, starts) if at < cache.keys.shape[2] else None


def _advance(cache, positions) -> None:
    """The cache past the token just written, as update_and_fetch advances it (one offsets array per batched step)."""
    if positions is None:
        cache.offset += 1
    else:
        cache.offset = _advanced(cache.offset)
        cache._idx += 1


def _turn(rope, q_weight, k_weight) -> tuple | None:
    """The rotation's arguments of the decode nodes (dims, traditional, base, scale), or None where they do not
    apply (another RoPE, float weights other than float32)."""
    if (type(rope) not in (nn.RoPE, KernelRoPE) or rope.base is None or q_weight.dtype != mx.float32
            or k_weight.dtype != mx.float32):
        return None
    return rope.dims, rope.traditional, float(rope.base), float(rope.scale)


def attention_block(layer: nn.Module, h: mx.array, x: mx.array, mask, cache) -> tuple | None:
    """(h + the attention of x, the post-attention norm of that) for one new token a sequence on the edge0 kernel,
    one sequence or a served batch: what the nodes decode_attention and add_norm build compute (projections with
    their adapters, the KV writes, the attention, the output projection, the add-norm), as one node
    (Edge0AttentionBlock) made by one call into the extension instead of about a dozen Python calls, with those
    nodes' bits; None where it does not apply (the caller builds them one by one)."""
    ext = current().ext
    attn = layer["self_attn"]
    if (ext is None or type(attn) is not KernelQwen3Attention or cache is None or cache.keys is None
            or x.shape[1] != 1 or x.dtype != mx.float32 or cache.keys.dtype != mx.float32):
        return None
    where = _decode_position(cache, x, mask)
    if where is None:
        return None
    at, positions, starts = where
    post = layer["post_attention_layernorm"]
    rope, qn, kn = attn["rope"], attn["q_norm"], attn["k_norm"]
    projs = [_projection_arrays(attn[name]) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if any(p is None for p in projs):
        return None
    arrays = (*(a for p in projs for a in p), rope, qn["weight"], kn["weight"], post.get("weight"))
    args = remembered(attn, "_edge0_block", arrays, (ext, x.shape[-1]), lambda: _block_args(ext, attn, post, x))
    if args is None:
        return None
    q, k, v, o, lora_scale, gs, qw, qeps, kw, keps, turn, scale, pw, peps = args
    h, x, cache.keys, cache.values = ext.attention_block(x, h, q, k, v, o, lora_scale, gs, qw, qeps, kw, keps,
                                                         cache.keys, cache.values, at, *turn, scale, pw, peps,
                                                         positions, starts)
    _advance(cache, positions)
    return h, x


def _projection_arrays(m: nn.Module) -> tuple | None:
    """A projection's arrays as attention_block takes them: (w, scales, biases) of a quantized linear without bias,
    with (lora_a, lora_b) when it carries an unmerged adapter (model/lora.py LoRALinear); None for anything else."""
    base = m.get("base") if "lora_a" in m else m
    if type(base) is not KernelQuantizedLinear or "bias" in base:
        return None
    q = (base["weight"], base["scales"], base.get("biases"))
    return (*q, m["lora_a"], m["lora_b"]) if base is not m else q


def _block_args(ext, attn, post, x) -> tuple | None:
    """attention_block's arguments for this attention module and norm, or None where the edge0 kernel does not
    cover one of its parts (the checks of decode_attention, lora_linear and add_norm, made once)."""
    rope, qn, kn = attn["rope"], attn["q_norm"], attn["k_norm"]
    turn = _turn(rope, qn["weight"], kn["weight"])
    pw = post.get("weight") if isinstance(post, nn.RMSNorm) else None
    if turn is None or pw is None or pw.dtype != mx.float32 or pw.ndim != 1:
        return None
    mods = [attn[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    bases = [m["base"] if "lora_a" in m else m for m in mods]
    gs = bases[0].group_size
    scales = {float(m.scale) for m in mods if "lora_a" in m}
    widths = (x.shape[-1], x.shape[-1], x.shape[-1], bases[0]["weight"].shape[0])  # o_proj reads q's heads
    for m, b, d in zip(mods, bases, widths):
        if b.group_size != gs or not fits(ext, d, mx.float32, b["weight"], b["scales"], b.get("biases"), gs, b.bits,
                                          b.mode) or b["weight"].ndim != 2:
            return None
        if "lora_a" in m and not (m["lora_a"].dtype == m["lora_b"].dtype
                                  and m["lora_a"].dtype in (mx.float32, mx.bfloat16)):
            return None
    if len(scales) > 1:
        return None
    q, k, v, o = (list(_projection_arrays(m)) for m in mods)
    return (q, k, v, o, scales.pop() if scales else 0.0, gs, qn["weight"], qn.eps, kn["weight"], kn.eps, turn,
            float(attn.scale), pw, post.eps)


_ADVANCE: tuple = (None, None)  # (a batch's offsets, the same + 1): the step's last advance


def _advanced(offset: mx.array) -> mx.array:
    """offset + 1, shared by every layer of one batched step: their caches then hold one offsets array, and the
    step adds once (two nodes, with the 1's broadcast) where each layer added its own. Nothing updates an offsets
    array in place (mlx-lm's BatchKVCache rebinds it), so sharing it is safe."""
    global _ADVANCE
    old, new = _ADVANCE  # one tuple, read and written whole: safe across threads
    if old is not offset:
        new = offset + 1
        _ADVANCE = (offset, new)
    return new


class KernelQwen3Attention(qwen3_moe.Attention):
    def __call__(self, x, mask=None, cache=None):
        out = decode_attention(self, x, mask, cache)
        return out if out is not None else super().__call__(x, mask, cache)


def add_norm(h: mx.array, r: mx.array, norm: nn.Module) -> tuple[mx.array, mx.array]:
    """(h + r, norm(h + r)): a residual add and the RMS norm after it, one node on the edge0 kernel (the two
    nodes' bits). Where r is the attention's or the experts' node, not yet evaluated, that node runs inside this
    one (Edge0DecodeAttention+AddRMSNorm, Edge0GLU+AddRMSNorm): one node fewer, the same bits."""
    ext = current().ext
    w = norm.get("weight") if isinstance(norm, nn.RMSNorm) else None
    if (ext is not None and w is not None and h.dtype == r.dtype == w.dtype == mx.float32 and h.shape == r.shape
            and w.ndim == 1):
        return tuple(ext.add_rms_norm(h, r, w, norm.eps))
    h = h + r
    return h, norm(h)


class KernelQwen3MoeModel(qwen3_moe.Qwen3MoeModel):
    """mlx-lm's decoder stack, each residual add fused with the RMS norm that follows it (the next layer's input
    norm, the final norm): one node where there were two, the same numbers. mlx-lm's own code for another kernel,
    input embeddings or a pipeline over several processes."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        layers = self.pipeline_layers
        if (current().ext is None or input_embeddings is not None or self.pipeline_size > 1
                or any(type(layer) is not qwen3_moe.Qwen3MoeDecoderLayer for layer in layers)):
            return super().__call__(inputs, cache, input_embeddings)
        cache = cache if cache is not None else [None] * len(layers)
        h = self["embed_tokens"](inputs)
        mask = qwen3_moe.create_attention_mask(h, cache[0])
        x = layers[0]["input_layernorm"](h)
        afters = [layer["input_layernorm"] for layer in layers[1:]] + [self["norm"]]
        for layer, c, after in zip(layers, cache, afters):  # modules by item: Module.__getattr__ costs ~0.5 us
            block = attention_block(layer, h, x, mask, c)
            h, x = block or add_norm(h, layer["self_attn"](x, mask, c), layer["post_attention_layernorm"])
            mlp = layer["mlp"]
            fused = getattr(mlp, "add_norm", None)  # an MoE block's whole decode step in one call, where it can
            h, x = (fused is not None and fused(h, x, after)) or add_norm(h, mlp(x), after)
        return x


class KernelRMSNorm(nn.RMSNorm):
    def __call__(self, x):
        return rms_norm(x, self["weight"], self.eps)


class KernelRoPE(nn.RoPE):
    def __call__(self, x, offset: int = 0):
        return rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)


def use_kernel_ops(model: nn.Module) -> int:
    """Make the model's RMS norms, plain RoPEs and Qwen3 attention modules call this module (parameters
    untouched), and the attention of its model modules call scaled_dot_product_attention above. Returns how many modules
    were swapped. mlx-lm's attention calls the function named in its model module's namespace, so that
    name is replaced there (once, for the process); the replacement runs mlx-lm's own function whenever
    the current kernel is not edge0, so models that did not ask for it compute exactly as before.
    """
    for module in {sys.modules.get(type(m).__module__) for _, m in model.named_modules()}:
        if getattr(module, "scaled_dot_product_attention", None) is _mlx_attention:
            module.scaled_dot_product_attention = scaled_dot_product_attention
    return swap_classes(model, {nn.RMSNorm: KernelRMSNorm, nn.RoPE: KernelRoPE,
                                qwen3_moe.Attention: KernelQwen3Attention,
                                qwen3_moe.Qwen3MoeModel: KernelQwen3MoeModel})
