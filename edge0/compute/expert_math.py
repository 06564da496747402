"""Routed experts that are not a plain SwiGLU: biases, other activations, two-layer MLPs.

The executors compute every routed product through experts.switch_glu on bank pieces named as the
store names them. For most families that is mlx-lm's SwitchGLU with SwiGLU and no biases, Edge0's
fast path. A family whose experts differ (gpt-oss: biases and a clamped SwiGLU; Nemotron-H: a
SwitchMLP with ReLU^2; Step-3.5: clamped per layer; Granite: an 8-bit down projection) is computed
here, op for op as mlx-lm's SwitchGLU / SwitchMLP with QuantizedSwitchLinear do, with the family's
own activation module. The
MoE block's expert adapter (model/experts.py) makes its ExpertFn current while its executor builds
the graph, as compute/kernel_choice.py does for the kernel choice, so no executor needs to know the family.

Shapes: T tokens (any leading dims), K routed, D hidden, H expert hidden.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from .qmm import gather_qmm

GLU_PROJS = ("gate_proj", "up_proj", "down_proj")
MLP_PROJS = ("fc1", "fc2")


@dataclass(frozen=True)
class ExpertFn:
    """How one MoE layer's experts combine their projections."""

    kind: str  # "glu": down(act(up(x), gate(x))) as SwitchGLU; "mlp": fc2(act(fc1(x))) as SwitchMLP
    activation: Callable  # the family's own module: glu act(x_up, x_gate), mlp act(h)


_active: ContextVar[ExpertFn | None] = ContextVar("edge0_expert_fn", default=None)


def current() -> ExpertFn | None:
    """The ExpertFn of the layer whose graph is being built; None for a plain SwiGLU."""
    return _active.get()


@contextmanager
def using(fn: ExpertFn | None):
    token = _active.set(fn)
    try:
        yield
    finally:
        _active.reset(token)


def piece_bits(w: mx.array, scales: mx.array, q) -> int:
    """Bits of one projection: mixed-precision checkpoints (mlx-lm's quant predicates) keep some at 8."""
    if q.mode != "affine":
        return q.bits
    return w.shape[-1] * 32 // (scales.shape[-1] * q.group_size)


def apply(fn: ExpertFn, x: mx.array, inds: mx.array, bank: dict[str, mx.array], q) -> mx.array:
    """x (..., D), inds (..., K) indexing the bank's first axis -> (..., K, D), as mlx-lm computes it."""
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
        w, scales = bank[f"{name}.weight"], bank[f"{name}.scales"]
        y = gather_qmm(h, w, scales, bank.get(f"{name}.biases"), idx, group_size=q.group_size,
                       bits=piece_bits(w, scales, q), mode=q.mode, sorted_indices=do_sort)
        bias = bank.get(f"{name}.bias")  # (E, N) per-expert output bias
        return y if bias is None else y + mx.expand_dims(bias[idx], -2)

    if fn.kind == "glu":
        up = proj(x, "up_proj")
        gate = proj(x, "gate_proj")
        y = proj(fn.activation(up, gate), "down_proj")
    else:
        y = proj(fn.activation(proj(x, "fc1")), "fc2")
    if do_sort:
        y = mx.unflatten(y[inv_order], 0, inds.shape)
    return y.squeeze(-2)
