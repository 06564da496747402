"""Edge0's MoE blocks: mlx-lm's router and shared experts, Edge0's routed-expert executor.

Each block keeps the attribute names of the mlx-lm block it replaces, so resident weights load
under mlx-lm's own parameter names. Shapes: T tokens, E experts, K routed, D hidden.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..compute.routing import choose_among, combine, combine_compiled, sigmoid_group_topk, softmax_topk


class SoftmaxMoeBlock(nn.Module):
    """Qwen3-MoE (no shared expert) and Qwen3-Next / Qwen3.5-MoE (gated shared expert)."""

    def __init__(self, src: nn.Module, executor, *, cast_back: bool):
        super().__init__()
        self.top_k = src.top_k
        self.norm_topk_prob = src.norm_topk_prob
        self.gate = src.gate
        self.shared = "shared_expert" in src
        if self.shared:
            self.shared_expert = src.shared_expert
            self.shared_expert_gate = src.shared_expert_gate
        self.executor = executor  # (x, inds) -> (T, K, D)
        self.cast_back = cast_back
        self.planned = None  # () -> (candidates, plan) | None: routing decided ahead (predicted routing)
        self.candidates = None  # predicted routing: how many of its head's likeliest experts it chooses among (None: K)

    def logits(self, x: mx.array) -> mx.array:
        return self.gate(x)  # (T, E)

    def select(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return softmax_topk(logits, self.top_k, self.norm_topk_prob)  # (T, K), (T, K)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.select(self.logits(x))

    def decide(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Predicted routing, a token ahead, from its head's logits: the `candidates` likeliest experts (T, M), read
        ahead, and the plan the `planned` hook gives back with them (the same ids)."""
        inds = softmax_topk(logits, self.candidates or self.top_k, False)[0]
        return inds, inds

    def choose(self, x: mx.array, among: mx.array, plan: mx.array) -> tuple[mx.array, mx.array]:
        """Predicted routing at this token: the router's K likeliest of the candidates decided ahead, weighed by it."""
        return choose_among(self.logits(x), among, self.top_k, self.norm_topk_prob)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = _routing(self, x)
        y = combine(self.executor(x, inds), scores, cast_back=self.cast_back)  # (T, D)
        if self.shared:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class SigmoidGroupMoeBlock(nn.Module):
    """Bailing (Ling): sigmoid scores with group-limited top-k, plus always-on shared experts."""

    def __init__(self, src: nn.Module, executor):
        super().__init__()
        self.gate = src.gate
        self.shared_experts = src.shared_experts
        self.executor = executor
        self.planned = None

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    @top_k.setter
    def top_k(self, k: int) -> None:
        self.gate.top_k = k

    def logits(self, x: mx.array) -> mx.array:
        return self.gate.gate_proj(x)  # (T, E)

    def select(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        g = self.gate
        return sigmoid_group_topk(logits, g.expert_bias, g.top_k, g.n_group, g.topk_group,
                                  g.routed_scaling_factor, g.norm_topk_prob, g.score_function)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.select(self.logits(x))

    decide = select  # predicted routing decides (inds, weights) ahead

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = _routing(self, x)
        out = combine_compiled(self.executor(x, inds), scores)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _routing(block, x: mx.array) -> tuple[mx.array, mx.array]:
    """The block's routing for this step: decided ahead by a prerouter head when planned (its candidates chosen
    among by the block's router, where the block chooses), else its router."""
    planned = block.planned() if block.planned is not None else None
    if planned is None:
        return block.route(x)
    choose = getattr(block, "choose", None)
    return choose(x, *planned) if choose is not None else planned


def make_block(model_type: str, src: nn.Module, executor) -> nn.Module:
    """Edge0's block for mlx-lm block `src` of architecture `model_type`."""
    if model_type == "qwen3_moe":
        return SoftmaxMoeBlock(src, executor, cast_back=True)
    if model_type == "qwen3_5_moe":
        return SoftmaxMoeBlock(src, executor, cast_back=False)
    if model_type == "bailing_moe":
        return SigmoidGroupMoeBlock(src, executor)
    raise KeyError(model_type)


def is_moe_block(module: nn.Module) -> bool:
    return "switch_mlp" in module
