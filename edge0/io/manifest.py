"""The store manifest `edge0.json`: everything a reader needs without parsing tensors.

A store directory holds config.json + tokenizer files, resident.safetensors, experts/layer_NNN.safetensors
and this manifest. Each expert's pieces are one contiguous bundle; bundle e of a layer starts at
`data_offset + e * bundle_stride` in that layer's file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import Edge0Error

FORMAT_VERSION = 1
MANIFEST = "edge0.json"
ALIGN = 4096


@dataclass
class Piece:
    """One tensor of an expert bundle (e.g. gate_proj.weight)."""

    name: str  # "gate_proj.weight", relative to the layer's switch_mlp
    dtype: str  # safetensors dtype code: "U32", "BF16", "F16", "F32", "U8"
    shape: list[int]  # per-expert shape, without the E axis
    offset: int  # byte offset inside the bundle
    nbytes: int


@dataclass
class LayerEntry:
    """One MoE layer's expert file."""

    layer: int  # decoder layer index
    file: str  # path relative to the store root
    data_offset: int  # absolute file offset of bundle 0 (4096-aligned)
    file_size: int  # expected size of the file in bytes
    checksums: list[str]  # crc32 (8 hex digits) of each bundle's bundle_bytes bytes


@dataclass
class Manifest:
    """Parsed edge0.json."""

    format_version: int
    arch: str  # config.json model_type
    routing: dict  # {"family": "softmax_topk" | "sigmoid_group", ...constants}
    num_experts: int  # E
    top_k: int  # K
    quantization: dict  # {"bits", "group_size", "mode"} of the routed experts
    pieces: list[Piece]  # layout of one bundle
    bundle_bytes: int  # bytes of one bundle (sum of pieces), what one read transfers
    bundle_stride: int  # bundle_bytes rounded up to ALIGN
    layers: list[LayerEntry]
    source: dict = field(default_factory=dict)  # where it was converted from

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed expert weights in the store."""
        return self.bundle_bytes * self.num_experts * len(self.layers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def write_manifest(root: Path, manifest: Manifest) -> None:
    write_atomic(root / MANIFEST, manifest.to_json().encode())


def read_manifest(root: str | os.PathLike) -> Manifest:
    """Read and check a store's manifest; bad input raises Edge0Error naming the file."""
    path = Path(root) / MANIFEST
    if not Path(root).is_dir():
        raise Edge0Error(f"{root}: no such model directory")
    if not path.exists():
        raise Edge0Error(f"{path}: missing; {root} is not an Edge0 store (make one with `edge0 convert SRC OUT`)")
    raw = read_json(path)
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if not isinstance(version, int):
        raise Edge0Error(f"{path}: field 'format_version' missing or not an integer")
    if version > FORMAT_VERSION:
        raise Edge0Error(
            f"{path}: store format version {version} is newer than this Edge0 reads ({FORMAT_VERSION}); upgrade edge0"
        )
    try:
        raw["pieces"] = [Piece(**p) for p in raw["pieces"]]
        raw["layers"] = [LayerEntry(**entry) for entry in raw["layers"]]
        manifest = Manifest(**raw)
        _check_types(manifest)
    except (KeyError, TypeError) as e:
        raise Edge0Error(f"{path}: malformed manifest ({e})") from None
    layers = [entry.layer for entry in manifest.layers]
    if len(set(layers)) != len(layers):
        raise Edge0Error(f"{path}: a layer is listed twice ({layers})")
    for entry in manifest.layers:
        if len(entry.checksums) != manifest.num_experts:
            raise Edge0Error(
                f"{path}: layer {entry.layer} lists {len(entry.checksums)} checksums for {manifest.num_experts} experts"
            )
    if sum(p.nbytes for p in manifest.pieces) != manifest.bundle_bytes:
        raise Edge0Error(f"{path}: pieces do not add up to bundle_bytes {manifest.bundle_bytes}")
    return manifest


def _check_types(m: "Manifest") -> None:
    """The integer fields are integers and the quantization names its bits and group size (TypeError if not)."""
    ints = [m.num_experts, m.top_k, m.bundle_bytes, m.bundle_stride]
    ints += [v for p in m.pieces for v in (p.nbytes, p.offset)]
    ints += [v for e in m.layers for v in (e.layer, e.data_offset, e.file_size)]
    if not all(type(v) is int for v in ints):
        raise TypeError("a size, offset, count or layer index is not an integer")
    if not isinstance(m.layers, list) or not all(isinstance(e.checksums, list) for e in m.layers):
        raise TypeError("layers and their checksums must be lists")
    q = m.quantization
    if not isinstance(q, dict) or type(q.get("bits")) is not int or type(q.get("group_size")) is not int:
        raise TypeError("quantization must give integer bits and group_size")


def read_json(path: Path):
    """Parse a JSON file; a broken one is an Edge0Error naming it (an unreadable one says so)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise Edge0Error(f"{path}: cannot read ({e.strerror})") from None
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Edge0Error(f"{path}: not valid JSON ({e})") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that readers see either the old or the whole new content."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
