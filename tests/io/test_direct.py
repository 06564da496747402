"""--io direct reads straight into the banks' slots (no bounce buffer), the same bytes as pread, and falls back to the
bounce buffer for buffers O_DIRECT cannot take."""

import errno
import os

import mlx.core as mx
import numpy as np
import pytest

from edge0.compute.banks import Bank, Fence
from edge0.compute.experts import ExactExperts
from edge0.io import reader as reader_module
from edge0.io.reader import BundleReader
from edge0.model.demo import DEMO_STORE as DEMO  # its pieces are whole 512-byte blocks


def open_direct():
    r = BundleReader(DEMO, io="direct")
    if r.io != "direct":
        r.close()
        pytest.skip(f"{DEMO} refuses O_DIRECT")
    return r, BundleReader(DEMO)


def as_bytes(arrays: dict) -> dict:
    """A bank's pieces as bytes (bf16 has no numpy dtype)."""
    return {k: np.array(mx.view(a, mx.uint8)) for k, a in arrays.items()}


def test_direct_fills_land_straight_in_slots_with_pread_bytes():
    direct, plain = open_direct()
    m = direct.manifest
    a, b = Bank(m.pieces, 4, Fence()), Bank(m.pieces, 4, Fence())
    layer = m.layers[1].layer
    for slot, expert in enumerate([5, 0, m.num_experts - 1, 7]):
        direct.read_into(layer, expert, a.write_buffers(slot))
        plain.read_into(layer, expert, b.write_buffers(slot))
    got, want = as_bytes(a.arrays), as_bytes(b.arrays)
    assert all(np.array_equal(got[k], want[k]) for k in want) and any(want[k].any() for k in want)
    assert direct.stats.reads == 4 and direct.stats.bounced == 0
    direct.close()
    plain.close()


def test_whole_layer_and_exact_reads_go_straight():
    direct, plain = open_direct()
    m = direct.manifest
    layer = m.layers[0].layer
    a, b = Bank(m.pieces, m.num_experts, Fence()), Bank(m.pieces, m.num_experts, Fence())
    direct.read_layer_into(layer, [a.write_buffers(e) for e in range(m.num_experts)])
    plain.read_layer_into(layer, [b.write_buffers(e) for e in range(m.num_experts)])
    got, want = as_bytes(a.arrays), as_bytes(b.arrays)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    ids = np.array([2, 9, 11])
    loaded = ExactExperts(direct, layer, None).load(ids)
    assert all(np.array_equal(np.array(mx.view(loaded[k], mx.uint8)), want[k][ids]) for k in want)
    assert direct.stats.bounced == 0 and direct.stats.reads > 1
    direct.close()
    plain.close()


def test_unaligned_buffers_go_through_the_bounce_buffer():
    direct, plain = open_direct()
    m = direct.manifest
    raw = [bytearray(p.nbytes + 1) for p in m.pieces]
    shifted = [memoryview(r)[1:] for r in raw]  # one byte past where the allocator put them
    want = [bytearray(p.nbytes) for p in m.pieces]
    direct.read_into(m.layers[0].layer, 3, shifted)
    plain.read_into(m.layers[0].layer, 3, want)
    assert [bytes(s) for s in shifted] == [bytes(w) for w in want]
    assert direct.stats.bounced == 1
    direct.close()
    plain.close()


def test_a_disk_asking_more_alignment_falls_back_to_the_bounce_buffer(monkeypatch, caplog):
    direct, plain = open_direct()
    m = direct.manifest
    preadv, refused = os.preadv, []

    def strict(fd, iov, offset):  # a 4 KiB-sector disk: a 1 KiB scale piece is refused
        if fd in direct._direct.values() and any(len(b) % 4096 for b in iov):
            refused.append(len(iov))
            raise OSError(errno.EINVAL, "Invalid argument")
        return preadv(fd, iov, offset)

    monkeypatch.setattr(reader_module.os, "preadv", strict)
    for expert in (1, 2):
        a, b = Bank(m.pieces, 1, Fence()), Bank(m.pieces, 1, Fence())
        direct.read_into(m.layers[0].layer, expert, a.write_buffers(0))
        plain.read_into(m.layers[0].layer, expert, b.write_buffers(0))
        got, want = as_bytes(a.arrays), as_bytes(b.arrays)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    assert refused == [len(m.pieces)]  # asked once, not again
    assert direct.stats.bounced == 2
    direct.close()
    plain.close()


def test_reads_longer_than_the_bounce_buffer_continue_where_the_last_chunk_stopped(monkeypatch):
    """A whole layer (and a bundle) read through the bounce buffer in many chunks, from an offset past the file's
    start, against the file's own bytes read with plain Python. Every other read here fits in one chunk; so does a
    demo layer in DIRECT_CHUNK, made small here (whole 4 KiB pages, as the real one is) so that each read takes many."""
    direct, _ = open_direct()
    m = direct.manifest
    entry = m.layers[1]
    monkeypatch.setattr(reader_module, "DIRECT_CHUNK", 3 * 4096)
    data = (DEMO / entry.file).read_bytes()

    def want(expert: int) -> list[bytes]:  # the bundle's pieces, back to back from its offset in the file
        at, out = entry.data_offset + expert * m.bundle_stride, []
        for p in m.pieces:
            out.append(data[at:at + p.nbytes])
            at += p.nbytes
        return out

    def shifted() -> list[memoryview]:  # one byte past where the allocator put them: O_DIRECT cannot take them
        return [memoryview(bytearray(p.nbytes + 1))[1:] for p in m.pieces]

    layer = [shifted() for _ in range(m.num_experts)]
    assert direct.read_layer_into(entry.layer, layer) == (m.num_experts - 1) * m.bundle_stride + m.bundle_bytes
    assert m.bundle_stride * m.num_experts > 2 * reader_module.DIRECT_CHUNK and entry.data_offset > 0
    assert [[bytes(b) for b in bufs] for bufs in layer] == [want(e) for e in range(m.num_experts)]
    one = shifted()
    assert m.bundle_bytes > 2 * reader_module.DIRECT_CHUNK
    direct.read_into(entry.layer, m.num_experts - 1, one)  # the last bundle: far from the layer's first chunk
    assert [bytes(b) for b in one] == want(m.num_experts - 1)
    assert direct.stats.bounced == 2
    direct.close()


@pytest.mark.parametrize("io", ["pread", "mmap", "direct"])
def test_a_closed_reader_is_freed_by_refcount_alone(io):
    """The reader kept its transfer as a bound method of itself: a cycle, freed only when the collector ran."""
    import gc
    import weakref

    r = BundleReader(DEMO, io=io)
    r.close()
    alive = weakref.ref(r)
    gc.disable()
    try:
        del r
        assert alive() is None
    finally:
        gc.enable()
