"""The store manifest `edge0.json`: everything a reader needs without parsing tensors, and a checksum of every
byte of the store.

A store directory holds config.json + tokenizer files, resident.safetensors, experts/layer_NNN.safetensors
and this manifest. Each expert's pieces are one contiguous bundle; bundle e of a layer starts at
`data_offset + e * bundle_stride` in that layer's file.

What covers what (format 2):
- expert layer files: a crc32 per bundle (`layers[].checksums`, what `--verify` checks on every read) and
  one of the safetensors header (`layers[].header_crc32`, bytes [0, data_offset)); the padding between
  bundles is zeros by construction and `edge0 verify` checks that it still is.
- every other file (resident.safetensors, config.json, tokenizer and chat-template files, heads and
  adapters): `files`, {path relative to the store: {"size": bytes, "crc32": 8 hex digits}}. Heads and
  adapters are written after convert: `edge0 train heads` adds its output (and its .json report) to
  `files` when it writes into a store directory, in one atomic rewrite of this manifest under a lock on
  the store directory. A file in the store that `files` does not list is a warning of `edge0 verify`.
- the manifest itself: `manifest_crc32`, its last field, the crc32 of the file's bytes with that field's
  value written as "00000000".
A format 1 manifest (no `files`, no header or manifest checksums) still loads; `edge0 verify` warns that
those files carry no checksum. Format 2 exists so that an older edge0 refuses a new store with a clear line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import Edge0Error
from .atomic import write_atomic

FORMAT_VERSION = 2
MANIFEST = "edge0.json"
ALIGN = 4096
SELF_CRC = "manifest_crc32"
_SELF_CRC = re.compile(rb'"manifest_crc32": "([0-9a-f]{8})"')
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
CHUNK = 1 << 22  # bytes per read when checksumming a whole file


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
    header_crc32: str | None = None  # crc32 of bytes [0, data_offset); None in format 1


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
    files: dict | None = None  # {relative path: {"size", "crc32"}} of every other file; None in format 1

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed expert weights in the store."""
        return self.bundle_bytes * self.num_experts * len(self.layers)

    def lists(self, name: str) -> bool:
        """Whether `files` records `name` (a path relative to the store)."""
        return name in (self.files or {})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as written: format FORMAT_VERSION, ending with its own checksum."""
    raw = {**asdict(manifest), "format_version": FORMAT_VERSION, SELF_CRC: "00000000"}
    text = json.dumps(raw, indent=1).encode()
    head, _, tail = text.rpartition(b'"00000000"')
    return head + f'"{zlib.crc32(text):08x}"'.encode() + tail


def write_manifest(root: Path, manifest: Manifest) -> None:
    write_atomic(Path(root) / MANIFEST, manifest_bytes(manifest))


def manifest_checksum(data: bytes) -> bool | None:
    """Whether the manifest's bytes match its recorded checksum; None when it records none."""
    found = list(_SELF_CRC.finditer(data))
    if not found:
        return None
    m = found[-1]
    blank = data[:m.start(1)] + b"00000000" + data[m.end(1):]
    return f"{zlib.crc32(blank):08x}" == m.group(1).decode()


def file_entry(path: Path, progress=None) -> dict:
    """{"size", "crc32"} of a whole file, as `files` records it; progress.update(n) per chunk if given."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return {"size": size, "crc32": f"{crc:08x}"}


def record_files(root: str | os.PathLike, names: list[str]) -> None:
    """Add (or refresh) files of a store in the manifest's `files`: one atomic rewrite under a lock on the store."""
    root = Path(root)
    with _locked(root):
        manifest = read_manifest(root)
        files = dict(manifest.files or {})
        for name in names:
            files[name] = file_entry(root / name)
        manifest.files = files
        write_manifest(root, manifest)


@contextlib.contextmanager
def _locked(root: Path):
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # two writers into one store must not lose each other's entries
        yield
    finally:
        os.close(fd)


def read_manifest(root: str | os.PathLike, *, own_checksum: bool = True) -> Manifest:
    """Read and check a store's manifest; bad input raises Edge0Error naming the file. own_checksum: a format 2
    manifest whose bytes do not match its recorded checksum is refused (`edge0 verify` reports it instead)."""
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
    raw.pop(SELF_CRC, None)
    try:
        raw["pieces"] = [Piece(**p) for p in raw["pieces"]]
        raw["layers"] = [LayerEntry(**entry) for entry in raw["layers"]]
        manifest = Manifest(**raw)
        _check_types(manifest)
    except (KeyError, TypeError) as e:
        raise Edge0Error(f"{path}: malformed manifest ({e})") from None

    _check_paths(path, manifest)
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
    if not 1 <= manifest.top_k <= manifest.num_experts:
        raise Edge0Error(f"{path}: top_k {manifest.top_k} must be between 1 and num_experts {manifest.num_experts}")
    if own_checksum and version >= 2 and manifest_checksum(path.read_bytes()) is not True:
        raise Edge0Error(f"{path}: checksum mismatch (file damaged or edited); `edge0 verify {root}` checks every "
                         "file of the store")
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
    crcs = [e.header_crc32 for e in m.layers if e.header_crc32 is not None]
    if m.files is not None:
        if not isinstance(m.files, dict) or not all(isinstance(v, dict) for v in m.files.values()):
            raise TypeError("files must map each path to {size, crc32}")
        if not all(type(v.get("size")) is int for v in m.files.values()):
            raise TypeError("a file size is not an integer")
        crcs += [v.get("crc32") for v in m.files.values()]
    if not all(isinstance(c, str) and _HEX8.match(c) for c in crcs):
        raise TypeError("a crc32 is not 8 hex digits")


def read_json(path: Path):
    """Parse a JSON file; a broken one is an Edge0Error naming it (an unreadable one, or bytes that are not UTF-8,
    say so)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Edge0Error(f"{path}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")  # JSON is UTF-8 whatever the locale
    except UnicodeDecodeError as e:
        raise Edge0Error(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise Edge0Error(f"{path}: not valid JSON ({e})") from None


def store_file(root: str | os.PathLike, rel: str) -> Path:
    """root / rel, refused unless it resolves (symbolic links followed) to a path inside the store: a store reads
    only its own files, whatever its manifest or its links say."""
    root = Path(root)
    path = root / rel
    try:
        real, base = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as e:  # a loop of links
        raise Edge0Error(f"{path}: cannot be resolved ({e})") from None
    if real != base and base not in real.parents:
        raise Edge0Error(f"{path}: leads to {real}, outside the store {root} (a store reads only its own files)")
    return path


def _check_paths(path: Path, m: "Manifest") -> None:
    """Every file the manifest names is a relative path that stays inside the store."""
    named = [(f"layers[{i}].file", e.file) for i, e in enumerate(m.layers)]
    named += [("files", name) for name in (m.files or {})]
    for where, rel in named:
        if not isinstance(rel, str):
            raise Edge0Error(f"{path}: malformed manifest ({where} is not a path)")
        parts = PurePosixPath(rel).parts
        if not parts or parts[0] == "/" or ".." in parts:
            raise Edge0Error(f"{path}: {where} '{rel}' is not a path inside the store (a store reads only its own "
                             "files)")
