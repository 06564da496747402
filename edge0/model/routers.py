"""Router descriptions: where an mlx-lm MoE block keeps its router and what it computes.

Edge0 runs each family's own block, so native routing needs nothing from here. A description is what
prefetch with next-router and predicted routing need on top: the router's logits for any x, the experts
(and weights) those logits select, and where K lives. Paths are relative to the MoE block (the module
holding the SwitchGLU); `A("path")` names a value read from the block, anything else is a constant.

Two kinds of router:
- a module whose output is the logits (an nn.Linear, or a small wrapper of one): under predicted routing
  the block runs with that module answering the planned logits, so the family's own code selects and
  weighs them, exactly as it would its router's;
- an (E, D) weight inside a gate module that returns (inds, weights) (DeepSeek-V3 style `MoEGate`):
  `gate` names that module, replaced by the planned routing; `own` names the family's own selection
  function and the gate attributes it takes, so the planned routing is the family's math.
Adding a family whose experts are a plain SwiGLU takes one entry here (or none: native routing and
prefetch with the repeat predictor work without one).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class A:
    """A value read from the block at this path (dots descend into submodules and dataclasses)."""

    path: str


@dataclass(frozen=True)
class Router:
    """One family's router; see the module docstring. Shapes: T tokens, E experts, K routed, D hidden."""

    logits: str  # module answering logits (T, E), or an (E, D) weight used as x @ w.T
    k: str  # attribute holding K
    score: str | A = "softmax"  # softmax | sigmoid | sqrtsoftplus | none: probabilities from logits
    bias: str | None = None  # selection bias added to the scores (selects, never weighs)
    groups: tuple[str | A, str | A] | None = None  # (n_group, topk_group) of group-limited selection
    group_rule: str = "top2"  # group score: sum of its top 2 ("top2") or its maximum ("max")
    norm: bool | A = False  # renormalise the K weights
    scale: float | A = 1.0  # routed scaling factor on the weights
    softcap: float | A = 0.0  # tanh soft cap on the logits before the scores
    gate: str | None = None  # weight routers: the module returning (inds, weights)
    own: tuple[str, ...] | None = None  # weight routers: (family function, gate attributes after the logits)
    f32: bool = False  # the router casts x (and its weight) to float32 first
    zero_experts: bool = False  # logits wider than E: ids >= E are identity experts (sent to 0, as the block does)
    groups_if: tuple[str, str] | None = None  # (attribute, value): group-limited only when it holds


_V3_OWN = ("group_expert_select", "e_score_correction_bias", "top_k", "n_group", "topk_group",
           "routed_scaling_factor", "norm_topk_prob")
# DeepSeek-V3 style MoEGate: sigmoid, selection bias, group-limited top-k, renormalised and scaled.
_V3 = Router("gate.weight", "gate.top_k", score="sigmoid", bias="gate.e_score_correction_bias",
             groups=(A("gate.n_group"), A("gate.topk_group")), norm=A("gate.norm_topk_prob"),
             scale=A("gate.routed_scaling_factor"), gate="gate", own=_V3_OWN)
_TOPK_SOFTMAX = dict(norm=True)  # top-K logits, softmax over them: the softmax-renormalised set

ROUTERS: dict[str, Router] = {
    "mixtral": Router("gate", "num_experts_per_tok", **_TOPK_SOFTMAX),
    "phimoe": Router("gate", "top_k", **_TOPK_SOFTMAX),  # sparsemixer picks the top-K logits in turn
    "jamba": Router("router", "num_experts_per_tok", **_TOPK_SOFTMAX),
    "gpt_oss": Router("router", "num_experts_per_tok", **_TOPK_SOFTMAX),
    "phixtral": Router("gate", "num_experts_per_tok", **_TOPK_SOFTMAX),
    "granitemoe": Router("router.layer", "router.top_k", **_TOPK_SOFTMAX),
    "granitemoehybrid": Router("router.layer", "router.top_k", **_TOPK_SOFTMAX),
    "qwen2_moe": Router("gate", "top_k"),
    "qwen3_vl_moe": Router("gate", "top_k", norm=A("norm_topk_prob")),  # qwen3_moe's block
    "llama4": Router("router", "top_k", score="sigmoid"),  # K = 1: the chosen logit's sigmoid
    "hunyuan": Router("gate", "top_k"),
    "qwen3_next": Router("gate", "top_k", norm=A("norm_topk_prob")),
    "olmoe": Router("gate", "top_k", norm=A("norm_topk_prob")),
    "mellum": Router("gate", "top_k", norm=A("norm_topk_prob")),
    "ernie4_5_moe": Router("gate", "k", score=A("args.moe_gate_act"), norm=True),
    "minimax": Router("gate", "num_experts_per_tok", score="sigmoid", bias="e_score_correction_bias", norm=True,
                      f32=True),
    "Klear": Router("gate", "top_k", score="sigmoid", bias="expert_bias", norm=A("norm_topk_prob")),
    "lfm2_moe": Router("gate", "top_k", score="sigmoid", bias="expert_bias", norm=A("norm_topk_prob"),
                       scale=A("routed_scaling_factor")),
    "afmoe": Router("router", "num_experts_per_tok", score=A("score_func"), bias="expert_bias",
                    groups=(A("n_group"), A("topk_group")), norm=A("route_norm"), scale=A("route_scale")),
    "kimi_linear": Router("gate", "args.num_experts_per_token", score=A("args.moe_router_activation_func"),
                          bias="e_score_correction_bias", groups=(A("args.num_expert_group"), A("args.topk_group")),
                          norm=A("args.moe_renormalize"), scale=A("args.routed_scaling_factor")),
    "mistral4": Router("gate", "num_experts_per_tok", groups=(A("args.n_group"), A("args.topk_group")),
                       norm=A("args.norm_topk_prob"), scale=A("args.routed_scaling_factor")),
    "step3p5": Router("gate.gate", "gate.top_k", score="sigmoid", bias="gate.router_bias",
                      norm=A("gate.norm_topk_prob"), scale=A("gate.routed_scaling_factor")),
    "laguna": Router("gate.proj", "gate.top_k", score=A("gate.score_func"), softcap=A("gate.softcap"),
                     bias="gate.e_score_correction_bias", norm=True, scale=A("routed_scaling_factor")),
    "longcat_flash": Router("router.classifier", "router.top_k", bias="router.e_score_correction_bias",
                            norm=A("router.norm_topk_prob"), scale=A("router.routed_scaling_factor"),
                            zero_experts=True),
    "bailing_moe_linear": Router("gate.gate_proj", "gate.top_k", score=A("gate.score_function"),
                                 bias="gate.expert_bias", groups=(A("gate.n_group"), A("gate.topk_group")),
                                 norm=A("gate.norm_topk_prob"), scale=A("gate.routed_scaling_factor")),
    "bailing_moe_v3": Router("gate.weight", "gate.top_k", score="sigmoid", bias="gate.expert_bias",
                             groups=(A("gate.n_group"), A("gate.topk_group")), norm=True,
                             scale=A("gate.routed_scaling_factor"), gate="gate", f32=True,
                             own=("_group_expert_select", "expert_bias", "top_k", "n_group", "topk_group",
                                  "routed_scaling_factor")),
    "deepseek": Router("gate.weight", "gate.top_k", gate="gate"),
    "deepseek_v2": Router("gate.weight", "gate.top_k", groups=(A("gate.n_group"), A("gate.topk_group")),
                          group_rule="max", scale=A("gate.routed_scaling_factor"), gate="gate",
                          groups_if=("gate.topk_method", "group_limited_greedy")),
    **dict.fromkeys(("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "glm4_moe_lite", "solar_open",
                     "dots1", "exaone_moe", "mimo_v2_flash", "nemotron_h", "kimi_vl", "kimi_k25"), _V3),
}
