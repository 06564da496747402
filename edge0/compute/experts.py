"""Expert execution. The math contract of every path: down(silu(gate(x)) * up(x)) through
compute.qmm.gather_qmm on the store's bytes, exactly as mlx-lm's SwitchGLU computes it.

Shapes: T tokens, K routed, U unique experts of a step, D hidden, H expert hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu

from . import expert_math
from .banks import MLX_DTYPES, aligned_zeros, scales_as_stored
from .kernel_choice import current
from .kernels import host_eval
from .qmm import gather_glu, gather_qmm


@dataclass(frozen=True)
class Quant:
    """How the routed expert weights are packed."""

    bits: int
    group_size: int
    mode: str


def switch_glu(x: mx.array, inds: mx.array, bank: dict[str, mx.array], q: Quant, *, owner=None) -> mx.array:
    """x (..., D), inds (..., K) indexing the bank's first axis -> (..., K, D). owner: gather_glu's (a layer's
    executor, whose bank arrays stay the same: the kernel's checks of them run once)."""
    fn = expert_math.current()
    if fn is not None:  # not a plain SwiGLU: the family's own activation, biases (compute/expert_math.py)
        return expert_math.apply(fn, x, inds, bank, q)
    y = gather_glu(x, inds, bank, group_size=q.group_size, bits=q.bits, mode=q.mode, owner=owner)
    if y is not None:  # the edge0 kernel: the three products and the SwiGLU in one node
        return y
    x = mx.expand_dims(x, (-2, -3))
    do_sort = inds.size >= 64  # mlx-lm sorts many rows by expert; keep its choice so outputs match
    idx, inv_order = inds, None
    if do_sort:
        k = inds.shape[-1]
        flat = inds.flatten()
        order = mx.argsort(flat)
        inv_order = mx.argsort(order)
        x, idx = x.flatten(0, -3)[order // k], flat[order]

    def proj(h, name):
        return gather_qmm(h, bank[f"{name}.weight"], bank[f"{name}.scales"], bank.get(f"{name}.biases"), idx,
                          group_size=q.group_size, bits=q.bits, mode=q.mode, sorted_indices=do_sort)

    up = proj(x, "up_proj")
    gate = proj(x, "gate_proj")
    y = proj(swiglu(gate, up), "down_proj")
    if do_sort:
        y = mx.unflatten(y[inv_order], 0, inds.shape)
    return y.squeeze(-2)


def unique_ids(host: np.ndarray) -> np.ndarray:
    """The sorted unique expert ids of routed ids on the host, as intp: MLX's uint32 ids index numpy arrays
    (slot maps, bank bookkeeping) about 5x slower than intp ones, several times per layer and step."""
    if host.size <= 256:  # a decode step's few ids: a set costs less than np.unique's sort
        return np.array(sorted(set(host.ravel().tolist())), dtype=np.intp)
    return np.unique(host).astype(np.intp, copy=False)


def bank_positions(host: np.ndarray, ids: np.ndarray, where) -> mx.array:
    """The routed ids `host` (..., K) as positions in a bank where `where[i]` holds `ids[i]` (ids sorted, unique)."""
    return mx.array(np.asarray(where, dtype=np.uint32)[np.searchsorted(ids, host)])


class ExactExperts:
    """The exact path: deduplicate the routed ids, read their bundles (one preadv each) into fresh
    arrays, gather. The correctness baseline; it syncs once per layer to learn the ids."""

    def __init__(self, reader, layer: int, dtype: mx.Dtype | None):
        m = reader.manifest
        self.reader, self.layer = reader, layer
        self.pieces = m.pieces
        self.num_experts = m.num_experts
        self.quant = Quant(m.quantization["bits"], m.quantization["group_size"], m.quantization.get("mode", "affine"))
        self.dtype = dtype  # compute dtype for scales/biases (None: as stored)

    def load(self, ids: np.ndarray) -> dict[str, mx.array]:
        """Read bundles of experts `ids` into new (U, ...) arrays, one per piece."""
        u = len(ids)
        here = mx.default_stream(mx.cpu)  # (the step synced for the ids: nothing queued before them, no hand-over)
        bank = {p.name: aligned_zeros((u, *p.shape), MLX_DTYPES[p.dtype], stream=here) for p in self.pieces}
        flat = [memoryview(bank[p.name]).cast("B") for p in self.pieces]
        items = [(expert, [f[slot * p.nbytes:(slot + 1) * p.nbytes] for f, p in zip(flat, self.pieces)])
                 for slot, expert in enumerate(ids.tolist())]
        self.reader.pool.read_bundles(self.layer, items)  # all at once on the I/O pool
        del flat, items  # release the buffer exports before MLX reads the arrays
        if self.dtype is not None and not scales_as_stored(self.dtype):
            for name, arr in bank.items():
                if arr.dtype != self.dtype and mx.issubdtype(arr.dtype, mx.floating):
                    bank[name] = arr.astype(self.dtype)
        return bank

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        host_eval(inds)  # SYNC: the routed ids must reach the host to plan the reads
        host = np.array(inds, copy=False)
        return self.compute(x, host, unique_ids(host))

    def compute(self, x: mx.array, host: np.ndarray, ids: np.ndarray) -> mx.array:
        """The routed ids already on the host: read their bundles and gather."""
        bank = self.load(ids)
        return switch_glu(x, bank_positions(host, ids, np.arange(len(ids))), bank, self.quant)


class ResidentExperts:
    """Every expert of a layer already in memory: the compute floor, and the oracle in tests. packable: the bank may
    also keep the kernel's packed copy (its memory allows it: compute/runtime.py packed_copies_fit)."""

    def __init__(self, bank: dict[str, mx.array], quant: Quant, *, packable: bool = False):
        self.bank, self.quant = bank, quant
        self._to_pack = packable and quant.bits == 4  # until packed (at load, compute/qmm.py pack_at_load)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self._to_pack and x.dtype == mx.float32:  # (the kernel's products take float32 activations only)
            self.pack(current().ext)
        return switch_glu(x, inds, self.bank, self.quant)

    def pack(self, ext) -> None:
        """At load (else at the first products): the edge0 kernel's packed copy of these 4-bit experts where their
        memory allows it (packable); the same bits, faster products (csrc/qmv.h Packed). Nothing under MLX's kernel
        (an engine's kernel never changes)."""
        if not self._to_pack:
            return
        self._to_pack = False
        if ext is None:
            return
        for p in ("gate_proj", "up_proj", "down_proj"):
            if f"{p}.biases" in self.bank:
                ext.pack(*(self.bank[f"{p}.{k}"] for k in ("weight", "scales", "biases")), self.quant.group_size)

    @property
    def resident(self) -> "ResidentExperts":
        """The experts a block may run its whole decode step over in one call (model/blocks.py add_norm): these."""
        return self

    def routed(self, x: mx.array, inds: mx.array) -> None:
        """A token's experts were chosen outside __call__ (a fused block step): nothing to record here."""


def bank_of(switch_mlp) -> dict[str, mx.array]:
    """The stacked (E, ...) pieces of an mlx-lm QuantizedSwitchLinear-based SwitchGLU, by piece name."""
    return {f"{proj}.{kind}": switch_mlp[proj][kind] for proj in ("gate_proj", "up_proj", "down_proj")
            for kind in ("weight", "scales", "biases") if kind in switch_mlp[proj]}
