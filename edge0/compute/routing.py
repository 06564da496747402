"""Routing math, op for op as mlx-lm's blocks compute it (tests pin it bit for bit under `--kernel mlx`;
with the edge0 kernel the softmax top-k and the combine are one node each of the CPU extension, the same
math in float32).

Shapes: T tokens (any leading dims), E experts, K routed.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .kernel_choice import current


def softmax_topk(logits: mx.array, k: int, norm_topk_prob: bool) -> tuple[mx.array, mx.array]:
    """Qwen3-MoE / Qwen3-Next / Qwen3.5-MoE: softmax, top-k, optional renormalisation."""
    ext = current().ext
    if ext is not None and logits.dtype == mx.float32:
        return tuple(ext.softmax_topk(logits, k, norm_topk_prob))
    gates = mx.softmax(logits, axis=-1, precise=True)  # (T, E)
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])  # (T, K)
    scores = mx.take_along_axis(gates, inds, axis=-1)  # (T, K)
    if norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def choose_among(logits: mx.array, among: mx.array, k: int, norm_topk_prob: bool) -> tuple[mx.array, mx.array]:
    """softmax_topk with the k chosen among each row's candidate ids `among` (T, M) only: the probabilities are
    the softmax of all E logits, the weights of the chosen renormalised when norm_topk_prob. Predicted routing:
    a head names M candidates a token ahead (they are read then), the layer's own router picks and weighs K."""
    ext = current().ext
    if ext is not None and logits.dtype == mx.float32 and among.dtype == mx.uint32:
        return tuple(ext.softmax_topk(logits, k, norm_topk_prob, among))
    gates = mx.softmax(logits, axis=-1, precise=True)  # (T, E)
    cand = mx.take_along_axis(gates, among, axis=-1)  # (T, M)
    pos = mx.stop_gradient(mx.argpartition(-cand, kth=k - 1, axis=-1)[..., :k])
    inds = mx.take_along_axis(among, pos, axis=-1)  # (T, K)
    scores = mx.take_along_axis(cand, pos, axis=-1)
    if norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def softmax_weights(logits: mx.array, inds: mx.array, norm_topk_prob: bool) -> mx.array:
    """softmax_topk's weights of the experts `inds` (T, K), whichever they are (routing forced from a trace): their
    probabilities in the softmax over every expert, renormalised over the K when norm_topk_prob."""
    scores = mx.take_along_axis(mx.softmax(logits, axis=-1, precise=True), inds, axis=-1)  # (T, K)
    return scores / mx.sum(scores, axis=-1, keepdims=True) if norm_topk_prob else scores


def sigmoid_group_weights(logits: mx.array, inds: mx.array, norm_topk_prob: bool, routed_scaling_factor: float,
                          score_function: str) -> mx.array:
    """sigmoid_group_topk's weights of the experts `inds` (T, K), whichever they are (the selection bias and the
    groups only choose)."""
    x = logits.astype(mx.float32)
    scores = mx.sigmoid(x) if score_function == "sigmoid" else mx.softmax(x, axis=-1)
    scores = mx.take_along_axis(scores, inds, axis=-1)  # (T, K)
    if inds.shape[-1] > 1 and norm_topk_prob:
        scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
    return (scores * routed_scaling_factor).astype(logits.dtype)


@mx.compile
def sigmoid_group_topk(logits, expert_bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, score_function):
    """Bailing (Ling) / DeepSeek-style: sigmoid scores, group-limited top-k, selection bias, routed scaling."""
    in_type = logits.dtype
    if score_function == "sigmoid":
        scores = mx.sigmoid(logits.astype(mx.float32))
    else:
        scores = mx.softmax(logits.astype(mx.float32), axis=-1)
    orig_scores = scores
    if expert_bias is not None:
        scores = scores + expert_bias  # the bias selects, it never weighs
    if n_group > 1:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))  # (T, G, E/G)
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)  # (T, G, 1)
        drop = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
        scores = mx.put_along_axis(scores, mx.stop_gradient(group_idx), mx.array(0.0, scores.dtype), axis=-2)
        scores = mx.flatten(scores, -2, -1)
    inds = mx.stop_gradient(mx.argpartition(scores, kth=-top_k, axis=-1)[..., -top_k:])
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    if top_k > 1 and norm_topk_prob:
        scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
    scores = scores * routed_scaling_factor
    return inds, scores.astype(in_type)


def combine(y: mx.array, scores: mx.array, *, cast_back: bool) -> mx.array:
    """Weighted sum of the K expert outputs (T, K, D) -> (T, D)."""
    ext = current().ext
    if ext is not None and y.dtype == scores.dtype == mx.float32:
        return ext.combine(y, scores)
    out = (y * scores[..., None]).sum(axis=-2)
    return out.astype(y.dtype) if cast_back else out


@partial(mx.compile, shapeless=True)
def combine_compiled(y, scores):
    """Bailing compiles its aggregation; compiled and eager sums may round differently."""
    return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


def topk_routing(logits: mx.array, k: int, *, score: str = "softmax", bias: mx.array | None = None,
                 groups: tuple[int, int] | None = None, group_rule: str = "top2", norm: bool = False,
                 scale: float = 1.0, softcap: float = 0.0) -> tuple[mx.array, mx.array]:
    """The routing most mlx-lm MoE families compute from their router logits (T, E) -> (T, K), (T, K).

    score: "softmax" | "sigmoid" | "sqrtsoftplus" | "none" (the logits themselves); bias: added to the
    scores for selection only; groups: (n_group, topk_group), keeping the topk_group groups whose top-2
    sum (group_rule "top2") or maximum ("max") is largest (the others' scores set to 0, as mlx-lm does); the weights are the unbiased scores of the
    chosen experts, renormalised when `norm`, times `scale`. Families that select on the top-K logits
    and then softmax them choose the same set as score "softmax" with norm.
    """
    x = logits.astype(mx.float32)
    if softcap > 0:
        x = mx.tanh(x / softcap) * softcap
    if score == "softmax":
        scores = mx.softmax(x, axis=-1, precise=True)
    elif score == "sigmoid":
        scores = mx.sigmoid(x)
    elif score == "sqrtsoftplus":
        scores = mx.sqrt(mx.logaddexp(x, 0.0))
    else:
        scores = x
    chosen = scores if bias is None else scores + bias
    if groups is not None and groups[0] > 1 and groups[1] < groups[0]:
        n_group, topk_group = groups
        chosen = mx.unflatten(chosen, axis=-1, shape=(n_group, -1))  # (T, G, E/G)
        if group_rule == "max":
            group_scores = chosen.max(axis=-1, keepdims=True)
        else:
            group_scores = mx.topk(chosen, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
        chosen = mx.put_along_axis(chosen, mx.stop_gradient(group_idx), mx.array(0.0, chosen.dtype), axis=-2)
        chosen = mx.flatten(chosen, -2, -1)
    inds = mx.stop_gradient(mx.argpartition(-chosen, kth=k - 1, axis=-1)[..., :k])  # (T, K)
    weights = mx.take_along_axis(scores, inds, axis=-1)
    if norm:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return inds, weights * scale
