"""A store's manifest against its config.json: what `edge0 verify` checks beyond the bytes.

    from edge0.model.consistency import config_problems
    config_problems(read_manifest(store), read_config(store))  # [] when they agree
"""

from __future__ import annotations

import copy

from ..errors import Edge0Error
from ..io.manifest import MANIFEST, Manifest
from .arch import ARCHS, arch_for, mlx_lm_module, routing_constants, supported_list, text_config


def moe_layers(config: dict, model=None) -> list[int]:
    """The decoder layers that hold routed experts, by the rule of the architecture's mlx-lm module (for other
    families, those of `model` when given, else of a model built from config)."""
    if config["model_type"] not in ARCHS:
        return family_moe_layers(config, model)
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


def family_moe_layers(config: dict, model=None) -> list[int]:
    """The MoE layers of a family run by its own mlx-lm block: those of `model`, or of the model its config builds
    (lazily, nothing is allocated)."""
    from .adapter import expert_slots

    return list(expert_slots(model if model is not None else lazy_model(config)))


def lazy_model(config: dict):
    """The mlx-lm model config.json builds (lazily: nothing is allocated)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(copy.deepcopy(config)))


def config_problems(manifest: Manifest, config: dict, *, where=MANIFEST, model=None) -> list[str]:
    """Each disagreement between the manifest (called `where`) and config.json, as one line naming the field.
    model: the model config.json builds, when the caller has it (another family's layers are read from it)."""
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
    if arch.family == "mlx-lm" and model is None:
        model = lazy_model(config)  # built once for the layers, E and K
    want, have = moe_layers(config, model), [e.layer for e in manifest.layers]
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
    if arch.family == "mlx-lm":
        out += _family_problems(manifest, config, model, where)
    if manifest.routing != routing_constants(config):
        out.append(f"{where}: routing {manifest.routing} disagrees with config.json ({routing_constants(config)})")
    out += _quantization_problems(manifest, c.get("hidden_size") if arch.family != "mlx-lm" else None, where)
    return out


def _family_problems(manifest: Manifest, config: dict, model, where) -> list[str]:
    """Another family's E and K, read from the model its config.json builds (each family names them its own way)."""
    from .adapter import expert_slots, get_path
    from .routers import ROUTERS

    out = []
    for layer, (_, block, attr) in list(expert_slots(model).items())[:1]:  # one layer: a config gives all one E, K
        switch = block[attr]
        proj = next((p for p in ("gate_proj", "fc1", "up_proj") if p in switch), None)
        experts = switch[proj]["weight"].shape[0] if proj is not None else manifest.num_experts
        if experts != manifest.num_experts:
            out.append(f"{where}: num_experts {manifest.num_experts} disagrees with config.json ({experts} experts "
                       f"in layer {layer})")
        router = ROUTERS.get(mlx_lm_module(config))
        k = get_path(block, router.k) if router is not None else manifest.top_k
        if isinstance(k, int) and k != manifest.top_k:
            out.append(f"{where}: top_k {manifest.top_k} disagrees with config.json ({k} experts per token)")
    return out


def _quantization_problems(m: Manifest, hidden: int | None, where=MANIFEST) -> list[str]:
    """Bits and group size must explain the packed shapes: gate_proj's input width is the hidden size."""
    bits, group = m.quantization["bits"], m.quantization["group_size"]
    shapes = {p.name: p.shape for p in m.pieces}
    proj = "gate_proj" if "gate_proj.weight" in shapes else "fc1"  # SwiGLU experts, or two-layer MLPs
    w, s = shapes.get(f"{proj}.weight"), shapes.get(f"{proj}.scales")
    if not w or not s or bits <= 0 or group <= 0:
        return [f"{where}: quantization {m.quantization} or the {proj} pieces are missing"]
    width = w[-1] * 32 // bits
    if width != s[-1] * group or (hidden is not None and width != hidden):
        return [f"{where}: quantization bits {bits} / group_size {group} do not match the {proj} pieces "
                f"{w} and {s} (hidden size {hidden})"]
    return []
