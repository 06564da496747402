"""Page-cache state of store files: evict with posix_fadvise, probe with mincore."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def evict(path: str | os.PathLike) -> None:
    """Drop a file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_RESIDENT = bytes(i & 1 for i in range(256))  # mincore's byte -> its resident bit (the others are reserved)


class Residency:
    """A read-only mapping of one file, used only to ask mincore which pages are cached."""

    def __init__(self, fd: int, size: int):
        self.size = size
        self.addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0) if size else None
        if self.addr in (None, _MAP_FAILED) and size:
            raise OSError(ctypes.get_errno(), "mmap failed")

    def cached_fraction(self, offset: int, length: int) -> float:
        """Fraction of the pages of [offset, offset+length) resident in the page cache."""
        start = offset - offset % PAGE
        end = min(offset + length, self.size)
        npages = (end - start + PAGE - 1) // PAGE
        if npages <= 0:
            return 1.0
        vec = ctypes.create_string_buffer(npages)
        if _libc.mincore(ctypes.c_void_p(self.addr + start), end - start, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return vec.raw.translate(_RESIDENT).count(1) / npages  # bit 0 of each byte; bytes ops: no numpy per call

    def close(self) -> None:
        if self.addr not in (None, _MAP_FAILED):
            _libc.munmap(ctypes.c_void_p(self.addr), self.size)
            self.addr = None
