"""What `edge0 export-gguf` writes: one Job per GGUF tensor, in file order, each made when its turn comes.

q4_1: every 4-bit affine tensor of the store (routed experts, attention, embedding, output) becomes Q4_1
blocks holding the same weights (blocks.py: a group of 64 is two blocks sharing its scale and bias); scales
and biases that fp16 cannot hold exactly are counted. q4_0: the routed experts are re-quantized to Q4_0
(4.5 bits per weight, as the store); everything else as under q4_1. The 8-bit routers are dequantized to
f32 (exact), norms are f32. Names are llama.cpp's for the architecture (gguf's name tables); only
qwen3_moe (llama.cpp's `qwen3moe`) is mapped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import Edge0Error
from ..io.manifest import Manifest
from .blocks import QK, dequantize, fp16_inexact, q4_1_from_affine, quantize
from .source import Experts, Resident

TYPES = ("q4_1", "q4_0")
SUPPORTED = {"qwen3_moe": "QWEN3MOE"}  # Edge0 arch -> gguf.MODEL_ARCH member
PROJS = ("gate_proj", "up_proj", "down_proj")
CHUNK_BYTES = 64 << 20  # expert bytes converted per numpy pass


@dataclass
class Job:
    """One tensor of the output, made when its turn comes."""

    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # shape of the array written (bytes per row for block types)
    dtype: np.dtype  # of that array: uint8 for block types, float32 otherwise
    qtype: object  # gguf.GGMLQuantizationType, or None for f32
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass
class Report:
    """What an export wrote."""

    path: Path
    qtype: str
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fp16_values: int = 0  # Q4_1 scales and biases written
    fp16_inexact: int = 0  # of those, how many fp16 rounds (bf16 below fp16's normal range, or beyond its range)


def check_exportable(root: Path, config: dict, manifest: Manifest, qtype: str) -> None:
    """One line naming what llama.cpp's architecture cannot take."""
    if qtype not in TYPES:
        raise Edge0Error(f"--type {qtype}: choose {' or '.join(TYPES)}")
    if manifest.arch not in SUPPORTED:
        raise Edge0Error(f"{root}: a {manifest.arch} store; export-gguf maps only "
                         f"{', '.join(SUPPORTED)} to llama.cpp's architectures")
    if not config.get("norm_topk_prob", False):
        raise Edge0Error(f"{root / 'config.json'}: norm_topk_prob is false; llama.cpp's qwen3moe always renormalizes "
                         "the routed weights")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise Edge0Error(f"{root / 'config.json'}: dense layers (mlp_only_layers / decoder_sparse_step); llama.cpp's "
                         "qwen3moe has experts in every layer")
    if config.get("rope_scaling"):
        raise Edge0Error(f"{root / 'config.json'}: rope_scaling is not exported")
    q = manifest.quantization
    if qtype == "q4_1" and (q.get("bits") != 4 or q.get("mode", "affine") != "affine" or q["group_size"] % QK):
        raise Edge0Error(f"{root}: experts are {q.get('bits')}-bit {q.get('mode', 'affine')} with groups of "
                         f"{q['group_size']}; q4_1 carries only 4-bit affine groups of a multiple of {QK} "
                         "(use --type q4_0)")


def _quant_of(config: dict, path: str) -> dict:
    q = config.get("quantization") or {}
    own = q.get(path)
    base = {"bits": q.get("bits"), "group_size": q.get("group_size"), "mode": q.get("mode", "affine")}
    return {**base, **own} if isinstance(own, dict) else base


def resident_jobs(res: Resident, config: dict, name_map, report: Report) -> list[Job]:
    """The store's resident tensors: 4-bit affine as Q4_1 (exact), other quantized ones and floats as f32."""
    import gguf

    jobs = []
    for name, entry in res.entries.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            continue
        out = name_map.get_name(module)
        if out is None:
            raise Edge0Error(f"{res.path}: tensor {name} has no llama.cpp name for this architecture")
        if f"{module}.scales" not in res.entries:
            jobs.append(Job(f"{out}.{leaf}", entry.shape, np.float32, None, lambda n=name: res.f32(n)))
            continue
        q = _quant_of(config, module)
        if q["mode"] != "affine":
            raise Edge0Error(f"{res.path}: {module} is {q['mode']}-quantized; only affine is exported")
        n_in = entry.shape[-1] * 32 // q["bits"]
        if q["bits"] == 4 and q["group_size"] % QK == 0:
            make = lambda m=module, gs=q["group_size"]: _q4_1(res.raw(f"{m}.weight"), res.f32(f"{m}.scales"),
                                                             res.f32(f"{m}.biases"), gs, report)
            jobs.append(Job(f"{out}.weight", (*entry.shape[:-1], n_in // QK * 20), np.uint8,
                            gguf.GGMLQuantizationType.Q4_1, make))
        else:  # the 8-bit routers: small, and exact in f32
            make = lambda m=module, q=q: dequantize(res.raw(f"{m}.weight"), res.f32(f"{m}.scales"),
                                                    res.f32(f"{m}.biases"), q["group_size"], q["bits"])
            jobs.append(Job(f"{out}.weight", (*entry.shape[:-1], n_in), np.float32, None, make))
    return jobs


def _q4_1(words, scales, biases, group_size: int, report: Report) -> np.ndarray:
    report.fp16_values += scales.size + biases.size
    report.fp16_inexact += fp16_inexact(scales) + fp16_inexact(biases)
    return q4_1_from_affine(words, scales, biases, group_size)


def expert_jobs(root: Path, manifest: Manifest, qtype: str, name_map, report: Report) -> list[Job]:
    """Per MoE layer, gate/up/down of all experts as one 3-D tensor each, converted a slice of experts at a time."""
    import gguf

    pieces = {p.name: p for p in manifest.pieces}
    missing = [f"{p}.{leaf}" for p in PROJS for leaf in ("weight", "scales", "biases") if f"{p}.{leaf}" not in pieces]
    if missing:
        raise Edge0Error(f"{root / 'edge0.json'}: bundles lack {', '.join(missing)}")
    bits, gs, E = manifest.quantization["bits"], manifest.quantization["group_size"], manifest.num_experts
    block = gguf.GGMLQuantizationType.Q4_1 if qtype == "q4_1" else gguf.GGMLQuantizationType.Q4_0
    per_block = gguf.GGML_QUANT_SIZES[block][1]
    per_chunk = max(1, CHUNK_BYTES // manifest.bundle_bytes)
    jobs = []
    for entry in manifest.layers:
        layer = {}  # the layer's Experts, opened by its first job and closed by its last
        for proj in PROJS:
            rows, words = pieces[f"{proj}.weight"].shape
            n_in = words * 32 // bits
            name = name_map.get_name(f"model.layers.{entry.layer}.mlp.experts.{proj}") + ".weight"

            def make(entry=entry, proj=proj, shape=(E, rows, n_in // QK * per_block), layer=layer) -> np.ndarray:
                ex = layer.get("x") or layer.setdefault("x", Experts(root, manifest, entry))
                out = np.empty(shape, np.uint8)
                for s in range(0, E, per_chunk):
                    t = min(E, s + per_chunk)
                    w, sc, b = (ex.piece(f"{proj}.weight", s, t), ex.f32(f"{proj}.scales", s, t),
                                ex.f32(f"{proj}.biases", s, t))
                    out[s:t] = (_q4_1(w, sc, b, gs, report) if qtype == "q4_1"
                                else quantize(dequantize(w, sc, b, gs, bits), block))
                if proj == PROJS[-1]:
                    layer.pop("x").close()
                return out

            jobs.append(Job(name, (E, rows, n_in // QK * per_block), np.uint8, block, make))
    return jobs
