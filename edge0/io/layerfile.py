"""Expert-major layer files: valid safetensors whose data section is one bundle per expert.

Bundle e holds the expert's pieces back to back; bundles start on 4096-byte boundaries so that
O_DIRECT can read them. Safetensors forbids holes in the data section, so the gap after each
bundle is declared as a uint8 tensor `experts.{e}.pad`; the header is padded with spaces so the
data section itself starts on a boundary.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

from ..errors import Edge0Error
from .manifest import ALIGN, Piece

DTYPE_BYTES = {"U32": 4, "BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1}


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def bundle_layout(pieces: list[tuple[str, str, list[int]]]) -> tuple[list[Piece], int, int]:
    """(name, dtype, shape) per piece -> pieces with offsets, bundle bytes, aligned stride."""
    out, offset = [], 0
    for name, dtype, shape in pieces:
        nbytes = DTYPE_BYTES[dtype]
        for s in shape:
            nbytes *= s
        out.append(Piece(name=name, dtype=dtype, shape=list(shape), offset=offset, nbytes=nbytes))
        offset += nbytes
    return out, offset, round_up(offset)


def tensor_name(expert: int, piece: str) -> str:
    return f"experts.{expert}.{piece}"


def header_for(pieces: list[Piece], num_experts: int, bundle_bytes: int, stride: int, metadata: dict) -> bytes:
    """The safetensors header (length prefix included), padded so data starts 4096-aligned."""
    entries: dict = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    for e in range(num_experts):
        base = e * stride
        for p in pieces:
            begin = base + p.offset
            entries[tensor_name(e, p.name)] = {"dtype": p.dtype, "shape": p.shape, "data_offsets": [begin, begin + p.nbytes]}
        if stride > bundle_bytes:
            entries[f"experts.{e}.pad"] = {"dtype": "U8", "shape": [stride - bundle_bytes], "data_offsets": [base + bundle_bytes, base + stride]}
    text = json.dumps(entries, separators=(",", ":")).encode()
    size = round_up(8 + len(text)) - 8
    return struct.pack("<Q", size) + text + b" " * (size - len(text))


class LayerFileWriter:
    """Writes one layer file sequentially, bundle by bundle, checksumming as it goes."""

    def __init__(self, path: Path, pieces: list[Piece], num_experts: int, bundle_bytes: int, stride: int, metadata: dict):
        self.path, self.pieces, self.num_experts = path, pieces, num_experts
        self.bundle_bytes, self.stride = bundle_bytes, stride
        self.header = header_for(pieces, num_experts, bundle_bytes, stride, metadata)
        self.data_offset = len(self.header)
        self.checksums: list[str] = []
        self.f = open(path, "wb")
        self.f.write(self.header)

    def write_bundle(self, parts: list) -> None:
        """parts: one bytes-like per piece, in manifest order."""
        crc, total = 0, 0
        for piece, part in zip(self.pieces, parts, strict=True):
            view = memoryview(part).cast("B")
            if len(view) != piece.nbytes:
                raise ValueError(f"{piece.name}: {len(view)} bytes, expected {piece.nbytes}")
            crc = zlib.crc32(view, crc)
            self.f.write(view)
            total += len(view)
        self.f.write(b"\0" * (self.stride - total))
        self.checksums.append(f"{crc:08x}")

    def close(self) -> int:
        if len(self.checksums) != self.num_experts:
            raise ValueError(f"{self.path}: wrote {len(self.checksums)} of {self.num_experts} bundles")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.data_offset + self.num_experts * self.stride


def check_header(path: Path, fd: int, pieces: list[Piece], data_offset: int, stride: int, *, layer: int | None = None,
                 crc: str | None = None) -> None:
    """Cheap start-up check: the header is the one the manifest recorded (crc, when given), of the layer the
    manifest lists the file as (layer, when given: a swapped or renamed file), and places expert 0 and expert 1
    where the manifest says."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise Edge0Error(f"{path}: truncated (no safetensors header)")
    (size,) = struct.unpack("<Q", head)
    if 8 + size != data_offset:
        raise Edge0Error(f"{path}: safetensors header is {size} bytes, manifest expects data at offset {data_offset}")
    text = os.pread(fd, size, 8)
    damaged = crc is not None and f"{zlib.crc32(text, zlib.crc32(head)):08x}" != crc
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = ("checksum mismatch in the safetensors header (file damaged)" if damaged
               else f"corrupt safetensors header ({e})")
        raise Edge0Error(f"{path}: {why}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    held = meta.get("layer") if isinstance(meta, dict) else None
    if layer is not None and held is not None and held != str(layer):
        raise Edge0Error(f"{path}: holds the experts of layer {held}, the manifest lists it as layer {layer} "
                         "(layer files swapped or renamed)")
    if damaged:
        raise Edge0Error(f"{path}: checksum mismatch in the safetensors header (file damaged)")
    for e in (0, 1):
        for p in pieces:
            entry = header.get(tensor_name(e, p.name)) if isinstance(header, dict) else None
            want = [e * stride + p.offset, e * stride + p.offset + p.nbytes]
            if not entry or entry.get("data_offsets") != want or entry.get("shape") != p.shape or entry.get("dtype") != p.dtype:
                if e == 1 and entry is None and tensor_name(0, p.name) in header:
                    continue  # single-expert layer
                raise Edge0Error(f"{path}: header entry {tensor_name(e, p.name)} disagrees with the manifest")
