"""`edge0 verify STORE`: every byte of a store against its manifest, and the manifest against config.json.

    edge0 verify edge0/model/demo/store

Problems (a damaged or missing file; a manifest that disagrees with config.json) are errors and make the
command fail; files the manifest records no checksum for are warnings (training checkpoints, `*.ckpt/`,
and writers' temporaries aside). The checks of the model
(architecture, MoE layers) come from the caller as `config_check`, so that this module knows no model.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Edge0Error
from .layerfile import check_header
from .manifest import (MANIFEST, LayerEntry, Manifest, file_entry, manifest_checksum, read_json, read_manifest,
                       store_file)

RESIDENT = "resident.safetensors"
TOKENIZERS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one of them makes a tokenizer
BUNDLES_PER_READ = 64
OLD = "store written by an older edge0; re-convert to cover it"
TOKENIZER_READS = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab", "merges",
                   "tiktoken")  # name prefixes of the files the tokenizer loader reads
TRAINED = ("heads-", "lora")  # what `edge0 train` adds to a store: checked at load only when a run uses it


@dataclass
class Report:
    """What a verification found."""

    problems: list[str] = field(default_factory=list)  # damaged, missing or inconsistent: the store is unsound
    warnings: list[str] = field(default_factory=list)  # what could not be checked
    files: int = 0  # files checked in full
    bytes: int = 0  # bytes checked


def verify_store(root: str | os.PathLike, *, config_check=None, progress=None) -> Report:
    """Check every file of the store; a manifest that cannot be read raises Edge0Error.

    config_check: (manifest, config) -> list of problems, for what only the model layer knows.
    progress: a tqdm-like object, updated with bytes checked.
    """
    root = Path(root)
    manifest = read_manifest(root, own_checksum=False)
    report = Report()
    _check_manifest_bytes(root, manifest, report)
    if (root / "config.json").exists() and config_check is not None:
        try:
            report.problems += config_check(manifest, read_json(root / "config.json"))
        except Edge0Error as e:
            report.problems.append(str(e))
    report.problems += missing_files(root)
    for name, want in (manifest.files or {}).items():
        _check_file(root, name, want, report, progress)
    for entry in manifest.layers:
        _check_layer(root, manifest, entry, report, progress)
    report.warnings += uncovered(root, manifest)
    return report


def missing_files(root: Path) -> list[str]:
    """The files every store needs, each named when absent."""
    out = [f"{root / name}: missing" for name in (RESIDENT, "config.json") if not (root / name).exists()]
    if not any((root / name).exists() for name in TOKENIZERS):
        out.append(f"{root / 'tokenizer.json'}: missing (no tokenizer file in the store)")
    return out


def uncovered(root: Path, manifest: Manifest) -> list[str]:
    """A warning for each file of the store that the manifest records no checksum for."""
    known = {MANIFEST, *(manifest.files or {}), *(e.file for e in manifest.layers)}
    old = manifest.files is None or any(e.header_crc32 is None for e in manifest.layers)
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel in known or path.name.startswith(".edge0-") or rel.split("/")[0].endswith(".ckpt"):
            continue  # a writer's temporary, or training state that serving never reads
        if path.name.startswith(TRAINED):
            why = "heads and adapters are recorded when `edge0 train` writes them into the store"
        else:
            why = OLD if old else "added to the store after it was written"
        out.append(f"{path}: no checksum recorded ({why})")
    if old:
        out.append(f"{root / MANIFEST}: no checksum recorded for itself or the layer file headers ({OLD})")
    return out


def _check_manifest_bytes(root: Path, manifest: Manifest, report: Report) -> None:
    path = root / MANIFEST
    ok = manifest_checksum(path.read_bytes())
    if ok is False:
        report.problems.append(f"{path}: checksum mismatch (file damaged or edited)")
    elif ok is None and manifest.format_version >= 2:
        report.problems.append(f"{path}: its own checksum field is missing or damaged")


def _check_file(root: Path, name: str, want: dict, report: Report, progress) -> None:
    try:
        path = store_file(root, name)
    except Edge0Error as e:
        report.problems.append(str(e))
        return
    if not path.exists():
        if not any(p.startswith(f"{path}:") for p in report.problems):  # a required file is named once
            report.problems.append(f"{path}: missing (the manifest lists it)")
        return
    try:
        got = file_entry(path, progress)
    except OSError as e:
        report.problems.append(f"{path}: cannot read ({e.strerror})")
        return
    report.files += 1
    report.bytes += got["size"]
    if got["size"] != want["size"]:
        report.problems.append(f"{path}: {got['size']} bytes, manifest says {want['size']} (truncated or replaced)")
    elif got["crc32"] != want["crc32"]:
        report.problems.append(f"{path}: checksum mismatch (file damaged)")


def _check_layer(root: Path, m: Manifest, entry: LayerEntry, report: Report, progress) -> None:
    """Header bytes, every bundle's checksum and zero padding between bundles, in large sequential reads."""
    try:
        path = store_file(root, entry.file)
        fd = os.open(path, os.O_RDONLY)
    except Edge0Error as e:
        report.problems.append(str(e))
        return
    except OSError as e:
        report.problems.append(f"{path}: missing layer file of the store" if isinstance(e, FileNotFoundError)
                               else f"{path}: cannot open ({e.strerror})")
        return
    try:
        size = os.fstat(fd).st_size
        if size != entry.file_size:
            report.problems.append(f"{path}: {size} bytes, manifest says {entry.file_size} (truncated or damaged file)")
            return
        try:
            check_header(path, fd, m.pieces, entry.data_offset, m.bundle_stride, layer=entry.layer,
                         crc=entry.header_crc32)
        except Edge0Error as e:
            report.problems.append(str(e))
        report.problems += _check_bundles(path, fd, m, entry, progress)
        report.files += 1
        report.bytes += size
    except Edge0Error as e:
        report.problems.append(str(e))
    except OSError as e:
        report.problems.append(f"{path}: read failed ({e.strerror})")
    finally:
        os.close(fd)


def _check_bundles(path: Path, fd: int, m: Manifest, entry: LayerEntry, progress) -> list[str]:
    problems = []
    stride, pad = m.bundle_stride, m.bundle_stride - m.bundle_bytes
    zeros = bytes(pad)
    buf = bytearray(stride * min(BUNDLES_PER_READ, m.num_experts))
    for first in range(0, m.num_experts, BUNDLES_PER_READ):
        n = min(BUNDLES_PER_READ, m.num_experts - first)
        view = memoryview(buf)[:n * stride]
        got = os.preadv(fd, [view], entry.data_offset + first * stride)
        if got != len(view):
            return problems + [f"{path}: short read of experts {first}-{first + n - 1} ({got} of {len(view)} bytes)"]
        for i in range(n):
            e, bundle = first + i, view[i * stride:(i + 1) * stride]
            if f"{zlib.crc32(bundle[:m.bundle_bytes]):08x}" != entry.checksums[e]:
                problems.append(f"{path}: checksum mismatch in the bundle of expert {e} (file damaged)")
            elif pad and bundle[m.bundle_bytes:] != zeros:
                problems.append(f"{path}: padding after the bundle of expert {e} is not zero (file damaged)")
        if progress is not None:
            progress.update(len(view))
    return problems


def check_at_load(root: str | os.PathLike, manifest: Manifest, using=()) -> list[str]:
    """What every load checks (cheap: the small files, read once): the size and crc32 of each file the manifest
    lists but the heads and adapters a run does not use (`using`: the paths of those it does). One Edge0Error for
    the first problem. read_manifest checks the manifest's own checksum; BundleReader the layer files' sizes and
    headers at open.

    Returns warnings for what carries no checksum (a store written by an older edge0).
    """
    root = Path(root)
    report = Report()
    used = {_relative(root, p) for p in using if p is not None}
    for name, want in (manifest.files or {}).items():
        if not Path(name).name.startswith(TRAINED) or name in used:
            _check_file(root, name, want, report, None)
    read = [RESIDENT, "config.json"] + sorted(p.name for p in root.iterdir() if p.name.startswith(TOKENIZER_READS))
    unrecorded = [name for name in read if not manifest.lists(name)]
    for name in unrecorded:
        try:
            store_file(root, name)
        except Edge0Error as e:
            report.problems.append(str(e))
    if report.problems:
        raise Edge0Error(f"{report.problems[0]}; `edge0 verify {root}` checks every file of the store")
    if manifest.files is None:
        return [f"{root / RESIDENT}: no checksum recorded ({OLD}); loaded unchecked"]
    return [f"{root / name}: read at load, but {MANIFEST} records no checksum of it (added after the store was "
            "written)" for name in unrecorded if (root / name).is_file()]


def _relative(root: Path, path) -> str | None:
    """A file's path inside the store, as the manifest lists it; None for one elsewhere."""
    real, base = Path(path).resolve(), root.resolve()
    return real.relative_to(base).as_posix() if base in real.parents else None


def store_bytes(root: Path, manifest: Manifest) -> int:
    """What verify_store reads: the listed files and the layer files' bundles."""
    listed = sum(v["size"] for v in (manifest.files or {}).values())
    return listed + len(manifest.layers) * manifest.num_experts * manifest.bundle_stride

