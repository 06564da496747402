"""What single edge0 nodes cost, for docs/lab/cpu-kernels.md (issue #19): the figures behind a decode step's
node count, the heads' weight dtype and the adapter's cost.

    python tools/lab/node_cost.py [--rounds 300] [--packed]

Four measurements (five with --packed), each the median over --rounds evaluations (mx.eval of a batch of nodes built beforehand):
  * chain: N RMS-norm nodes of one 256-wide row, each on the last; microseconds a node at N = 10, 40, 100 (what a
    node costs beyond its arithmetic: MLX's scheduling on the stream thread);
  * head: a prerouter head node (the built-in model's shapes: D 256, E 32, hidden 512) with float32 and with
    bfloat16 weight matrices, its weights hot (one set) or from L3 (12 sets in turn, 8.6 MB);
  * projection: a 256 x 256 4-bit projection node, plain and with a rank-16 adapter (float32, and bfloat16 as served),
    over 24 weight sets
    (as a decode step of the built-in model meets its 24 attention projections), for one row and for 64 (a prompt
    chunk's);
  * sync: one node built and its value waited for by the host, with mx.eval (the thread sleeps until the stream
    wakes it, and queueing the node wakes the stream) and with kernels.host_eval (it spins for the value, and the
    stream is held awake between rounds): a staged layer's round trip for its routed ids;
  * packed (--packed): a 4-bit product (N x D, group size 64) of 1 and 8 token rows with its weights in the row
    layout and in the kernel's packed layout (kernels' pack: 16 outputs a vector, the same bits), the figures
    behind PACK_ONE_ROW_D and PACK_MAX_D in csrc/qmv.h.
Random weights; the kernels' outputs do not depend on their values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def per_node(mx, build, rounds: int, n: int) -> float:
    """Median microseconds a node when n nodes from build(i) are evaluated together."""
    times = []
    for _ in range(rounds):
        outs = [build(i) for i in range(n)]
        t0 = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=300, help="evaluations per figure (default 300)")
    p.add_argument("--packed", action="store_true", help="also the row layout against the packed one")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: must be at least 1")
    import mlx.core as mx

    from edge0.compute import kernels

    ext = kernels.load()
    if ext is None:
        sys.exit(f"node_cost: edge0 CPU kernels {kernels.reason()}")
    key = iter(mx.random.split(mx.random.key(0), 200))

    def normal(*shape, scale=1.0):
        return mx.random.normal(shape, key=next(key)) * scale

    x, w = normal(1, 256), mx.ones((256,))
    mx.eval(x, w)
    for n in (10, 40, 100):
        def chain(_, n=n):
            y = x
            for _ in range(n):
                y = ext.rms_norm(y, w, 1e-6)
            return y
        print(f"chain of {n} nodes: {per_node(mx, chain, a.rounds, 1) / n:.2f} us a node")

    D, E, H = 256, 32, 512
    h, router = normal(1, 1, D), normal(1, 1, E)
    now = mx.array([[[1, 5, 9, 30]]], dtype=mx.uint32)
    prev = mx.array([[[2, 5, 8, 31]]], dtype=mx.uint32)
    heads = [[normal(E, D + 2 * E, scale=0.05), normal(H, D + 2 * E, scale=0.05), normal(H), normal(E, H, scale=0.05),
              normal(E)] for _ in range(12)]
    mx.eval(h, router, heads)
    for dtype in (mx.float32, mx.bfloat16):
        sets = [[d.astype(dtype), w1.astype(dtype), b1, w2.astype(dtype), b2] for d, w1, b1, w2, b2 in heads]
        mx.eval(sets)
        for count, where in ((1, "hot"), (12, "from L3")):
            us = per_node(mx, lambda i: ext.head(h, now, prev, router, *sets[i % count]), a.rounds, 24)
            print(f"head, {str(dtype).split('.')[-1]} weights, {where}: {us:.1f} us a node")

    xq = normal(1, 1, 256)
    projections = []
    for _ in range(24):
        wq, s, b = mx.quantize(normal(256, 256), group_size=64, bits=4)
        projections.append((wq, s, b, normal(256, 16, scale=0.05), normal(16, 256, scale=0.05)))
    mx.eval(xq, projections)
    plain = per_node(mx, lambda i: ext.qmv(xq, *projections[i % 24][:3], None, 64), a.rounds, 48)
    adapted = per_node(mx, lambda i: ext.qmv_lora(xq, *projections[i % 24], 2.0, 64), a.rounds, 48)
    print(f"projection 256x256, 24 weight sets: plain {plain:.2f} us a node, with a rank-16 adapter {adapted:.2f} "
          f"(+{adapted - plain:.2f})")
    served = [(*pr[:3], pr[3].astype(mx.bfloat16), pr[4].astype(mx.bfloat16)) for pr in projections]  # as served
    mx.eval(served)
    adapted16 = per_node(mx, lambda i: ext.qmv_lora(xq, *served[i % 24], 2.0, 64), a.rounds, 48)
    print(f"projection 256x256, 24 weight sets, the adapter in bfloat16: {adapted16:.2f} us a node "
          f"(+{adapted16 - plain:.2f})")
    xp = normal(1, 64, 256)  # a prompt chunk's rows
    mx.eval(xp)
    times = {"plain": [], "adapted": []}
    for _ in range(max(1, a.rounds // 10)):  # alternating, so that the host's drift falls on both alike
        times["plain"].append(per_node(mx, lambda i: ext.qmv(xp, *projections[i % 24][:3], None, 64), 1, 24))
        times["adapted"].append(per_node(mx, lambda i: ext.qmv_lora(xp, *projections[i % 24], 2.0, 64), 1, 24))
    plain, adapted = (statistics.median(times[k]) for k in ("plain", "adapted"))
    print(f"projection 256x256 of 64 rows: plain {plain:.1f} us a node, with a rank-16 adapter {adapted:.1f} "
          f"(+{adapted - plain:.1f})")

    for name, wait in (("mx.eval", mx.eval), ("host_eval", kernels.host_eval)):
        times = []
        for _ in range(a.rounds):
            y = ext.rms_norm(x, w, 1e-6)
            t0 = time.perf_counter()
            wait(y)
            times.append((time.perf_counter() - t0) * 1e6)
        print(f"sync, one node's value to the host: {name} {statistics.median(times):.1f} us")
    if a.packed:
        packed_products(mx, ext, a.rounds)
    return 0


def packed_products(mx, ext, rounds: int) -> None:
    """Microseconds a product node, row layout against packed, at 1 and 8 token rows (40 nodes an evaluation; the
    two layouts alternate over the rounds)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for n, d in ((4096, 256), (256, 256), (128, 256), (1024, 512), (1024, 1024), (2048, 2048)):
        row = mx.quantize(mx.array(rng.standard_normal((n, d), dtype=np.float32)), group_size=64, bits=4)
        packed = tuple(mx.array(a) for a in row)  # copies: packing belongs to the arrays
        mx.eval(row, packed)
        if not ext.pack(*packed, 64):
            print(f"product {n}x{d}: no packed layout here")
            continue
        for rows in (1, 8):
            xs = [mx.array(rng.standard_normal((rows, d), dtype=np.float32)) for _ in range(40)]
            mx.eval(xs)
            times = {"row": [], "packed": []}
            for _ in range(max(1, rounds // 10)):
                for name, w in (("row", row), ("packed", packed)):
                    times[name].append(per_node(mx, lambda i, w=w: ext.qmv(xs[i], *w, None, 64), 1, 40))
            us = [statistics.median(times[k]) for k in ("row", "packed")]
            print(f"product {n}x{d}, {rows} row{'s' if rows > 1 else ''}: row layout {us[0]:.1f} us, packed "
                  f"{us[1]:.1f} us ({us[0] / us[1]:.2f}x)")

if __name__ == "__main__":
    sys.exit(main())
