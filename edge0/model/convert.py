"""`edge0 convert SRC OUT`: an mlx-lm (quantized) or Hugging Face (bf16/fp16/fp32) MoE checkpoint -> Edge0 store.

    edge0 convert ~/models/Qwen3-30B-A3B-4bit ~/stores/qwen3-30b

mlx-lm sources keep their expert bytes exactly (no re-quantization, so --bits/--group-size other than the
source's are refused); float sources are quantized the way `mlx_lm.convert -q` does it (affine, 4 bits,
group 64 by default). The store is built in a temporary sibling directory and renamed into place when
complete (edge0.io.atomic): a full disk, an error or a signal leaves OUT as it was.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import zlib
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model, save_config
from tqdm import tqdm

from ..compute.expert_math import GLU_PROJS as PROJS, MLP_PROJS
from ..errors import Edge0Error
from ..io.atomic import atomic_dir, free_bytes, no_space
from ..io.layerfile import LayerFileWriter, bundle_layout
from ..io.manifest import FORMAT_VERSION, MANIFEST, LayerEntry, Manifest, file_entry, write_manifest
from ..io.outputs import MADE_MODEL_KIND, STORE_KIND, check_dir_out, refuse_inputs
from .adapter import expert_slots, get_path
from .arch import arch_for, mlx_lm_module, read_config, routing_constants, text_config
from .load import RESIDENT, cast_floats
from .routers import ROUTERS

SAFETENSORS_DTYPES = {mx.uint32: "U32", mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.uint8: "U8"}
KINDS = ("weight", "scales", "biases", "bias")
_SKIP = re.compile(rf"(^model.*\.safetensors$|^model\.safetensors\.index\.json$|^config\.json$|^edge0\.json$|^\."
                   rf"|^{re.escape(MADE_MODEL_KIND.sign)}$)")
_CONVERSION_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize's affine mode takes
GROUP_SIZES = (32, 64, 128)
DEFAULT_BITS, DEFAULT_GROUP_SIZE = 4, 64


def check_paths(src: Path, out: Path, force: bool) -> None:
    """OUT must not be SRC, lie inside it or hold it, and replaces only an earlier store, with --force."""
    refuse_inputs(out, {"SRC": src})
    check_dir_out(out, force, STORE_KIND)


def quant_settings(src: Path, config: dict, bits: int | None, group_size: int | None) -> tuple[int, int]:
    """The bits and group size the store's experts will have; flags that cannot apply are refused."""
    q = config.get("quantization")
    if q is not None:  # mlx-lm source: its experts are copied as they are
        have = {"--bits": (bits, q.get("bits")), "--group-size": (group_size, q.get("group_size"))}
        for flag, (asked, own) in have.items():
            if asked is not None and asked != own:
                raise Edge0Error(f"{flag} {asked}: {src} is already quantized ({q.get('bits')}-bit, group size "
                                 f"{q.get('group_size')}) and its experts are re-laid byte-for-byte, not re-quantized; "
                                 f"drop {flag}, or convert from the float checkpoint")
        return q.get("bits"), q.get("group_size")
    bits = DEFAULT_BITS if bits is None else bits
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if bits not in BITS:
        raise Edge0Error(f"--bits {bits}: mx.quantize takes {', '.join(map(str, BITS))} bits")
    if group_size not in GROUP_SIZES:
        raise Edge0Error(f"--group-size {group_size}: mx.quantize takes group sizes {', '.join(map(str, GROUP_SIZES))}")
    c = text_config(config)
    for field in ("hidden_size", "moe_intermediate_size"):  # mlx-lm silently skips layers it cannot group
        if isinstance(c.get(field), int) and c[field] % group_size:
            raise Edge0Error(f"--group-size {group_size}: the experts' input width {c[field]} ({field} in "
                             f"{src / 'config.json'}) is not a multiple of it; choose a group size that divides it")
    return bits, group_size


def needed_bytes(src: Path, config: dict, bits: int, group_size: int) -> int:
    """About what the store will take: the source's weights (scaled down when quantized here) and other files."""
    weights = sum(f.stat().st_size for f in src.glob("model*.safetensors"))
    if "quantization" not in config:
        dtype = config.get("torch_dtype") or text_config(config).get("dtype")
        width = _CONVERSION_DTYPES.get(dtype, 2) * 8
        weights = int(weights * (bits + 32 / group_size) / width)  # packed weights plus a scale and bias per group
    others = sum(f.stat().st_size for f in src.iterdir() if f.is_file() and not _SKIP.match(f.name))
    return weights + others


def convert(src: str | os.PathLike, out: str | os.PathLike, *, bits: int | None = None, group_size: int | None = None,
            mode: str = "affine", force: bool = False, progress: bool = True) -> Path:
    """Write the Edge0 store of checkpoint SRC to OUT. bits/group_size: None is the source's (or 4/64 for a float
    source); force: replace a non-empty OUT once the new store is complete."""
    src, out = Path(src), Path(out)
    config = read_config(src)
    arch = arch_for(config, src / "config.json")
    if not list(src.glob("model*.safetensors")):
        raise Edge0Error(f"{src}: no model*.safetensors weight files")
    check_paths(src, out, force)
    bits, group_size = quant_settings(src, config, bits, group_size)
    needed = needed_bytes(src, config, bits, group_size)
    where = next(p for p in (out, *out.parents) if p.exists())
    free = free_bytes(where)
    if free is not None and free < needed:
        raise no_space(out, needed)
    with atomic_dir(out, replace=force, needed=needed) as tmp:
        _write_store(src, tmp, arch.model_type, bits, group_size, mode, progress)
    return out


def _write_store(src: Path, tmp: Path, model_type: str, bits: int, group_size: int, mode: str, progress: bool) -> None:
    model, config, quantized_here = _load_source(src, bits, group_size, mode)
    slots = expert_slots(model)
    if not slots:
        raise Edge0Error(f"{src}: config declares no MoE layers")
    switch_paths = tuple(f"{path}.{attr}." for path, _, attr in slots.values())
    params = dict(tree_flatten(model.parameters()))
    resident = {k: v for k, v in params.items() if not k.startswith(switch_paths)}
    del params
    mx.save_safetensors(str(tmp / RESIDENT), resident, metadata={"format": "mlx"})
    del resident
    layer0, (path0, block0, attr0) = next(iter(slots.items()))
    first = _expert_pieces(block0[attr0], f"{src}: {model_type} layer {layer0}")
    proj = next(iter(first)).split(".")[0]
    pm = block0[attr0][proj]
    quant = {"bits": pm.bits, "group_size": pm.group_size, "mode": pm.mode}
    num_experts = first[f"{proj}.weight"].shape[0]
    top_k = top_k_of(model_type, block0, config)
    pieces, bundle_bytes, stride = bundle_layout(
        [(name, SAFETENSORS_DTYPES[a.dtype], list(a.shape[1:])) for name, a in first.items()])
    entries = _write_experts(src, tmp, slots, pieces, bundle_bytes, stride, num_experts, model_type, progress)
    for f in src.iterdir():
        if f.is_file() and not _SKIP.match(f.name):
            shutil.copy2(f, tmp / f.name)
    if quantized_here:
        save_config(dict(config), config_path=tmp / "config.json")
    else:
        shutil.copy2(src / "config.json", tmp / "config.json")
    listed = {e.file for e in entries}
    files = {p.relative_to(tmp).as_posix(): file_entry(p) for p in sorted(tmp.rglob("*"))
             if p.is_file() and p.relative_to(tmp).as_posix() not in listed and p.name != MANIFEST}
    write_manifest(tmp, Manifest(
        format_version=FORMAT_VERSION, arch=model_type, routing=routing_constants(config),
        num_experts=num_experts, top_k=top_k, quantization=quant, pieces=pieces,
        bundle_bytes=bundle_bytes, bundle_stride=stride, layers=entries,
        source={"path": str(src.resolve()), "format": "hf" if quantized_here else "mlx"}, files=files))


def _write_experts(src, tmp, slots, pieces, bundle_bytes, stride, num_experts, model_type,
                   progress) -> list[LayerEntry]:
    """One expert-major file per MoE layer; each layer's experts are freed before the next one loads."""
    (tmp / "experts").mkdir()
    entries = []
    bar = tqdm(total=len(slots) * num_experts * bundle_bytes, unit="B", unit_scale=True, desc="convert",
               disable=not progress, file=sys.stderr)
    first = next(iter(slots))
    for i, (_, block, attr) in slots.items():
        arrays = _expert_pieces(block[attr], f"{src}: {model_type} layer {i}")
        if list(arrays) != [p.name for p in pieces]:
            raise Edge0Error(f"{src}: layer {i} experts have pieces {list(arrays)}, layer {first} has "
                             f"{[p.name for p in pieces]}")
        mx.eval(list(arrays.values()))
        rel = f"experts/layer_{i:03d}.safetensors"
        writer = LayerFileWriter(tmp / rel, pieces, num_experts, bundle_bytes, stride,
                                 {"format": "edge0-experts", "layer": i, "arch": model_type})
        flat = [memoryview(arrays[p.name]).cast("B") for p in pieces]
        try:
            for e in range(num_experts):
                writer.write_bundle([f[e * p.nbytes:(e + 1) * p.nbytes] for f, p in zip(flat, pieces)])
                bar.update(bundle_bytes)
            size = writer.close()
        except BaseException:
            with contextlib.suppress(OSError):
                writer.f.close()  # an open file would keep a full disk's blocks after the temporary is removed
            raise
        entries.append(LayerEntry(layer=i, file=rel, data_offset=writer.data_offset, file_size=size,
                                  checksums=writer.checksums, header_crc32=f"{zlib.crc32(writer.header):08x}"))
        del flat, arrays
        del block[attr]
    bar.close()
    return entries


def _load_source(src: Path, bits: int, group_size: int, mode: str):
    """mlx-lm's model for SRC with lazy weights, quantized as mlx_lm.convert -q would if SRC is not."""
    try:
        model, config = load_model(src, lazy=True, strict=True)
    except (ValueError, FileNotFoundError, KeyError, TypeError, RuntimeError) as e:  # damaged file, missing field
        raise _load_error(src, read_config(src), e) from None
    if "quantization" in config:
        return model, config, False
    dtype = config.get("torch_dtype") or text_config(config).get("dtype")
    if dtype in _CONVERSION_DTYPES:
        cast_floats(model, getattr(mx, dtype))
    with contextlib.redirect_stdout(sys.stderr):
        model, config = quantize_model(model, config, group_size, bits, mode=mode)
    return model, config, True


def _load_error(src: Path, config: dict, e: Exception) -> Edge0Error:
    """One line naming the family and the first tensor mlx-lm's loader (its sanitize, then a strict load) could
    not place, when that is what failed; else the loader's own words."""
    family = f"a {config['model_type']} checkpoint (mlx-lm's {mlx_lm_module(config) or config['model_type']} layout)"
    if isinstance(e, KeyError):  # sanitize looked for a tensor the checkpoint does not have
        return Edge0Error(f"{src}: {family}: tensor {e.args[0]!r} is missing")
    text = str(e).strip().rstrip(".")
    for lead, what in (("Received", "is not in the model"), ("Missing", "is missing")):
        if text.startswith(lead) and ":" in text:
            head, names = text.split(":", 1)
            names = [n.strip().rstrip(",") for n in names.split() if n.strip()]
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            return Edge0Error(f"{src}: {family}: tensor {names[0]!r} {what}{more}")
    return Edge0Error(f"{src}: cannot load as {family}: {text}")


def _expert_pieces(switch, where: str) -> dict[str, mx.array]:
    """The stacked (E, ...) tensors of a SwitchGLU / SwitchMLP, by piece name ("gate_proj.weight", ...)."""
    pieces = {}
    for proj in (PROJS if "gate_proj" in switch else MLP_PROJS):
        module = switch[proj]
        if "scales" not in module:
            raise Edge0Error(f"{where}: routed expert weights ({proj}) are not quantized")
        if module.get("global_scale") is not None:
            raise Edge0Error(f"{where}: {proj} is {module.mode} with a global scale, which Edge0 does not stream")
        for kind in KINDS:
            if kind in module and module[kind] is not None:
                pieces[f"{proj}.{kind}"] = module[kind]
    return pieces


def top_k_of(model_type: str, block, config: dict) -> int:
    """K: from the block's router description, else the config's field for it."""
    router = ROUTERS.get(mlx_lm_module(config) or model_type)
    if router is not None:
        return int(get_path(block, router.k))
    c = text_config(config)
    for key in ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k", "moe_top_k", "num_experts_per_token"):
        if isinstance(c.get(key), int):
            return c[key]
    raise Edge0Error(f"config.json: no field gives the {model_type} model's experts per token")
