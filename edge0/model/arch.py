"""Which architectures Edge0 serves, and what it needs to know of each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import Edge0Error
from ..io.manifest import read_json


@dataclass(frozen=True)
class Arch:
    """What differs between the supported MoE families."""

    model_type: str  # config.json model_type
    family: str  # routing family: "softmax_topk" | "sigmoid_group" (Edge0's own blocks) | "mlx-lm" (the family's)
    description: str
    module: str = ""  # mlx-lm's module for it (an alias such as kimi_k2 runs deepseek_v3's)


# Edge0's own blocks (blocks.py): the first families, with their routing and combine on Edge0's kernels.
ARCHS = {
    "qwen3_moe": Arch("qwen3_moe", "softmax_topk", "Qwen3-30B-A3B family", "qwen3_moe"),
    "qwen3_5_moe": Arch("qwen3_5_moe", "softmax_topk", "Qwen3.5/3.6-35B-A3B family (hybrid linear attention, shared expert)",
                        "qwen3_5_moe"),
    "bailing_moe": Arch("bailing_moe", "sigmoid_group", "Ling family (sigmoid, group-limited top-k, routed scaling)",
                        "bailing_moe"),
}

# Every other mlx-lm MoE family, by mlx-lm module: its own block runs, Edge0 replaces the expert call
# (adapter.py); routers.py describes the routers that prefetch and predicted routing use.
FAMILIES = {
    "mixtral": "Mixtral", "qwen2_moe": "Qwen1.5/2-MoE", "qwen3_next": "Qwen3-Next", "olmoe": "OLMoE",
    "deepseek": "DeepSeek-MoE", "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3, Kimi K2",
    "deepseek_v32": "DeepSeek-V3.2", "glm4_moe": "GLM-4.5/4.6 MoE", "glm4_moe_lite": "GLM-4.7-Flash",
    "glm_moe_dsa": "GLM-5", "gpt_oss": "gpt-oss (biased, clamped SwiGLU experts)", "granitemoe": "Granite MoE",
    "granitemoehybrid": "Granite 4 hybrid", "phimoe": "Phi-3.5-MoE", "phixtral": "Phixtral (GELU MLP experts)",
    "minimax": "MiniMax M2", "dots1": "dots.llm1", "ernie4_5_moe": "ERNIE 4.5 MoE", "hunyuan": "Hunyuan MoE",
    "jamba": "Jamba", "kimi_linear": "Kimi Linear", "lfm2_moe": "LFM2-MoE", "mellum": "Mellum MoE",
    "mimo_v2_flash": "MiMo-V2-Flash", "mistral4": "Mistral 4", "nemotron_h": "Nemotron-H (ReLU^2 MLP experts)",
    "solar_open": "Solar Open", "step3p5": "Step 3.5 (clamped SwiGLU experts)", "exaone_moe": "EXAONE MoE",
    "afmoe": "AFMoE", "Klear": "Klear", "laguna": "Laguna", "longcat_flash": "LongCat-Flash (identity experts)",
    "bailing_moe_linear": "Ling linear", "bailing_moe_v3": "Ling 2.5 / Ring", "gemma4_text": "Gemma 4 MoE (GeGLU)",
    "llama4": "Llama 4 (text)", "qwen3_vl_moe": "Qwen3-VL MoE (text)", "kimi_vl": "Kimi-VL (text)",
    "kimi_k25": "Kimi K2.5 (text)", "gemma4": "Gemma 4 MoE (text)",
}

# Config keys by which other checkpoints declare routed experts.
_MOE_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_experts_per_tok")


def supported_list() -> str:
    return ", ".join([f"{k} ({a.description})" for k, a in ARCHS.items()] + sorted(FAMILIES))


def read_config(model_dir: str | Path) -> dict:
    """config.json of a model directory, with a clear error for a missing or broken one."""
    root = Path(model_dir)
    if not root.is_dir():
        raise Edge0Error(f"{root}: no such model directory")
    path = root / "config.json"
    if not path.exists():
        raise Edge0Error(f"{path}: missing; {root} is not a model directory")
    config = read_json(path)
    if not isinstance(config, dict) or "model_type" not in config:
        raise Edge0Error(f"{path}: field 'model_type' missing")
    return config


def text_config(config: dict) -> dict:
    """The language model's fields (multimodal configs nest them under text_config)."""
    return {**config, **config.get("text_config", {})}


def vocab_size(config: dict) -> int | None:
    """The model's vocabulary size from config.json (valid token ids are [0, vocab)); None when it does not say."""
    return text_config(config).get("vocab_size")


def arch_for(config: dict, where: str | Path) -> Arch:
    """The Arch of a config, or one clear error: dense models and unsupported MoEs are named as such."""
    model_type = config["model_type"]
    if model_type in ARCHS:
        return ARCHS[model_type]
    module = mlx_lm_module(config)
    if module in FAMILIES:
        return Arch(model_type, "mlx-lm", FAMILIES[module], module)
    fields = text_config(config)
    if any(fields.get(k) for k in _MOE_KEYS):
        raise Edge0Error(f"{where}: MoE architecture '{model_type}' is not supported; supported: {supported_list()}")
    raise Edge0Error(f"{where}: '{model_type}' is a dense model (no routed experts); Edge0 serves MoE models: {supported_list()}")


def mlx_lm_module(config: dict) -> str | None:
    """The mlx-lm module that builds this config's model (after mlx-lm's own aliases); None if none does."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)[0].__module__.rsplit(".", 1)[-1]
    except (ValueError, KeyError, TypeError):
        return None


def routing_constants(config: dict) -> dict:
    """The routing family and its constants, as recorded in the manifest."""
    arch = arch_for(config, "config.json")
    c = text_config(config)
    if arch.family == "mlx-lm":
        return {"family": "mlx-lm", "module": arch.module}
    if arch.family == "softmax_topk":
        return {"family": arch.family, "norm_topk_prob": bool(c.get("norm_topk_prob", True))}
    return {
        "family": arch.family,
        "score_function": c.get("score_function", "softmax"),
        "n_group": c.get("n_group", 1),
        "topk_group": c.get("topk_group", 4),
        "routed_scaling_factor": c.get("routed_scaling_factor", 1.0),
        "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
        "expert_bias": bool(c.get("moe_router_enable_expert_bias", False)),
    }
