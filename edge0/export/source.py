"""A store's tensors as numpy arrays, read a piece at a time (no MLX): what `edge0 export-gguf` streams.

Resident tensors come from resident.safetensors (its header parsed here: numpy has no bf16, so BF16 is
kept as raw uint16). Routed experts come from the layer files, a slice of experts at a time, through a
read-only mapping of the bundles (docs/DESIGN.md §4).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import Edge0Error
from ..io.layerfile import check_header
from ..io.manifest import LayerEntry, Manifest, Piece, store_file
from ..io.pagecache import evict
from .blocks import NP_DTYPES, as_f32

RESIDENT = "resident.safetensors"


@dataclass
class Entry:
    """One tensor of a safetensors file."""

    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    nbytes: int


def read_header(path: Path) -> dict[str, Entry]:
    """{name: Entry} of a safetensors file; a damaged header is one Edge0Error naming the file."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except OSError as e:
        raise Edge0Error(f"{path}: cannot read ({e.strerror})") from None
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError, MemoryError, OverflowError):
        raise Edge0Error(f"{path}: not a safetensors file (run `edge0 verify` on the store)") from None
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if e.get("dtype") not in NP_DTYPES:
            raise Edge0Error(f"{path}: tensor {name} has dtype {e.get('dtype')}, which the export does not read")
        begin, end = e["data_offsets"]
        out[name] = Entry(e["dtype"], tuple(e["shape"]), 8 + size + begin, end - begin)
    return out


class Resident:
    """resident.safetensors of a store, read tensor by tensor."""

    def __init__(self, root: Path):
        self.path = store_file(root, RESIDENT)
        if not self.path.is_file():
            raise Edge0Error(f"{self.path}: missing")
        self.entries = read_header(self.path)

    def raw(self, name: str) -> np.ndarray:
        e = self.entries[name]
        return np.fromfile(self.path, dtype=NP_DTYPES[e.dtype], count=e.nbytes // np.dtype(NP_DTYPES[e.dtype]).itemsize,
                           offset=e.begin).reshape(e.shape)

    def f32(self, name: str) -> np.ndarray:
        return as_f32(self.raw(name), self.entries[name].dtype)


class Experts:
    """The routed experts of one MoE layer: pieces of a slice of experts, shaped (n, *piece shape)."""

    def __init__(self, root: Path, manifest: Manifest, entry: LayerEntry):
        self.path = store_file(root, entry.file)
        self.pieces = {p.name: p for p in manifest.pieces}
        self.E = manifest.num_experts
        size = entry.data_offset + self.E * manifest.bundle_stride
        if not self.path.is_file() or os.path.getsize(self.path) < size:
            raise Edge0Error(f"{self.path}: missing or shorter than the manifest says (run `edge0 verify`)")
        with open(self.path, "rb") as f:  # the header of the layer the manifest says (a swapped file is refused)
            check_header(self.path, f.fileno(), manifest.pieces, entry.data_offset, manifest.bundle_stride,
                         layer=entry.layer, crc=entry.header_crc32)
        self.bundles = np.memmap(self.path, np.uint8, "r", offset=entry.data_offset,
                                 shape=(self.E, manifest.bundle_stride))

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        p: Piece = self.pieces[name]
        raw = np.ascontiguousarray(self.bundles[start:stop, p.offset:p.offset + p.nbytes])
        return raw.view(NP_DTYPES[p.dtype]).reshape(stop - start, *p.shape)

    def f32(self, name: str, start: int, stop: int) -> np.ndarray:
        return as_f32(self.piece(name, start, stop), self.pieces[name].dtype)

    def close(self) -> None:
        """Unmap, and leave the page cache to others: an export reads each byte once."""
        del self.bundles
        evict(self.path)
