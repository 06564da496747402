"""Read expert bundles from a store into caller-provided buffers: one preadv per bundle.

I/O modes: `pread` (preadv straight into the buffers), `mmap` (copy out of a read-only mapping),
`direct` (O_DIRECT, every byte from the disk: straight into the buffers where each of them, its length and the file
offset are DIRECT_ALIGN-aligned, as the banks' slots are; else into a page-aligned bounce buffer per thread, then
copied; falls back to pread with a notice where the filesystem refuses O_DIRECT).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import Edge0Error
from ..log import log
from .faults import install_from_env
from .layerfile import check_header, round_up
from .manifest import Manifest, read_manifest, store_file
from .pagecache import Residency, evict
from .pool import IO_WORKERS, ReadPool
from .throttle import Throttle

DIRECT_CHUNK = 16 << 20  # most bytes of one O_DIRECT transfer through a thread's bounce buffer
# The alignment O_DIRECT asks of buffers, lengths and offsets: the logical block size, 512 bytes on most disks. A disk
# that asks more refuses (EINVAL) and its reads go through the bounce buffer from then on.
DIRECT_ALIGN = 512


@dataclass
class ReadStats:
    """Counters of the reads a BundleReader served."""

    reads: int = 0  # read calls (a bundle, or a run of bundles for whole-layer reads)
    bytes: int = 0  # bytes transferred
    cold_bytes: float = 0.0  # bytes that were not in the page cache before their read (mincore)
    bounced: int = 0  # --io direct: reads copied through a bounce buffer (their buffers not aligned)
    by_layer: dict = field(default_factory=dict)  # layer -> bytes (a pipeline's --split cost weighs layers by them)

    @property
    def cold_fraction(self) -> float:
        return self.cold_bytes / self.bytes if self.bytes else 0.0


class BundleReader:
    """Open layer files of one store; read bundle (layer, expert) into a list of writable buffers.

    Checks every file's size and header (its checksum, layer and layout) at open (cheap). With verify, checks the
    crc32 of each bundle it reads; without, the read path pays nothing for checksums.
    """

    IOV_MAX = 1024  # iovecs per preadv (Linux's limit)

    def __init__(self, root: str | os.PathLike, manifest: Manifest | None = None, *, verify: bool = False,
                 probe: bool = True, io: str = "pread", throttle_mbps: float | None = None, workers: int = IO_WORKERS):
        self.root = Path(root)
        self.workers = workers  # threads of the I/O pool every executor reads through
        self._pool: ReadPool | None = None
        self.throttle = Throttle(throttle_mbps) if throttle_mbps else None
        self.manifest = manifest or read_manifest(root)
        self.verify = verify
        self.io = io
        self._lock = threading.Lock()  # counters are updated from I/O threads
        self._maps: dict[int, mmap.mmap] = {}
        self._direct: dict[int, int] = {}
        self._bounce = threading.local()
        self._straight = True  # --io direct: aligned buffers are read into straight (until the disk refuses)
        self.stats = ReadStats()
        self._fds: dict[int, int] = {}
        self._entries = {entry.layer: entry for entry in self.manifest.layers}
        self._residency: dict[int, Residency] = {}
        m = self.manifest
        try:
            for entry in m.layers:
                path = store_file(self.root, entry.file)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise Edge0Error(f"{path}: missing layer file of the store") from None
                except OSError as e:
                    raise Edge0Error(f"{path}: cannot open ({e.strerror})") from None
                self._fds[entry.layer] = fd
                size = os.fstat(fd).st_size
                if size != entry.file_size:
                    raise Edge0Error(f"{path}: {size} bytes, manifest says {entry.file_size} (truncated or damaged file)")
                check_header(path, fd, m.pieces, entry.data_offset, m.bundle_stride, layer=entry.layer,
                             crc=entry.header_crc32)
                if probe:
                    self._residency[entry.layer] = Residency(fd, size)
                if io == "mmap":
                    self._maps[entry.layer] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                elif self.io == "direct":  # once refused, not asked again for every layer
                    try:
                        self._direct[entry.layer] = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    except OSError as e:
                        log.info(f"--io direct: {path.parent} refuses O_DIRECT ({e.strerror}); reading with pread")
                        self.io = "pread"
            install_from_env(self)  # the fault-injection test hook; nothing when $EDGE0_FAULT is unset
        except BaseException:
            self.close()
            raise

    @property
    def pool(self) -> ReadPool:
        """The store's I/O pool (io/pool.py), started at its first read."""
        if self._pool is None:
            self._pool = ReadPool(self, self.workers)
        return self._pool

    def path(self, layer: int) -> Path:
        return self.root / self._entries[layer].file

    def offset(self, layer: int, expert: int) -> int:
        return self._entries[layer].data_offset + expert * self.manifest.bundle_stride

    @property
    def sees_cache(self) -> bool:
        """Whether a read from the page cache is a mere copy this reader can tell apart (a mincore probe,
        buffered I/O, no throttle): else every read is counted cold (--io direct) or paced (--io-throttle)."""
        return self.io != "direct" and bool(self._residency) and self.throttle is None

    def cached(self, layer: int, expert: int) -> bool:
        """Whether the whole bundle is in the page cache (mincore); never with --io direct or without a probe."""
        if self.io == "direct" or not self._residency:
            return False
        return self._residency[layer].cached_fraction(self.offset(layer, expert), self.manifest.bundle_bytes) == 1.0

    def read_into(self, layer: int, expert: int, buffers: list) -> int:
        """Read bundle (layer, expert) into buffers (one writable buffer per piece, manifest order)."""
        return self.read_bundle(layer, expert, buffers)[0]

    def read_bundle(self, layer: int, expert: int, buffers: list, *, cached: bool = False) -> tuple[int, float]:
        """As read_into; returns (bytes read, fraction of them that were not in the page cache). cached: the caller
        has just found the whole bundle in the page cache (`cached`), so it is not probed again."""
        m = self.manifest
        n, cold = self._read(layer, self.offset(layer, expert), m.bundle_bytes, buffers, f"expert {expert}",
                             cached=cached)
        if self.verify:
            self._check(layer, expert, buffers)
        return n, cold / n

    def _check(self, layer: int, expert: int, buffers: list) -> None:
        if crc32_of(buffers) != self._entries[layer].checksums[expert]:
            raise Edge0Error(f"{self.path(layer)}: checksum mismatch in the bundle of expert {expert} (file damaged)")

    def read_layer_into(self, layer: int, buffers: list[list]) -> int:
        """Read every bundle of a layer (buffers[e] for expert e) in as few large reads as IOV_MAX allows."""
        m = self.manifest
        gap = m.bundle_stride - m.bundle_bytes  # a page-aligned pad, so that the reads can go straight (--io direct)
        pad = memoryview(mmap.mmap(-1, gap))[:gap] if gap else None
        per = len(m.pieces) + (pad is not None)
        step = max(1, self.IOV_MAX // per)
        total = 0
        for first in range(0, m.num_experts, step):
            last = min(first + step, m.num_experts)
            iov = []
            for e in range(first, last):
                iov += list(buffers[e])
                if pad is not None and e + 1 < last:
                    iov.append(pad)
            length = (last - first - 1) * m.bundle_stride + m.bundle_bytes
            total += self._read(layer, self.offset(layer, first), length, iov, f"experts {first}-{last - 1}")[0]
        if self.verify:
            for e in range(m.num_experts):
                self._check(layer, e, buffers[e])
        return total

    def _read(self, layer: int, offset: int, length: int, iov: list, what: str,
              cached: bool = False) -> tuple[int, float]:
        """One read of [offset, offset+length) into iov; returns (bytes, cold bytes by mincore before it, none where
        the caller found it `cached`)."""
        cold = 0.0
        started = time.perf_counter()
        if self.io == "direct":
            cold = float(length)  # O_DIRECT bypasses the page cache: every byte comes from the disk
        elif self._residency and not cached:
            cold = (1.0 - self._residency[layer].cached_fraction(offset, length)) * length
        try:
            n = self._transfer(layer, offset, length, iov)
        except OSError as e:
            raise Edge0Error(f"{self.path(layer)}: read of {what} failed ({e.strerror})") from None
        if n != length:
            size = os.fstat(self._fds[layer]).st_size
            raise Edge0Error(f"{self.path(layer)}: short read of {what}: expected {length} bytes, got {n} (the file "
                             f"is {size} bytes now, the manifest says {self._entries[layer].file_size})")
        if self.throttle is not None:
            self.throttle.pace(n, started)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes += n
            self.stats.by_layer[layer] = self.stats.by_layer.get(layer, 0) + n
            self.stats.cold_bytes += cold
        return n, cold

    def _transfer(self, layer: int, offset: int, length: int, iov: list) -> int:
        """Bytes moved into iov by this reader's --io (a method, not a bound method kept on the reader: that was a
        reference cycle, so a closed reader waited for the garbage collector)."""
        if self.io == "direct":
            return self._read_direct(layer, offset, length, iov)
        if self.io == "mmap":
            return self._transfer_mmap(layer, offset, length, iov)
        return self._transfer_pread(layer, offset, length, iov)

    def _transfer_pread(self, layer: int, offset: int, length: int, iov: list) -> int:
        return os.preadv(self._fds[layer], iov, offset)

    def _transfer_mmap(self, layer: int, offset: int, length: int, iov: list) -> int:
        size = os.fstat(self._fds[layer]).st_size  # a mapping read past a shrunk file's end is SIGBUS, not an error
        return _scatter(memoryview(self._maps[layer])[offset:max(offset, min(offset + length, size))], iov)

    def _read_direct(self, layer: int, offset: int, length: int, iov: list) -> int:
        """O_DIRECT straight into iov where every buffer is aligned; else through this thread's aligned bounce buffer,
        at most DIRECT_CHUNK bytes at a time (a whole-layer read on any pool thread must not give every thread a
        layer-sized buffer), then copied."""
        if self._straight and offset % DIRECT_ALIGN == 0 and aligned(iov):
            try:
                return os.preadv(self._direct[layer], iov, offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._straight = False
                log.info(f"--io direct: {self.path(layer).parent} asks more than {DIRECT_ALIGN}-byte alignment; "
                         "reading through a bounce buffer")
        with self._lock:
            self.stats.bounced += 1
        size = min(round_up(length), DIRECT_CHUNK)
        bounce = getattr(self._bounce, "buf", None)
        if bounce is None or len(bounce) < size:
            bounce = self._bounce.buf = mmap.mmap(-1, size)  # anonymous mappings are page-aligned
        out, done = _Scatter(iov), 0
        while done < length:  # offset + done stays aligned: every chunk but the last is whole
            want = min(length - done, size)
            n = min(os.preadv(self._direct[layer], [memoryview(bounce)[:round_up(want)]], offset + done), want)
            out.write(memoryview(bounce)[:n])
            done += n
            if n < want:
                break
        return done

    def evict(self) -> None:
        """Drop every layer file of the store from the page cache."""
        for entry in self.manifest.layers:
            evict(self.root / entry.file)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()  # no worker reads a descriptor closed below
            self._pool = None
        for mm in self._maps.values():
            mm.close()
        for fd in self._direct.values():
            os.close(fd)
        self._maps.clear()
        self._direct.clear()
        for r in self._residency.values():
            r.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._residency.clear()


def aligned(iov: list) -> bool:
    """Whether every buffer starts and ends on DIRECT_ALIGN bytes (O_DIRECT can read into it straight)."""
    for b in iov:
        a = np.frombuffer(b, dtype=np.uint8)
        if a.size % DIRECT_ALIGN or a.ctypes.data % DIRECT_ALIGN:
            return False
    return True


class _Scatter:
    """Consecutive writes into a list of buffers, continuing where the last write stopped. The copies are
    numpy's, which release the GIL: a memoryview copy of a bundle would hold it for a millisecond, and the
    graph-building thread would wait for it."""

    def __init__(self, iov: list):
        self.iov = [np.frombuffer(b, dtype=np.uint8) for b in iov]
        self.i, self.at = 0, 0

    def write(self, src: memoryview) -> None:
        src = np.frombuffer(src, dtype=np.uint8)
        pos = 0
        while pos < len(src) and self.i < len(self.iov):
            buf = self.iov[self.i]
            n = min(len(buf) - self.at, len(src) - pos)
            buf[self.at:self.at + n] = src[pos:pos + n]
            pos += n
            self.at += n
            if self.at == len(buf):
                self.i, self.at = self.i + 1, 0


def _scatter(src: memoryview, iov: list) -> int:
    """Copy src into consecutive buffers; returns bytes copied."""
    out = _Scatter(iov)
    out.write(src)
    return min(len(src), sum(len(b) for b in out.iov))


def crc32_of(buffers: list) -> str:
    """The manifest's checksum of a bundle held in consecutive buffers (8 hex digits)."""
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return f"{crc:08x}"
