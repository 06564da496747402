"""What the kernel tests share: the extension (skipped where it is not built), its implementations, their
tolerances, a fixture restoring the kernel's settings after each test, and the float64 dequantized reference
of MLX's quantized layout."""

import mlx.core as mx
import numpy as np
import pytest

from edge0.compute import kernels


EXT = kernels.load()
needs_ext = pytest.mark.skipif(EXT is None, reason=f"edge0 CPU kernels {kernels.reason()} (built by pip install -e . where a C++ compiler and cmake exist)")
IMPLS = kernels.isas() or ["portable"]  # the code paths this build runs (kernels.set_isa), narrowest first
VNNI = EXT is not None and "avx512" in EXT.impls()  # the products' VNNI path: the packed layout is its own
TOL = {"portable": 1e-5, "avx2": 1e-2, "avx512": 1e-2}  # int8 activations: about 5e-3 on Gaussian inputs


@pytest.fixture(autouse=True)
def restore():
    yield
    if EXT is not None:
        kernels.set_isa(IMPLS[-1])
        EXT.set_num_threads(kernels.default_threads(), kernels.default_prompt_threads())


@pytest.fixture(params=IMPLS)
def every_isa(request):
    """The test once on each code path this build runs (a narrower machine's on a wider one), the widest after."""
    if EXT is not None:
        kernels.set_isa(request.param)
    yield request.param
    if EXT is not None:
        kernels.set_isa(IMPLS[-1])


def quantized(shape, gs, seed, bits=4):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal(shape).astype(np.float32) * 0.05)
    w, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return w, s, b


def dequantized(w, s, b, gs, bits=4) -> np.ndarray:
    """float64 W from MLX's layout, unpacked by numpy: 32/bits values per uint32, element j in bits j*bits."""
    words = np.array(w)
    per = 32 // bits
    q = (words[..., None] >> (bits * np.arange(per, dtype=np.uint32))) & ((1 << bits) - 1)
    q = q.reshape(*words.shape[:-1], -1).astype(np.float64)
    s64 = np.repeat(np.array(s).astype(np.float64), gs, axis=-1)
    b64 = np.repeat(np.array(b).astype(np.float64), gs, axis=-1)
    return s64 * q + b64


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
