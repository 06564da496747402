"""Which architectures Edge0 serves, and what it needs to know of each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import Edge0Error
from ..io.manifest import read_json


@dataclass(frozen=True)
class Arch:
    """What differs between the supported MoE families."""

    model_type: str  # config.json model_type, as mlx-lm names its module
    family: str  # routing family: "softmax_topk" | "sigmoid_group"
    description: str


ARCHS = {
    "qwen3_moe": Arch("qwen3_moe", "softmax_topk", "Qwen3-30B-A3B family"),
    "qwen3_5_moe": Arch("qwen3_5_moe", "softmax_topk", "Qwen3.5/3.6-35B-A3B family (hybrid linear attention, shared expert)"),
    "bailing_moe": Arch("bailing_moe", "sigmoid_group", "Ling family (sigmoid, group-limited top-k, routed scaling)"),
}

# Config keys by which other checkpoints declare routed experts.
_MOE_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_experts_per_tok")


def supported_list() -> str:
    return ", ".join(f"{k} ({a.description})" for k, a in ARCHS.items())


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
    fields = text_config(config)
    if any(fields.get(k) for k in _MOE_KEYS):
        raise Edge0Error(f"{where}: MoE architecture '{model_type}' is not supported; supported: {supported_list()}")
    raise Edge0Error(f"{where}: '{model_type}' is a dense model (no routed experts); Edge0 serves MoE models: {supported_list()}")


def routing_constants(config: dict) -> dict:
    """The routing family and its constants, as recorded in the manifest."""
    arch = arch_for(config, "config.json")
    c = text_config(config)
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
