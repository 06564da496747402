"""MLX's affine quantization -> GGML blocks, in numpy (no MLX): the arithmetic of `edge0 export-gguf`.

MLX's affine format packs q in 0..2^bits-1 little-endian into uint32 words and keeps one (scale, bias) per
group of `group_size` weights along a row: w = scale * q + bias. GGML's Q4_1 block is 32 weights with
w = d * q + m, stored as d (fp16), m (fp16), then 16 bytes whose low nibbles are weights 0..15 and high
nibbles weights 16..31. So a 4-bit group of 64 is exactly two Q4_1 blocks sharing its scale and bias; only
the nibble order and the fp16 rounding of scale and bias differ, and a bf16 value is exact in fp16 unless it
lies below fp16's normal range (or above its largest value): `fp16_inexact` counts those.

Shapes: `...` any leading axes (experts, rows), I the row length (input features), G = I / group_size groups,
B = I / 32 blocks.
"""

from __future__ import annotations

import numpy as np

QK = 32  # weights per GGML Q4_0 / Q4_1 / Q8_0 block
Q4_1_BYTES = 20  # d, m (fp16 each) + 16 bytes of nibbles
NP_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U8": np.uint8,
             "I8": np.int8}  # BF16 stays raw uint16 until bf16_to_f32


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly: a bf16 is the high half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def as_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A stored float tensor (safetensors dtype code) as float32."""
    return bf16_to_f32(raw) if dtype == "BF16" else raw.astype(np.float32)


def fp16_inexact(x: np.ndarray) -> int:
    """How many float32 values change when stored as fp16 (subnormal or out of fp16's range)."""
    with np.errstate(over="ignore"):
        return int(np.count_nonzero(x.astype(np.float16).astype(np.float32) != x))


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words (..., I*bits/32) -> q (..., I) uint8, MLX's order (lowest bits first)."""
    per = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    q = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.uint8)


def dequantize(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int, bits: int) -> np.ndarray:
    """MLX's affine dequantization in float32: scale * q + bias per group (scales, biases float32)."""
    q = unpack(words, bits).astype(np.float32)
    g = q.reshape(*scales.shape, group_size)
    return (g * scales[..., None] + biases[..., None]).reshape(q.shape)


def q4_1_from_affine(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int) -> np.ndarray:
    """4-bit affine (words (..., I/8) uint32; scales, biases (..., G) float32) -> Q4_1 bytes (..., B*20).

    Lossless where scales and biases are exact in fp16 (fp16_inexact counts the others).
    """
    if group_size % QK:
        raise ValueError(f"group size {group_size} is not a multiple of {QK}")
    lead = words.shape[:-1]
    nb = words.shape[-1] * 8 // QK
    # A 32-weight block is 16 bytes of MLX nibbles b[0..15]: b[k] = w[2k] | w[2k+1] << 4. GGML wants
    # t[j] = w[j] | w[j+16] << 4, so t[2i] = lo(b[i]) | lo(b[8+i]) << 4 and t[2i+1] = hi(b[i]) | hi(b[8+i]) << 4.
    b = np.ascontiguousarray(words).view(np.uint8).reshape(*lead, nb, 2, 8)
    first, second = b[..., 0, :], b[..., 1, :]
    qs = np.empty((*lead, nb, 8, 2), np.uint8)
    qs[..., 0] = (first & 0x0F) | ((second & 0x0F) << 4)
    qs[..., 1] = (first >> 4) | (second & 0xF0)
    per_group = group_size // QK
    d = np.repeat(scales.astype(np.float16), per_group, axis=-1)  # (..., B): the group's scale in each block
    m = np.repeat(biases.astype(np.float16), per_group, axis=-1)
    out = np.empty((*lead, nb, Q4_1_BYTES), np.uint8)
    out[..., 0:2] = d[..., None].view(np.uint8)
    out[..., 2:4] = m[..., None].view(np.uint8)
    out[..., 4:] = qs.reshape(*lead, nb, 16)
    return out.reshape(*lead, nb * Q4_1_BYTES)


def quantize(w: np.ndarray, qtype) -> np.ndarray:
    """float32 weights (..., I) -> GGML blocks of qtype (gguf's reference numpy quantizer)."""
    from gguf import quants

    return quants.quantize(np.ascontiguousarray(w, np.float32), qtype)
