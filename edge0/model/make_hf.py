"""The Hugging Face layout make-model writes (`--format hf`): unquantized bf16 tensors under the names
mlx-lm's `sanitize` expects, so mlx-lm (and `edge0 convert`) turn them back into the mlx model.

Qwen3.5 and Bailing have their known layouts below. For any other family the layout is learned from
its own `sanitize`: the routed experts are written one tensor per expert (`...experts.{e}.{proj}.weight`,
or Mixtral's `w1/w2/w3`), the first spelling whose sanitize gives back the model's parameter names.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import mlx.core as mx

from ..errors import Edge0Error

# qwen3_5 sanitize adds 1 to these norms when it sees an HF (unsanitized) conv1d weight.
_QWEN3_5_SHIFTED_NORMS = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
    ".q_norm.weight", ".k_norm.weight",
)


def hf_plan(spec) -> list[tuple[str, tuple, mx.Dtype, object]]:
    """[(hf name, shape, dtype, producer)] in model order; producers derive from spec.float."""
    if spec.arch not in ("qwen3_5_moe", "qwen3_moe", "bailing_moe"):
        return family_plan(spec, learned_spelling(spec))
    plan = []
    n_experts = spec.config.get("text_config", spec.config)["num_experts"]
    for name, (shape, dtype) in spec.floats.items():
        f = functools.partial(spec.float, name)
        if spec.arch == "qwen3_5_moe":
            hf = ("model.language_model." + name.removeprefix("language_model.model.")
                  if name.startswith("language_model.model.") else name.removeprefix("language_model."))
            if ".switch_mlp." in name:
                prefix, proj = hf.split(".switch_mlp.")
                if proj == "gate_proj.weight":
                    up = functools.partial(spec.float, name.replace("gate_proj", "up_proj"))
                    E, H, D = shape
                    plan.append((f"{prefix}.experts.gate_up_proj", (E, 2 * H, D), dtype,
                                 lambda f=f, up=up: mx.concatenate([f(), up()], axis=1)))
                elif proj == "down_proj.weight":
                    plan.append((f"{prefix}.experts.down_proj", shape, dtype, f))
            elif name.endswith("conv1d.weight"):  # mlx (C, K, 1), HF (C, 1, K)
                plan.append((hf, (shape[0], shape[2], shape[1]), dtype, lambda f=f: f().moveaxis(2, 1)))
            elif name.endswith(_QWEN3_5_SHIFTED_NORMS):  # HF stores these norms zero-centred
                plan.append((hf, shape, dtype, lambda f=f: f() - 1))
            else:
                plan.append((hf, shape, dtype, f))
        elif ".switch_mlp." in name:  # qwen3_moe, bailing_moe: one tensor per expert
            prefix, proj = name.split(".switch_mlp.")
            for e in range(n_experts):
                plan.append((f"{prefix}.experts.{e}.{proj}", shape[1:], dtype, lambda f=f, e=e: f()[e]))
        elif name.endswith("mlp.gate.gate_proj.weight"):  # bailing router; sanitize renames it back
            plan.append((name.replace("gate.gate_proj", "gate"), shape, dtype, f))
        else:
            plan.append((name, shape, dtype, f))
    return plan


# How a Hugging Face checkpoint names one expert's projections, by mlx-lm's projection names.
SPELLINGS = (
    {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj", "fc1": "fc1", "fc2": "fc2"},
    {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},  # Mixtral, Phi-3.5-MoE, MiniMax
)


def family_plan(spec, spelling: dict) -> list[tuple[str, tuple, mx.Dtype, object]]:
    """The plan of a family: every tensor under its mlx name, but the routed experts one tensor per expert,
    `{block}.experts.{e}.{projection}.{kind}`, as the family's sanitize stacks them."""
    plan = []
    for name, (shape, dtype) in spec.floats.items():
        f = functools.partial(spec.float, name)
        prefix = next((p for p in spec.experts if name.startswith(p)), None)
        if prefix is None:
            plan.append((name, shape, dtype, f))
            continue
        proj, kind = name[len(prefix):].split(".")
        block = prefix.rstrip(".").rpartition(".")[0]
        for e in range(shape[0]):
            plan.append((f"{block}.experts.{e}.{spelling[proj]}.{kind}", shape[1:], dtype, lambda f=f, e=e: f()[e]))
    return plan


def learned_spelling(spec) -> dict:
    """The spelling whose per-expert tensors the family's own sanitize turns back into the model's tensors,
    unchanged (learned on the tiny model); an error when none does."""
    want = {name: spec.float(name) for name in spec.floats}
    for spelling in SPELLINGS:
        try:
            plan = family_plan(spec, spelling)
            got = getattr(spec.model, "sanitize", dict)({name: produce() for name, _, _, produce in plan})
        except (KeyError, ValueError, IndexError, TypeError, AttributeError):
            continue
        if got.keys() == want.keys() and all(mx.array_equal(got[k], want[k]).item() for k in want):
            return spelling
    raise Edge0Error(f"arch {spec.arch}: make-model knows no Hugging Face layout that its mlx-lm sanitize reads "
                     "back; make it with --format mlx")


def write_hf(spec, out: Path, progress: bool, shard_bytes: int) -> None:
    plan = hf_plan(spec)
    sizes = [math.prod(shape) * dtype.size for _, shape, dtype, _ in plan]
    parts = shards(plan, sizes, shard_bytes)
    weight_map = {}
    with bar(sum(sizes), f"{spec.arch} {spec.preset} hf", progress) as progress_bar:
        for i, shard in enumerate(parts):
            arrays = {}
            for name, shape, dtype, produce in shard:
                arrays[name] = a = mx.contiguous(produce())
                mx.eval(a)
                assert a.shape == shape and a.dtype == dtype, name
                progress_bar.update(a.nbytes)
            shard_name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            mx.save_safetensors(str(out / shard_name), arrays, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(arrays, shard_name))
            del arrays
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(spec.config, indent=2) + "\n")


def shards(entries: list, sizes: list[int], max_bytes: int) -> list[list]:
    """mlx_lm.utils.make_shards in bytes: consecutive runs of at most max_bytes (a larger tensor alone)."""
    out, size = [], 0
    for entry, n in zip(entries, sizes):
        if not out or size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += n
    return out


def bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
