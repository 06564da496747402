"""A test hook: injected read faults in a BundleReader, to test that every failure of the disk ends in one
clear error and leaves the runtime able to serve the next generation.

Enabled by the environment (for subprocess tests) or by `inject(reader, spec)` (in-process):

    EDGE0_FAULT="eio@5"       the 5th read raises OSError(EIO)
    EDGE0_FAULT="short@5"     the 5th read transfers only the first half of its bytes, and says so
    EDGE0_FAULT="vanish@5"    before the 5th read, that read's layer file is emptied and unlinked (its open
                              descriptor then reads 0 bytes). Destructive: point it at a copy of a store.
    EDGE0_FAULT="eio@5,short@9"   several, each firing once

A read is one transfer: a bundle, or a run of bundles of a whole-layer prefill read; each reader counts
its own from 1, across threads. The variable is read once, when a reader is built; unset, the read path
is untouched.
"""

from __future__ import annotations

import errno
import os
import threading

from ..errors import Edge0Error

ENV = "EDGE0_FAULT"
KINDS = ("eio", "short", "vanish")


def parse(spec: str) -> dict[int, str]:
    """"eio@5,short@9" -> {5: "eio", 9: "short"}."""
    faults: dict[int, str] = {}
    for item in spec.split(","):
        kind, _, at = item.strip().partition("@")
        if kind not in KINDS or not (at.isascii() and at.isdigit() and len(at) <= 18) or int(at) < 1:  # not '²'
            raise Edge0Error(f"{ENV}={spec}: expected KIND@N[,KIND@N...] with KIND one of {', '.join(KINDS)} "
                             "and N >= 1 (the read to fail, counted from 1)")
        faults[int(at)] = kind
    return faults


def install_from_env(reader) -> None:
    """Called by BundleReader once it is built: injects $EDGE0_FAULT when set."""
    spec = os.environ.get(ENV)
    if spec:
        inject(reader, spec)


def inject(reader, spec: str) -> "FaultyTransfer":
    """Make `reader`'s transfers fail as `spec` says (see the module docstring); returns the wrapper (its
    `fired` lists what happened)."""
    wrapper = FaultyTransfer(reader, reader._transfer, parse(spec))
    reader._transfer = wrapper
    return wrapper


class FaultyTransfer:
    """Wraps a reader's transfer(layer, offset, length, iov) -> bytes transferred."""

    def __init__(self, reader, transfer, faults: dict[int, str]):
        self.reader, self.transfer, self.faults = reader, transfer, dict(faults)
        self.count = 0
        self.fired: list[tuple[int, str, int, int]] = []  # (read number, kind, layer, file offset)
        self._lock = threading.Lock()

    def __call__(self, layer: int, offset: int, length: int, iov: list) -> int:
        with self._lock:
            self.count += 1
            kind = self.faults.pop(self.count, None)
            if kind is not None:
                self.fired.append((self.count, kind, layer, offset))
        if kind == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if kind == "short":
            half = length // 2
            return self.transfer(layer, offset, half, _first_bytes(iov, half))
        if kind == "vanish":
            path = self.reader.path(layer)
            os.truncate(path, 0)
            path.unlink()
        return self.transfer(layer, offset, length, iov)


def _first_bytes(iov: list, n: int) -> list:
    """The buffers of iov cut to their first n bytes together."""
    out = []
    for buf in iov:
        if n <= 0:
            break
        view = memoryview(buf).cast("B")
        out.append(view[:n])
        n -= len(out[-1])
    return out
