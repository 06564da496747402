"""The one call site of every quantized product (routed experts and dense quantized linears), so a
faster kernel replaces MLX's in one place.

The kernel is the one current for the graph being built (compute/kernel_choice.py). Products the edge0
kernel does not cover (other bits or modes, bf16 activations, several rows per expert in one x row)
run on MLX's kernels in either case.
Shapes: R output rows, D inputs, N outputs, K routed, E experts.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .kernel_choice import current, remembered

GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (mx.float32, mx.bfloat16)  # bfloat16 as stored: the kernel widens each where it uses it, exactly


def fits(ext, d: int, x_dtype, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int,
         bits: int, mode: str) -> bool:
    """Whether the edge0 kernel covers x (..., d) of x_dtype times this packed W."""
    return (bits in (4, 8) and mode == "affine" and biases is not None and group_size in GROUP_SIZES
            and x_dtype == mx.float32 and scales.dtype in SCALE_DTYPES and biases.dtype == scales.dtype
            and w.dtype == mx.uint32 and d % 64 == 0 and w.shape[-1] * 32 == d * bits and d % group_size == 0
            and d // group_size <= ext.MAX_GROUPS)


def gather_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, indices: mx.array, *,
               group_size: int, bits: int, mode: str, sorted_indices: bool = False) -> mx.array:
    """x @ W[indices].T for packed W (E, N, D*bits/32); x (..., M, D), indices (...): (..., M, N).

    The same product as mlx-lm's SwitchLinear (mx.gather_qmm with rhs_indices, transpose=True).
    """
    ext = current().ext
    if (ext is not None and x.ndim >= 2 and x.shape[-2] == 1 and w.ndim == 3
            and fits(ext, x.shape[-1], x.dtype, w, scales, biases, group_size, bits, mode)):
        return _edge0_gather(ext, x, w, scales, biases, indices, group_size)
    return mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, group_size=group_size,
                         bits=bits, mode=mode, sorted_indices=sorted_indices)


def _edge0_gather(ext, x, w, scales, biases, indices, group_size):
    bx, bi = tuple(x.shape[:-2]), tuple(indices.shape)
    bs = tuple(mx.broadcast_shapes(bx, bi)) if bx != bi else bi  # batch shape of the output
    return ext.qmv(_x_rows(x, bx, bs), w, scales, biases, indices if bi == bs else mx.broadcast_to(indices, bs),
                    group_size, (*bs, 1, w.shape[-2]))


def _x_rows(x, bx, bs):
    """x (*bx, 1, D) as the kernel reads it for output rows bs: as is when each output row has its x row
    or when the K experts of a token share one (bx == bs[:-1] + (1,)), else broadcast (a view)."""
    bx = (1,) * (len(bs) - len(bx)) + bx
    if bx == bs or (bs and bx == bs[:-1] + (1,)):
        return x
    return mx.broadcast_to(x.reshape(*bx, 1, x.shape[-1]), (*bs, 1, x.shape[-1]))


def gather_glu(x: mx.array, indices: mx.array, bank: dict[str, mx.array], *, group_size: int, bits: int,
               mode: str, owner=None) -> mx.array | None:
    """down(swiglu(gate(x), up(x))) of the routed experts in one node of the edge0 kernel, x (..., D) and
    indices (..., K) -> (..., K, D); None where that kernel does not cover it (the caller then runs the
    three gather_qmm). owner: an object that keeps the kernel's checks of this bank while its arrays stay the same
    (a layer's executor, at every step), so they run once."""
    if tuple(indices.shape[:-1]) != tuple(x.shape[:-1]):
        return None
    ext = current().ext
    if owner is None:
        run = glu_node(ext, bank, x, group_size, bits, mode)
    else:
        run = remembered(owner, "_edge0_glu", tuple(bank.values()), (ext, x.shape[-1], x.dtype),
                         lambda: glu_node(ext, bank, x, group_size, bits, mode))
    return run(x, indices) if run is not None else None


def glu_node(ext, bank: dict[str, mx.array], x: mx.array, group_size: int, bits: int, mode: str):
    """(x, indices) -> gather_glu's one node on this bank, for inputs like x (indices (..., K) over x's leading
    axes); None where the edge0 kernel does not cover them."""
    parts = glu_parts(ext, bank, x, group_size, bits, mode) if ext is not None else None
    if parts is None:
        return None
    width = parts[2][0].shape[-2]  # the down projection's outputs
    return lambda x, indices: ext.glu(x, indices, *parts, group_size, (*indices.shape, width))


def glu_parts(ext, bank: dict[str, mx.array], x: mx.array, group_size: int, bits: int, mode: str) -> list | None:
    """The experts' [gate, up, down], each [w, scales, biases] as the extension's glu takes them, where the edge0
    kernel covers inputs like x; None otherwise."""
    names = ("gate_proj", "up_proj", "down_proj")
    parts = [[bank.get(f"{n}.{kind}") for kind in ("weight", "scales", "biases")] for n in names]
    if any(w is None or w.ndim != 3 for w, _, _ in parts):
        return None
    d, h = x.shape[-1], parts[0][0].shape[-2]
    if not all(fits(ext, width, x.dtype, *part, group_size, bits, mode) for part, width in zip(parts, (d, d, h))):
        return None
    return parts


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int,
                     bits: int, mode: str) -> mx.array:
    """x @ W.T for packed W (N, D*bits/32); x (..., D) -> (..., N). As nn.QuantizedLinear computes it."""
    ext = current().ext
    if ext is not None and w.ndim == 2 and fits(ext, x.shape[-1], x.dtype, w, scales, biases, group_size, bits, mode):
        return ext.qmv(x, w, scales, biases, None, group_size, (*x.shape[:-1], w.shape[0]))
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size,
                               bits=bits, mode=mode)


def lora_linear(x: mx.array, linear: nn.Module, lora_a: mx.array, lora_b: mx.array, scale: float) -> mx.array | None:
    """linear(x) + scale * (x @ lora_a) @ lora_b in one node of the edge0 kernel, for a quantized linear
    without bias (an unmerged adapter's projection); None where that kernel does not cover it."""
    ext = current().ext
    if ext is None or not isinstance(linear, KernelQuantizedLinear) or "bias" in linear:
        return None
    run = remembered(linear, "_edge0_lora", (linear["weight"], linear["scales"], linear.get("biases"), lora_a, lora_b),
                     (ext, x.shape[-1], x.dtype, scale), lambda: _lora_product(ext, linear, x, lora_a, lora_b, scale))
    return run(x) if run is not None else None


def lora_add(y: mx.array, x: mx.array, lora_a: mx.array, lora_b: mx.array, scale: float) -> mx.array | None:
    """y + scale * (x @ lora_a) @ lora_b in one node of the edge0 kernel (an adapter's branch beside a block whose
    output is y), with the operations qmv_lora adds its branch with; None where that kernel does not cover it."""
    ext = current().ext
    if (ext is None or y.dtype != mx.float32 or x.dtype != mx.float32 or lora_a.dtype != lora_b.dtype
            or lora_a.dtype not in (mx.float32, mx.bfloat16)):
        return None
    return ext.adapt_add(y, x, lora_a, lora_b, float(scale))


def _lora_product(ext, linear, x, lora_a, lora_b, scale):
    """x -> the adapted product's node, for inputs like x, or None where the edge0 kernel does not cover it."""
    w, s, b = linear["weight"], linear["scales"], linear.get("biases")
    if not (w.ndim == 2 and lora_a.dtype == lora_b.dtype and lora_a.dtype in (mx.float32, mx.bfloat16)
            and fits(ext, x.shape[-1], x.dtype, w, s, b, linear.group_size, linear.bits, linear.mode)):
        return None
    gs, scale = linear.group_size, float(scale)
    _pack(ext, linear, w, s, b)
    return lambda x: ext.qmv_lora(x, w, s, b, lora_a, lora_b, scale, gs)


def _pack(ext, linear, w, s, b) -> None:
    """The kernel's packed copy of a 4-bit linear's weights (they never change while the module holds them), for
    the products that read them: the same bits, faster on short rows and on several rows."""
    if linear.bits == 4:
        ext.pack(w, s, b, linear.group_size)


def _product(ext, linear, x):
    """x -> the quantized linear's node (bias included), for inputs like x, or None where the edge0 kernel does not
    cover it."""
    w, s, b = linear["weight"], linear["scales"], linear.get("biases")
    if not (w.ndim == 2 and fits(ext, x.shape[-1], x.dtype, w, s, b, linear.group_size, linear.bits, linear.mode)):
        return None
    gs, n, bias = linear.group_size, w.shape[0], linear.get("bias")
    _pack(ext, linear, w, s, b)
    if bias is not None:
        return lambda x: ext.qmv(x, w, s, b, None, gs, (*x.shape[:-1], n)) + bias
    return lambda x: ext.qmv(x, w, s, b, None, gs, (*x.shape[:-1], n))


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product goes through quantized_matmul (same parameters and math)."""

    def __call__(self, x):
        ext = current().ext
        if ext is not None:  # the checks of quantized_matmul, made once for these arrays and inputs like x
            run = remembered(self, "_edge0_qmv", (self["weight"], self["scales"], self.get("biases"), self.get("bias")),
                             (ext, x.shape[-1], x.dtype), lambda: _product(ext, self, x))
            if run is not None:
                return run(x)
        y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                             bits=self.bits, mode=self.mode)
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose lookup is one edge0 node where it fits (MLX composes the dequantization of the
    gathered rows from about 30 nodes; `edge0 bench --kernels` times both), with the same values, and whose tied
    output head (as_linear) goes through quantized_matmul."""

    def __call__(self, x):
        ext = current().ext
        w, s, b = self["weight"], self["scales"], self.get("biases")
        if (ext is not None and self.mode == "affine" and self.bits in (4, 8) and b is not None
                and s.dtype == b.dtype == mx.float32 and x.dtype in (mx.uint32, mx.int32)):
            return ext.embed(x, w, s, b, self.group_size, self.bits)
        return super().__call__(x)

    def as_linear(self, x):
        return quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                                bits=self.bits, mode=self.mode)


def pack_at_load(model: nn.Module, executors: dict, compute_dtype) -> None:
    """The edge0 kernel's packed copies of the weights that never change, made as the store loads instead of at their
    first products (inside the first prompt's prefill, which they slowed several times over on `small`): the 4-bit
    dense linears, and the resident experts whose memory allows a copy (compute/experts.py ResidentExperts.pack:
    every expert resident, or the layers the streamed pipeline holds). The same copies, so the same bits. Nothing
    under MLX's kernel, nor where activations are not float32 (the kernel's products then never run: `fits`)."""
    ext = current().ext
    if ext is None or compute_dtype != mx.float32:
        return
    for _, m in model.named_modules():
        if type(m) is KernelQuantizedLinear:
            _pack(ext, m, m["weight"], m["scales"], m.get("biases"))
    for ex in executors.values():
        resident = getattr(ex, "resident", None)  # ResidentExperts, or the one an executor holds
        if resident is not None:
            resident.pack(ext)


def swap_classes(model: nn.Module, classes: dict[type, type]) -> int:
    """Swap the class of every module whose class is a key of `classes` (exactly, not a subclass) for its
    value, a subclass with the same parameters; returns how many were swapped."""
    n = 0
    for _, m in model.named_modules():
        new = classes.get(type(m))
        if new is not None:
            m.__class__ = new
            n += 1
    return n


def use_kernel_products(model: nn.Module) -> int:
    """Make the model's dense quantized linears (and a tied quantized embedding head) call
    quantized_matmul; parameters are untouched. Returns how many modules were swapped."""
    return swap_classes(model, {nn.QuantizedLinear: KernelQuantizedLinear,
                                nn.QuantizedEmbedding: KernelQuantizedEmbedding})
