"""The edge0 kernels' exp and erf against mx.exp and mx.erf, bit for bit (docs/lab/cpu-kernels.md).

    python tools/math_bits.py            # 2^26 random float32 bit patterns and 2^26 values in [-100, 100]
    python tools/math_bits.py --all      # every float32 bit pattern (about 12 minutes on 2 cores)

NaN outputs compare as NaN whatever their payload. Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    import mlx.core as mx
    import numpy as np

    from edge0.compute import kernels

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--all", action="store_true", help="every float32 bit pattern")
    a = p.parse_args()
    ext = kernels.load()
    if ext is None:
        sys.exit(f"math_bits: edge0 kernels {kernels.reason()}")
    chunk = 1 << 26
    rng = np.random.default_rng(0)
    if a.all:
        batches = (np.arange(s, s + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
                   for s in range(0, 1 << 32, chunk))
    else:
        batches = iter([rng.integers(0, 1 << 32, chunk, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        rng.uniform(-100, 100, chunk).astype(np.float32)])
    bad = {"exp": 0, "erf": 0}
    n = 0
    for x in batches:
        xa = mx.array(x)
        n += x.size
        for fn in bad:
            got, want = np.array(ext.math(xa, fn)), np.array(getattr(mx, fn)(xa))
            bad[fn] += int(np.sum(~((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want)))))
    print(f"{n} inputs on the {ext.impl()} build: exp {bad['exp']} and erf {bad['erf']} differ from MLX's")
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
