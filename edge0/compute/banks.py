"""Slot banks: persistent, evaluated MLX arrays that I/O writes expert bundles into, in place.

The rule that keeps this sound, written once: MLX does not see writes made through a memoryview,
so a slot may be written only when every graph that reads it has been evaluated. The Fence counts
evaluations; a bank remembers, per slot, the fence epoch of the last graph built to read it (a gather
reads only the slots its indices name); `Bank.write_buffers` refuses to hand out a slot's buffers
otherwise, and is the only way to them.

Shapes: S slots, and per piece the expert's own shape (e.g. (H, D/8) uint32 for a 4-bit weight).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from ..errors import BankBusy
from ..io.reader import DIRECT_ALIGN
from .kernel_choice import current

MLX_DTYPES = {"U32": mx.uint32, "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U8": mx.uint8}


_alloc = threading.local()  # MLX's streams belong to the thread that made them (the server's generations have their own)


def alloc_stream():
    """The calling thread's CPU stream for allocating banks: one of their own (its own thread), so that the layers of a
    prompt queued on the default stream compute while a prefill bank is allocated, and the decode banks are allocated
    during the prompt (on the default stream an allocation waits for everything queued before it)."""
    stream = getattr(_alloc, "stream", None)
    if stream is None:
        stream = _alloc.stream = mx.new_stream(mx.cpu)
    return stream


def alignable(shape, dtype: mx.Dtype) -> bool:
    """Whether a slot of an (S, ...) array is a whole number of DIRECT_ALIGN bytes, so that reads may go straight."""
    return (int(np.prod(shape[1:])) * dtype.size) % DIRECT_ALIGN == 0


def zeroed(nbytes: int) -> mx.array:
    """nbytes + DIRECT_ALIGN zero bytes, queued on the allocation stream (aligned_zeros makes its view)."""
    with mx.stream(alloc_stream()):
        return mx.zeros((nbytes + DIRECT_ALIGN,), dtype=mx.uint8)


def aligned_zeros(shape, dtype: mx.Dtype, base: mx.array | None = None, stream=None) -> mx.array:
    """An evaluated array of zeros whose memory starts on DIRECT_ALIGN bytes (MLX's own allocations start a few bytes
    past a page), so that --io direct reads land in its slots without a bounce buffer (io/reader.py): a view into a
    buffer DIRECT_ALIGN bytes larger (`base`, from zeroed, where one was queued already), row-contiguous, which MLX
    and the edge0 kernel compute on as on any other array. Where a slot is not a whole number of DIRECT_ALIGN bytes
    no read could go straight: MLX's zeros. On `stream`, else the calling thread's allocation stream."""
    with mx.stream(stream or alloc_stream()):
        if not alignable(shape, dtype):
            out = mx.zeros(shape, dtype=dtype)
        else:
            nbytes = int(np.prod(shape)) * dtype.size
            base = zeroed(nbytes) if base is None else base
            mx.eval(base)
            at = -np.frombuffer(memoryview(base), dtype=np.uint8).ctypes.data % DIRECT_ALIGN
            out = mx.view(base[at:at + nbytes], dtype).reshape(shape)
        mx.eval(out)
    return out


def aligned_bytes(shape) -> np.ndarray:
    """numpy's zeros of uint8 starting on DIRECT_ALIGN bytes (a bank's staging rows, which reads land in too)."""
    raw = np.zeros(int(np.prod(shape)) + DIRECT_ALIGN, dtype=np.uint8)
    at = -raw.ctypes.data % DIRECT_ALIGN
    return raw[at:at + raw.size - DIRECT_ALIGN].reshape(shape)


def scales_as_stored(compute_dtype) -> bool:
    """Whether bf16 scales and biases stay bf16 under a float32 compute dtype: the edge0 kernel, building the graphs
    now, widens them where it uses them (half the bytes to hold and to stream); MLX's kernels get float32 copies."""
    return compute_dtype is not None and compute_dtype == mx.float32 and current().edge0


class Fence:
    """Epochs of graph building. `sync()` is called right after an mx.eval that evaluated everything
    built so far (the model's graph is one chain: each layer's output depends on every earlier layer). Decode that
    builds a step while the one before evaluates (decode/step.py) begins each step's epoch with `advance()` and
    learns what is evaluated from the values the host takes (`complete`)."""

    def __init__(self):
        self.epoch = 0  # the graph being built now
        self.completed = -1  # every graph built in epochs <= completed has been evaluated

    def sync(self) -> None:
        self.completed = self.epoch
        self.epoch += 1

    def advance(self) -> int:
        """A new epoch, the graphs built before it still evaluating; returns the epoch that ended."""
        self.epoch += 1
        return self.epoch - 1

    def complete(self, epoch: int) -> None:
        """Every graph built in epochs <= epoch has been evaluated."""
        self.completed = max(self.completed, min(epoch, self.epoch - 1))


class Bank:
    """S slots of expert bundles, one (S, ...) array per piece, plus which expert each slot holds.

    With a compute dtype wider than the stored one (float32 on CPU, bf16 on disk) and MLX's kernels, the
    float pieces (scales, biases) are kept widened: their bytes land in a per-slot staging area and
    `commit` widens them into the bank with numpy, so no MLX cast runs per step and weights still go
    straight from disk into the bank. The edge0 kernel reads them as stored: no staging, no widening.
    """

    def __init__(self, pieces, slots: int, fence: Fence, compute_dtype: mx.Dtype | None = None,
                 pack_group_size: int | None = None):
        self.pieces, self.slots, self.fence = pieces, slots, fence
        self.pack_group_size = pack_group_size  # 4-bit experts of this group size: keep the kernel's packed copy
        self._packed: list[tuple[mx.array, mx.array, mx.array]] = []  # (w, scales, biases) with a packed copy
        self.widen = self.widened(pieces, compute_dtype)
        self._arrays: dict[str, mx.array] | None = None  # allocated on first use (decode banks wait for decode)
        self._bases: dict[str, mx.array] = {}  # their memory, queued by prepare() and not yet used
        self._bases_thread = None  # the thread that queued them (its stream computes them)
        self._reserved = {}  # projection -> its packed copy's zero memory, being made (prepare), taken by _pack
        self._index = {p.name: i for i, p in enumerate(pieces)}
        widened = [p for p, w in zip(pieces, self.widen) if w]
        self._stage_bytes = sum(p.nbytes for p in widened)
        self._stage_at = {}  # piece index -> byte offset inside a slot's staging row
        at = 0
        for i, (p, w) in enumerate(zip(pieces, self.widen)):
            if w:
                self._stage_at[i] = at
                at += p.nbytes
        self.holds = np.full(slots, -1, dtype=np.int64)  # expert id (or cache key) in each slot, -1 empty
        self.last_read = np.full(slots, -1, dtype=np.int64)  # per slot: fence epoch of the last graph reading it
        self.nbytes = slots * self.slot_bytes(pieces, compute_dtype)

    @property
    def arrays(self) -> dict[str, mx.array]:
        if self._arrays is None:  # on the graph-building thread: write_buffers and read come first
            if self._bases_thread != threading.get_ident():  # queued on another thread's stream: not this thread's
                self._bases = {}
            self._arrays = {p.name: aligned_zeros((self.slots, *p.shape), self._dtype(p, w), self._bases.get(p.name))
                            for p, w in zip(self.pieces, self.widen)}
            self._bases = {}
            self._flat = [memoryview(self._arrays[p.name]).cast("B") for p in self.pieces]
            self._stage = aligned_bytes((self.slots, self._stage_bytes)) if self._stage_bytes else None
            self._views = [self._slot_views(slot) for slot in range(self.slots)]  # made once: fills are per token
            # commit's views, made once: the staged bf16 words and, per widened piece, (first word, words, (S, n) dst)
            self._stage16 = self._stage.view(np.uint16) if self._stage_bytes else None
            self._widen_views = [(self._stage_at[i] // 2, p.nbytes // 2,
                                  np.frombuffer(self._flat[i], dtype=np.uint32).reshape(self.slots, -1))
                                 for i, p in enumerate(self.pieces) if self.widen[i]]
            self._pack()
        return self._arrays

    @staticmethod
    def _dtype(piece, widened: bool) -> mx.Dtype:
        return mx.float32 if widened else MLX_DTYPES[piece.dtype]

    def prepare(self) -> None:
        """Queue the zeros of the bank's memory on the allocation stream, and start its packed copies (_reserve), to
        be taken by its first use (`arrays`): a decode bank's memory is written while the prompt computes, not at its
        first use (the prompt's last token, which would otherwise wait for it). Once."""
        if self._arrays is not None or self._bases or self._reserved:
            return
        for p, w in zip(self.pieces, self.widen):
            shape, dtype = (self.slots, *p.shape), self._dtype(p, w)
            if alignable(shape, dtype):
                self._bases[p.name] = zeroed(int(np.prod(shape)) * dtype.size)
        self._bases_thread = threading.get_ident()
        mx.async_eval(list(self._bases.values()))
        self._reserve()

    def _reserve(self) -> None:
        """Start the packed copies' zero memory (the extension's reserve_pack, on threads of its own), taken by the
        bank's first use (_pack), which would otherwise fault in every page of them itself."""
        ext = current().ext if self.pack_group_size else None
        if ext is None:
            return
        for proj in self._projections():
            weight, scales = (self.pieces[self._index[f"{proj}.{part}"]] for part in ("weight", "scales"))
            bf16 = self._dtype(scales, self.widen[self._index[scales.name]]) == mx.bfloat16
            reserved = ext.reserve_pack(self.slots, weight.shape[0], weight.shape[1] * 8, self.pack_group_size, bf16)
            if reserved is not None:
                self._reserved[proj] = reserved

    def _projections(self) -> list[str]:
        """The projections (gate_proj, ...) whose weight, scales and biases the bank holds: those a copy may pack."""
        names = {p.name.rsplit(".", 1)[0] for p in self.pieces}
        return sorted(n for n in names if all(f"{n}.{k}" in self._index for k in ("weight", "scales", "biases")))

    def _pack(self) -> None:
        """The edge0 kernel's packed copy of each projection whose layout pays for it (csrc/qmv.h Packed: the same
        bits, faster products), kept up to date slot by slot as fills land (commit): bank products then run as fast
        as resident experts'. Costs the packed projections' bytes again; the runtime asks for it where they fit."""
        ext = current().ext if self.pack_group_size else None
        if ext is None:
            return
        a = self._arrays
        for proj in self._projections():
            triple = tuple(a[f"{proj}.{k}"] for k in ("weight", "scales", "biases"))
            if ext.pack(*triple, self.pack_group_size, zeros=True, reserved=self._reserved.pop(proj, None)):  # new
                self._packed.append(triple)
        self._ext = ext  # commit runs on I/O threads, outside the graph-building thread's kernel context

    @property
    def packed(self) -> int:
        """How many of the bank's projections keep a packed copy."""
        return len(self._packed)

    @property
    def allocated(self) -> bool:
        return self._arrays is not None

    @property
    def prepared(self) -> bool:
        """Its memory allocated, or queued (prepare)."""
        return self.allocated or bool(self._bases)

    @staticmethod
    def widened(pieces, compute_dtype) -> list[bool]:
        """Which pieces the bank keeps as float32: bf16 ones under a float32 compute dtype, unless the edge0 kernel
        builds the graphs (it reads bf16 scales and biases as stored: fewer bytes to hold and to stream)."""
        widen = compute_dtype is not None and compute_dtype == mx.float32 and not scales_as_stored(compute_dtype)
        return [widen and p.dtype == "BF16" for p in pieces]

    @classmethod
    def slot_bytes(cls, pieces, compute_dtype) -> int:
        """Memory one slot takes: the stored bytes, plus the widened copy and its staging for bf16 pieces."""
        return sum(p.nbytes * (3 if w else 1) for p, w in zip(pieces, cls.widened(pieces, compute_dtype)))

    @property
    def writable(self) -> bool:
        """Every slot writable (no graph built on the bank is pending)."""
        return bool(self.writable_slots().all())

    def writable_slots(self) -> np.ndarray:
        return self.last_read <= self.fence.completed  # (S,) bool

    def write_buffers(self, slot: int) -> list[memoryview]:
        """Writable views of one slot's pieces (stored bytes), in manifest order; only while no pending
        graph reads the slot. Call `commit` after the read lands."""
        self.arrays  # allocate on first use
        if self.last_read[slot] > self.fence.completed:
            raise BankBusy(f"slot {slot} is read by graph epoch {self.last_read[slot]}, evaluated only up to "
                           f"{self.fence.completed}")
        return self._views[slot]

    def _slot_views(self, slot: int) -> list[memoryview]:
        out = []
        for i, (f, p) in enumerate(zip(self._flat, self.pieces)):
            if self.widen[i]:
                at = self._stage_at[i]
                out.append(memoryview(self._stage[slot, at:at + p.nbytes]))
            else:
                out.append(f[slot * p.nbytes:(slot + 1) * p.nbytes])
        return out

    def commit(self, slots) -> None:
        """The bytes of `slots` landed: widen the staged bf16 pieces into the float32 bank (numpy on the bank's
        memory, no MLX op) and bring the packed copies up to date (on the thread the read ran on)."""
        if self._packed:
            at = [int(x) for x in np.asarray(slots).reshape(-1)]
            for w, sc, b in self._packed:
                self._ext.repack(w, sc, b, self.pack_group_size, at)
        if not self._stage_bytes:
            return
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) <= 2:  # a slot or two (most commits): shifts straight into the bank, no temporaries
            for slot in slots.tolist():
                row = self._stage16[slot]
                for at, n, dst in self._widen_views:  # bf16 -> f32 is exact: the high half of the word
                    np.left_shift(row[at:at + n], 16, out=dst[slot], dtype=np.uint32)
            return
        rows = self._stage16[slots]
        for at, n, dst in self._widen_views:
            dst[slots] = rows[:, at:at + n].astype(np.uint32) << 16

    def read(self, slots=None) -> dict[str, mx.array]:
        """The bank's arrays for a graph about to be built that reads `slots` (default all): marks them read
        in this epoch."""
        arrays = self.arrays
        if slots is None:
            self.last_read[:] = self.fence.epoch
        else:
            self.last_read[slots] = self.fence.epoch
        return arrays

    def address(self, name: str) -> int:
        """Base address of a piece's buffer (tests check fills happen in place)."""
        self.arrays
        return np.frombuffer(self._flat[[p.name for p in self.pieces].index(name)], dtype=np.uint8).ctypes.data
