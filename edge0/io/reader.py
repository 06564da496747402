"""Read expert bundles from a store into caller-provided buffers: one preadv per bundle."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import Edge0Error
from .layerfile import check_header
from .manifest import Manifest, read_manifest
from .pagecache import Residency, evict


@dataclass
class ReadStats:
    """Counters of the reads a BundleReader served."""

    reads: int = 0  # bundles read
    bytes: int = 0  # bytes transferred
    cold_reads: float = 0.0  # sum over reads of the fraction of pages not in the page cache before the read

    @property
    def cold_fraction(self) -> float:
        return self.cold_reads / self.reads if self.reads else 0.0


class BundleReader:
    """Open layer files of one store; read bundle (layer, expert) into a list of writable buffers.

    Checks every file's size and header at open (cheap). With verify, checks the crc32 of each
    bundle it reads; without, the read path pays nothing for checksums.
    """

    def __init__(self, root: str | os.PathLike, manifest: Manifest | None = None, *, verify: bool = False, probe: bool = True):
        self.root = Path(root)
        self.manifest = manifest or read_manifest(root)
        self.verify = verify
        self.stats = ReadStats()
        self._fds: dict[int, int] = {}
        self._entries = {entry.layer: entry for entry in self.manifest.layers}
        self._residency: dict[int, Residency] = {}
        m = self.manifest
        try:
            for entry in m.layers:
                path = self.root / entry.file
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise Edge0Error(f"{path}: missing layer file of the store") from None
                self._fds[entry.layer] = fd
                size = os.fstat(fd).st_size
                if size != entry.file_size:
                    raise Edge0Error(f"{path}: {size} bytes, manifest says {entry.file_size} (truncated or damaged file)")
                check_header(path, fd, m.pieces, entry.data_offset, m.bundle_stride)
                if probe:
                    self._residency[entry.layer] = Residency(fd, size)
        except BaseException:
            self.close()
            raise

    def path(self, layer: int) -> Path:
        return self.root / self._entries[layer].file

    def offset(self, layer: int, expert: int) -> int:
        return self._entries[layer].data_offset + expert * self.manifest.bundle_stride

    def read_into(self, layer: int, expert: int, buffers: list) -> int:
        """preadv bundle (layer, expert) into buffers (one writable buffer per piece, manifest order)."""
        m = self.manifest
        offset = self.offset(layer, expert)
        if self._residency:
            self.stats.cold_reads += 1.0 - self._residency[layer].cached_fraction(offset, m.bundle_bytes)
        try:
            n = os.preadv(self._fds[layer], buffers, offset)
        except OSError as e:
            raise Edge0Error(f"{self.path(layer)}: read of expert {expert} failed ({e.strerror})") from None
        if n != m.bundle_bytes:
            raise Edge0Error(f"{self.path(layer)}: short read of expert {expert} ({n} of {m.bundle_bytes} bytes)")
        self.stats.reads += 1
        self.stats.bytes += n
        if self.verify:
            crc = 0
            for b in buffers:
                crc = zlib.crc32(b, crc)
            if f"{crc:08x}" != self._entries[layer].checksums[expert]:
                raise Edge0Error(f"{self.path(layer)}: checksum mismatch in the bundle of expert {expert} (file damaged)")
        return n

    def evict(self) -> None:
        """Drop every layer file of the store from the page cache."""
        for entry in self.manifest.layers:
            evict(self.root / entry.file)

    def close(self) -> None:
        for r in self._residency.values():
            r.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._residency.clear()


def verify_store(root: str | os.PathLike, progress=None) -> list[str]:
    """Check every bundle checksum of a store; returns the problems found (empty when sound)."""
    manifest = read_manifest(root)
    problems: list[str] = []
    reader = None
    try:
        reader = BundleReader(root, manifest, probe=False)
    except Edge0Error as e:
        return [str(e)]
    try:
        buf = bytearray(manifest.bundle_bytes)
        for entry in manifest.layers:
            fd = reader._fds[entry.layer]
            for e, want in enumerate(entry.checksums):
                n = os.preadv(fd, [buf], reader.offset(entry.layer, e))
                got = f"{zlib.crc32(buf[:n]):08x}"
                if n != manifest.bundle_bytes or got != want:
                    problems.append(f"{reader.path(entry.layer)}: checksum mismatch in the bundle of expert {e}")
                if progress is not None:
                    progress.update(1)
    finally:
        reader.close()
    return problems
