"""`edge0 convert SRC OUT`: an mlx-lm (4-bit) or Hugging Face (bf16/fp16/fp32) MoE checkpoint -> Edge0 store.

    edge0 convert ~/models/Qwen3-30B-A3B-4bit ~/stores/qwen3-30b

mlx-lm sources keep their expert bytes exactly (no re-quantization); float sources are quantized the
way `mlx_lm.convert -q` does it (affine, 4 bits, group 64 by default). The store is built in a
temporary sibling directory and renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model, save_config
from tqdm import tqdm

from ..errors import Edge0Error
from ..io.layerfile import LayerFileWriter, bundle_layout
from ..io.manifest import FORMAT_VERSION, Manifest, LayerEntry, write_manifest
from .arch import arch_for, read_config, routing_constants, text_config
from .blocks import is_moe_block
from .load import RESIDENT, cast_floats

SAFETENSORS_DTYPES = {mx.uint32: "U32", mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.uint8: "U8"}
PROJS = ("gate_proj", "up_proj", "down_proj")
KINDS = ("weight", "scales", "biases", "bias")
_SKIP = re.compile(r"(^model.*\.safetensors$|^model\.safetensors\.index\.json$|^config\.json$|^edge0\.json$)")
_CONVERSION_DTYPES = {"float16", "bfloat16", "float32"}


def prepare_out(out: Path, force: bool) -> Path:
    """Check OUT may be written; return the temporary directory to build into."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise Edge0Error(f"{out}: exists and is not empty; pass --force to replace it")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise Edge0Error(f"{out}: cannot be written ({e.strerror})") from None
    return tmp


def commit_out(tmp: Path, out: Path) -> None:
    """Move the finished store into place; an old OUT is removed only now (after --force)."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(tmp, out)


def _load_source(src: Path, bits: int, group_size: int, mode: str):
    """mlx-lm's model for SRC with lazy weights, quantized as mlx_lm.convert -q would if SRC is not."""
    try:
        model, config = load_model(src, lazy=True, strict=True)
    except (ValueError, FileNotFoundError, KeyError, TypeError, RuntimeError) as e:  # damaged file, missing field
        raise Edge0Error(f"{src}: cannot load as a {read_config(src)['model_type']} checkpoint ({e})") from None
    if "quantization" in config:
        return model, config, False
    dtype = config.get("torch_dtype") or text_config(config).get("dtype")
    if dtype in _CONVERSION_DTYPES:
        cast_floats(model, getattr(mx, dtype))
    with contextlib.redirect_stdout(sys.stderr):
        model, config = quantize_model(model, config, group_size, bits, mode=mode)
    return model, config, True


def _expert_pieces(switch_mlp) -> dict[str, mx.array]:
    pieces = {}
    for proj in PROJS:
        module = switch_mlp[proj]
        for kind in KINDS:
            if kind in module and module[kind] is not None:
                pieces[f"{proj}.{kind}"] = module[kind]
    return pieces


def convert(src: str | os.PathLike, out: str | os.PathLike, *, bits: int = 4, group_size: int = 64, mode: str = "affine",
            force: bool = False, progress: bool = True) -> Path:
    src, out = Path(src), Path(out)
    config = read_config(src)
    arch = arch_for(config, src / "config.json")
    if not list(src.glob("model*.safetensors")):
        raise Edge0Error(f"{src}: no model*.safetensors weight files")
    if out.resolve() == src.resolve():
        raise Edge0Error(f"{out}: OUT must differ from SRC")
    tmp = prepare_out(out, force)
    try:
        model, config, quantized_here = _load_source(src, bits, group_size, mode)
        layers = [(i, layer) for i, layer in enumerate(model.layers) if is_moe_block(layer.mlp)]
        if not layers:
            raise Edge0Error(f"{src}: config declares no MoE layers")
        params = dict(tree_flatten(model.parameters()))
        resident = {k: v for k, v in params.items() if ".switch_mlp." not in k}
        del params
        mx.save_safetensors(str(tmp / RESIDENT), resident, metadata={"format": "mlx"})
        del resident

        first = _expert_pieces(layers[0][1].mlp.switch_mlp)
        if "gate_proj.scales" not in first:
            raise Edge0Error(f"{src}: routed expert weights are not quantized")
        sm = layers[0][1].mlp.switch_mlp.gate_proj
        quant = {"bits": sm.bits, "group_size": sm.group_size, "mode": sm.mode}
        num_experts = first["gate_proj.weight"].shape[0]
        pieces, bundle_bytes, stride = bundle_layout(
            [(name, SAFETENSORS_DTYPES[a.dtype], list(a.shape[1:])) for name, a in first.items()])
        (tmp / "experts").mkdir()
        entries = []
        bar = tqdm(total=len(layers) * num_experts * bundle_bytes, unit="B", unit_scale=True, desc="convert",
                   disable=not progress, file=sys.stderr)
        for i, layer in layers:
            arrays = _expert_pieces(layer.mlp.switch_mlp)
            if list(arrays) != [p.name for p in pieces]:
                raise Edge0Error(f"{src}: layer {i} experts have pieces {list(arrays)}, layer {layers[0][0]} has {[p.name for p in pieces]}")
            mx.eval(list(arrays.values()))
            rel = f"experts/layer_{i:03d}.safetensors"
            writer = LayerFileWriter(tmp / rel, pieces, num_experts, bundle_bytes, stride,
                                     {"format": "edge0-experts", "layer": i, "arch": arch.model_type})
            flat = [memoryview(arrays[p.name]).cast("B") for p in pieces]
            for e in range(num_experts):
                writer.write_bundle([f[e * p.nbytes:(e + 1) * p.nbytes] for f, p in zip(flat, pieces)])
                bar.update(bundle_bytes)
            size = writer.close()
            entries.append(LayerEntry(layer=i, file=rel, data_offset=writer.data_offset, file_size=size,
                                      checksums=writer.checksums))
            del flat, arrays
            del layer.mlp["switch_mlp"]  # free this layer's experts before the next one loads
        bar.close()

        for f in src.iterdir():
            if f.is_file() and not _SKIP.match(f.name):
                shutil.copy2(f, tmp / f.name)
        if quantized_here:
            save_config(dict(config), config_path=tmp / "config.json")
        else:
            shutil.copy2(src / "config.json", tmp / "config.json")
        k = text_config(config)["num_experts_per_tok"]
        write_manifest(tmp, Manifest(
            format_version=FORMAT_VERSION, arch=arch.model_type, routing=routing_constants(config),
            num_experts=num_experts, top_k=k, quantization=quant, pieces=pieces, bundle_bytes=bundle_bytes,
            bundle_stride=stride, layers=entries,
            source={"path": str(src.resolve()), "format": "hf" if quantized_here else "mlx"}))
        commit_out(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
