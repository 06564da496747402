"""A store's manifest against its config.json: what `edge0 verify` checks beyond the bytes.

    from edge0.model.consistency import config_problems
    config_problems(read_manifest(store), read_config(store))  # [] when they agree
"""

from __future__ import annotations

import copy

from ..errors import Edge0Error
from ..io.manifest import MANIFEST, Manifest
from .arch import ARCHS, arch_for, routing_constants, supported_list, text_config


def moe_layers(config: dict) -> list[int]:
    """The decoder layers that hold routed experts, by the rule of the architecture's mlx-lm module."""
    if config["model_type"] not in ARCHS:
        return family_moe_layers(config)
    c = text_config(config)
    n, experts = c.get("num_hidden_layers", 0), c.get("num_experts") or 0
    if experts <= 0:
        return []
    if config["model_type"] == "bailing_moe":
        return list(range(c.get("first_k_dense_replace", 0), n))
    if config["model_type"] == "qwen3_moe":
        step, dense = c.get("decoder_sparse_step", 1) or 1, set(c.get("mlp_only_layers") or [])
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    return list(range(n))  # qwen3_5_moe: every layer


def family_moe_layers(config: dict) -> list[int]:
    """The MoE layers of a family run by its own mlx-lm block: those of the model its config builds (lazily,
    nothing is allocated)."""
    from mlx_lm.utils import _get_classes

    from .adapter import expert_slots

    model_class, args_class = _get_classes(config)
    return list(expert_slots(model_class(args_class.from_dict(copy.deepcopy(config)))))


def config_problems(manifest: Manifest, config: dict) -> list[str]:
    """Each disagreement between the manifest and config.json, as one line naming the field."""
    where = MANIFEST
    try:
        arch = arch_for(config, "config.json")
    except Edge0Error as e:
        return [str(e)]
    if manifest.arch not in ARCHS and arch.family != "mlx-lm":
        return [f"{where}: architecture '{manifest.arch}' is not one Edge0 serves; supported: {supported_list()}"]
    if manifest.arch != arch.model_type:
        return [f"{where}: arch '{manifest.arch}' disagrees with config.json model_type '{arch.model_type}'"]
    c = text_config(config)
    out = []
    want, have = moe_layers(config), [e.layer for e in manifest.layers]
    missing, unknown = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing:
        out.append(f"{where}: no expert file for MoE layers {missing} of config.json "
                   f"({len(have)} of {len(want)} listed)")
    if unknown:
        out.append(f"{where}: layers {unknown} are not MoE layers of config.json")
    checked = (("num_experts", manifest.num_experts), ("num_experts_per_tok", manifest.top_k))
    for field, value in checked if arch.family != "mlx-lm" else ():  # other families name these their own way
        if c.get(field) != value:
            out.append(f"{where}: {'top_k' if field.endswith('tok') else field} {value} disagrees with "
                       f"config.json {field} {c.get(field)}")
    if manifest.routing != routing_constants(config):
        out.append(f"{where}: routing {manifest.routing} disagrees with config.json ({routing_constants(config)})")
    out += _quantization_problems(manifest, c.get("hidden_size") if arch.family != "mlx-lm" else None)
    return out


def _quantization_problems(m: Manifest, hidden: int | None) -> list[str]:
    """Bits and group size must explain the packed shapes: gate_proj's input width is the hidden size."""
    bits, group = m.quantization["bits"], m.quantization["group_size"]
    shapes = {p.name: p.shape for p in m.pieces}
    proj = "gate_proj" if "gate_proj.weight" in shapes else "fc1"  # SwiGLU experts, or two-layer MLPs
    w, s = shapes.get(f"{proj}.weight"), shapes.get(f"{proj}.scales")
    if not w or not s or bits <= 0 or group <= 0:
        return [f"{MANIFEST}: quantization {m.quantization} or the {proj} pieces are missing"]
    width = w[-1] * 32 // bits
    if width != s[-1] * group or (hidden is not None and width != hidden):
        return [f"{MANIFEST}: quantization bits {bits} / group_size {group} do not match the {proj} pieces "
                f"{w} and {s} (hidden size {hidden})"]
    return []
