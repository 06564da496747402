"""Edge0's MoE blocks: mlx-lm's router and shared experts, Edge0's routed-expert executor.

Each block keeps the attribute names of the mlx-lm block it replaces, so resident weights load
under mlx-lm's own parameter names. Shapes: T tokens, E experts, K routed, D hidden.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..compute import expert_math
from ..compute.kernel_choice import current, remembered
from ..compute.kernels import queue
from ..compute.qmm import KernelQuantizedLinear, fits, glu_parts
from ..compute.routing import (choose_among, combine, combine_compiled, sigmoid_group_topk, sigmoid_group_weights,
                               softmax_topk, softmax_weights)


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
        self.routes = None  # (block, x, own) -> (inds, scores): routing forced from or recorded to a trace (traced.py)

    def logits(self, x: mx.array) -> mx.array:
        return self["gate"](x)  # (T, E)

    def select(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return softmax_topk(logits, self.top_k, self.norm_topk_prob)  # (T, K), (T, K)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.select(self.logits(x))

    def weigh(self, logits: mx.array, inds: mx.array) -> mx.array:
        """The weights select would give the experts `inds` (T, K) had it chosen them (forced routing)."""
        return softmax_weights(logits, inds, self.norm_topk_prob)

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
        if "branch" in self:  # the recovery adapter's branch beside the block (model/lora.py LoRABranch)
            y = self["branch"].add(y, x)
        if self.shared:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y

    def add_norm(self, h: mx.array, x: mx.array, norm: nn.Module) -> tuple[mx.array, mx.array] | None:
        """(h + self(x), norm(h + self(x))) for one new token a sequence (one sequence or a served batch) with every
        expert resident, on the edge0 kernel: the router, its top-k (among the candidates decided ahead, under
        predicted routing), the experts' SwiGLU, their weighted sum and the add-norm as one node (Edge0MoeBlock)
        from one call into the extension, with the bits of the nodes those build one by one; None where that does
        not apply (the caller runs self(x) and add_norm). A streamed layer whose candidates were decided a step ahead
        (predicted routing) runs the same node over its slot bank, with the table of each candidate's slot
        (pipeline/prefetch.py bank_step)."""
        ext = current().ext
        executor = self.executor
        resident = getattr(executor, "resident", None)  # ResidentExperts, or the one PredictedResident wraps
        scheduled = getattr(executor, "bank_step", None) is not None  # a streamed pipeline's layer (banked or held)
        streamed = resident is None and scheduled  # a slot bank, decided ahead
        if (ext is None or (resident is None and not streamed) or self.shared or x.ndim != 3 or x.shape[1] != 1
                or x.dtype != mx.float32 or expert_math.current() is not None or self.routes is not None):
            return None
        planned = self.planned() if self.planned is not None else None
        among = planned[0] if planned is not None else None
        if (among is not None and among.dtype != mx.uint32) or (streamed and among is None):
            return None  # (a streamed layer that routes by its own router syncs inside its step: __call__'s way)
        gate, w = self["gate"], norm.get("weight") if isinstance(norm, nn.RMSNorm) else None
        experts = resident if resident is not None else executor.banked_experts()
        if experts is None:
            return None
        bank = experts.bank
        arrays = (gate["weight"], gate["scales"], gate.get("biases"), gate.get("bias"), w, *bank.values())
        args = remembered(self, "_edge0_moe", arrays, (ext, x.shape[-1]), lambda: _moe_args(ext, self, experts, w, x))
        if args is None:
            return None
        table = None
        if streamed:  # its candidates into the bank (read a step ahead, or now), and where each one is
            got = executor.bank_step()
            if got is None:
                return None
            table = got[1]
        router, router_gs, parts, gs = args
        branch = self["branch"].arrays() if "branch" in self else (None, None, 0.0)  # served bf16 under float32 x
        h, x_out, inds = ext.moe_block(x, h, router, router_gs, self.top_k, self.norm_topk_prob, among, *parts, gs, w,
                                       norm.eps, *branch, table)
        if getattr(executor, "pulls_predictions", False) and executor.heads:
            # its heads' predictions go to the host within the step: their routed ids from the router's own nodes
            # (the node's, bit for bit), so that they do not wait for the experts' products
            inds = (self.choose(x, among, planned[1]) if among is not None else self.route(x))[0]
        executor.routed(x, inds)
        if scheduled:  # queued as a staged layer's experts are: the stream computes while the next layers are built
            queue(x_out)  # (a held layer too: the first layers of a step then start before the first streamed one)
        return h, x_out


class SigmoidGroupMoeBlock(nn.Module):
    """Bailing (Ling): sigmoid scores with group-limited top-k, plus always-on shared experts."""

    def __init__(self, src: nn.Module, executor):
        super().__init__()
        self.gate = src.gate
        self.shared_experts = src.shared_experts
        self.executor = executor
        self.planned = None
        self.routes = None  # as SoftmaxMoeBlock's

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

    def weigh(self, logits: mx.array, inds: mx.array) -> mx.array:
        g = self.gate
        return sigmoid_group_weights(logits, inds, g.norm_topk_prob, g.routed_scaling_factor, g.score_function)

    decide = select  # predicted routing decides (inds, weights) ahead

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = _routing(self, x)
        out = combine_compiled(self.executor(x, inds), scores)
        if "branch" in self:  # the recovery adapter's branch beside the block (model/lora.py LoRABranch)
            out = self["branch"].add(out, x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _moe_args(ext, block: SoftmaxMoeBlock, resident, norm_weight, x: mx.array) -> tuple | None:
    """moe_block's fixed arguments (router, its group size, the experts' (gate, up, down), their group size), or
    None where the edge0 kernel does not cover a part (the checks of quantized_matmul, gather_glu and add_norm)."""
    gate, bank, q = block["gate"], resident.bank, resident.quant
    d = x.shape[-1]
    if (not isinstance(gate, KernelQuantizedLinear) or "bias" in gate or gate["weight"].ndim != 2
            or not fits(ext, d, x.dtype, gate["weight"], gate["scales"], gate.get("biases"), gate.group_size,
                        gate.bits, gate.mode)
            or norm_weight is None or norm_weight.dtype != mx.float32 or norm_weight.ndim != 1):
        return None
    parts = glu_parts(ext, bank, x, q.group_size, q.bits, q.mode)
    if parts is None:
        return None
    router = [gate["weight"], gate["scales"], gate.get("biases")]
    resident.pack(ext)  # they never change: the kernel's packed copy serves them, where their memory allows it
    return router, gate.group_size, parts, q.group_size


def _routing(block, x: mx.array) -> tuple[mx.array, mx.array]:
    """The block's routing for this step: forced from a trace or recorded where a trace hook is set (--routes,
    --record-routes: model/traced.py), else its own (_own_routing)."""
    if block.routes is not None:
        return block.routes(block, x, _own_routing)
    return _own_routing(block, x)


def _own_routing(block, x: mx.array) -> tuple[mx.array, mx.array]:
    """Decided ahead by a prerouter head when planned (its candidates chosen among by the block's router, where the
    block chooses), else its router."""
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
