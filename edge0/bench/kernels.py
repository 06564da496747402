"""Micro-benchmark of the quantized kernels: G weights/s of edge0's CPU kernels and MLX's at decode
shapes (8 products per mx.eval, as a decode step has several per sync) and a prefill batch, against
this machine's memory read bandwidth measured in the same run.

    edge0 bench --kernels

Each kernel gets its scales and biases as the engine hands them over: float32 to MLX's (widened at load),
bfloat16 as stored to edge0's. At MLX's 4-bit affine format a weight then costs 0.5 + 8/gs bytes (0.625 at
gs 64) for MLX and 0.5 + 4/gs (0.5625) for edge0: bandwidth / that is the ceiling of a decode matvec whose
weights come from memory.
Shapes: E experts, K routed, D hidden, H expert width, R rows.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..compute import kernels, qmm
from ..compute.kernel_choice import Kernel

GROUP = 64
BYTES_PER_WEIGHT = 0.5 + 2 * 2 / GROUP  # edge0's: bf16 scales and biases (MLX's float32 ones: 0.5 + 2 * 4 / GROUP)
EXPERTS = 128  # as Qwen3-30B-A3B: the routed set changes every call, weights come from memory
DENSE_BYTES = 256 << 20  # dense matrices cycled through, so that they do not sit in cache
PER_EVAL = 8  # products per mx.eval, as a decode step evaluates several per sync (the sync is not the kernel's)



def memory_read_gbs(threads: int, nbytes: int = 256 << 20) -> float:
    """Read bandwidth of a summation over a fresh array larger than the caches (numpy releases the GIL)."""
    a = np.ones(nbytes // 8, dtype=np.float64)
    parts = np.array_split(a, threads)
    with ThreadPoolExecutor(threads) as pool:
        best = 0.0
        for _ in range(5):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, nbytes / (time.perf_counter() - t))
    return best / 1e9


def _quantized(shape, seed=0, dtype=mx.float32):
    """Random packed 4-bit weights (..., N, D/8) with scales and biases of `dtype`: the speed does not
    depend on the values, and mx.quantize of a few hundred MB takes minutes on this CPU."""
    rng = np.random.default_rng(seed)
    *lead, d = shape
    w = mx.array(rng.integers(0, 1 << 32, size=(*lead, d // 8), dtype=np.uint32))
    s = mx.array(rng.random((*lead, d // GROUP), dtype=np.float32) * 0.01).astype(dtype)
    b = (-8 * s).astype(dtype)
    mx.eval(w, s, b)
    return w, s, b


def _rate(fn, seconds: float) -> float:
    """Products per second of fn() (each builds and evaluates a graph, returns how many products it
    held), best of a few rounds."""
    fn()
    best, end = 0.0, time.perf_counter() + seconds
    while True:
        n, t = 0, time.perf_counter()
        while n < 8 or time.perf_counter() - t < seconds / 4:
            n += fn()
        best = max(best, n / (time.perf_counter() - t))
        if time.perf_counter() > end:
            return best


def _gather_case(d, h, k, seconds, prefill_rows=0, dtype=mx.float32):
    w, s, b = _quantized((EXPERTS, h, d), dtype=dtype)
    rng = np.random.default_rng(0)
    steps = [mx.array(np.stack([rng.choice(EXPERTS, k, replace=False) for _ in range(max(1, prefill_rows))])
                      .astype(np.uint32)) for _ in range(64)]
    it = iter(range(1 << 62))
    rows = max(1, prefill_rows)
    x = mx.random.normal((rows, 1, 1, d))
    if prefill_rows:  # as switch_glu's sorted path: (R*K, 1, D) rows sorted by expert
        flat = [mx.sort(i.flatten()) for i in steps]
        xs = mx.broadcast_to(x, (rows, k, 1, d)).reshape(rows * k, 1, d)
        mx.eval(flat, xs)

    def call():
        ys = []
        for _ in range(1 if prefill_rows else PER_EVAL):
            i = next(it) % len(steps)
            if prefill_rows:
                ys.append(qmm.gather_qmm(xs, w, s, b, flat[i], group_size=GROUP, bits=4, mode="affine",
                                         sorted_indices=True))
            else:
                ys.append(qmm.gather_qmm(x, w, s, b, steps[i], group_size=GROUP, bits=4, mode="affine"))
        mx.eval(ys)
        return len(ys)
    return _rate(call, seconds) * rows * k * h * d / 1e9


def _dense_case(d, n, seconds, rows=1, dtype=mx.float32):
    copies = max(1, int(DENSE_BYTES // (n * d * BYTES_PER_WEIGHT)))
    mats = [_quantized((n, d), seed=i, dtype=dtype) for i in range(copies)]
    x = mx.random.normal((rows, d))
    it = iter(range(1 << 62))

    def call():
        ys = [qmm.quantized_matmul(x, *mats[next(it) % copies], group_size=GROUP, bits=4, mode="affine")
              for _ in range(1 if rows > 1 else PER_EVAL)]
        mx.eval(ys)
        return len(ys)
    return _rate(call, seconds) * rows * n * d / 1e9


ATTENTION = [  # (B, Hq, Hkv, L, S): a decode step alone at a long context, a batch's step, a causal prompt
    (1, 16, 4, 1, 2048), (8, 4, 2, 1, 256), (1, 16, 4, 256, 256)]


def _attention_us(b, hq, hkv, l, s, seconds) -> float:
    """Microseconds per attention call (head dim 64, float32) under the active kernel."""
    from ..compute import dense

    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((b, hq, l, 64), (b, hkv, s, 64), (b, hkv, s, 64)))
    mx.eval(q, k, v)
    mask = "causal" if l > 1 else None

    def call():
        mx.eval([dense.scaled_dot_product_attention(q, k, v, None, 0.125, mask) for _ in range(PER_EVAL)])
        return PER_EVAL
    return 1e6 / _rate(call, seconds)


def _attention_rows(threads: list[int], seconds: float, say) -> dict:
    """{shape: {kernel: microseconds per call}} for the ATTENTION shapes, MLX's and edge0's per thread count."""
    say("attention, microseconds per call (head dim 64, float32; MLX's fast op against edge0's node)")
    rows = {}
    for shape in ATTENTION:
        name = "B{} Hq{} Hkv{} L{} S{}".format(*shape)
        with Kernel.choose("mlx").active():
            row = {"mlx": _attention_us(*shape, seconds)}
        for t in threads:
            kernels.set_num_threads(t)
            with Kernel.choose("edge0").active():
                row[f"edge0 x{t}"] = _attention_us(*shape, seconds)
        rows[name] = row
        say(f"  {name:34s} " + "  ".join(f"{k} {v:8.1f}" for k, v in row.items()))
    return rows


EMBEDDINGS = [(4096, 256), (32768, 2048)]  # (V, D): the built-in model's table, a larger one


def _embedding_us(v: int, d: int, seconds: float) -> float:
    """Microseconds per one-token lookup (graph built and evaluated) of a 4-bit table under the active kernel."""
    emb = qmm.KernelQuantizedEmbedding(v, d, group_size=GROUP, bits=4)
    emb.weight, emb.scales, emb.biases = _quantized((v, d))
    ids = [mx.array([[int(t)]], dtype=mx.uint32) for t in np.random.default_rng(0).integers(0, v, 64)]
    it = iter(range(1 << 62))

    def call():
        mx.eval([emb(ids[next(it) % len(ids)]) for _ in range(PER_EVAL)])
        return PER_EVAL
    return 1e6 / _rate(call, seconds)


def _embedding_rows(edge0: bool, seconds: float, say) -> dict:
    """{table: {kernel: microseconds per lookup}}: MLX's composed dequantization against edge0's node."""
    say("quantized embedding, microseconds per one-token lookup (4-bit, gs 64, float32 scales)")
    rows = {}
    for v, d in EMBEDDINGS:
        row = {}
        for kernel in ["mlx"] + (["edge0"] if edge0 else []):
            with Kernel.choose(kernel).active():
                row[kernel] = _embedding_us(v, d, seconds)
        rows[f"V{v} D{d}"] = row
        say(f"  {'V%d D%d' % (v, d):34s} " + "  ".join(f"{k} {t:8.1f}" for k, t in row.items()))
    return rows


def _impls(ext, asked: str | None) -> list[str]:
    """The edge0 code paths to measure, best first; the extension's default path is restored after."""
    if ext is None:
        return []
    default = ext.impl()
    names = asked.split(",") if asked else ["avx512", "avx2"]
    built = [n for n in names if ext.set_impl(n)] or [default]
    ext.set_impl(default)
    return built


def _dot(out: mx.array) -> str:
    import io

    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return dot.getvalue()


def node_counts(out: mx.array) -> dict[str, int]:
    """The nodes of the (unevaluated) graph behind `out`, by primitive."""
    import collections
    import re

    return dict(collections.Counter(re.findall(r'label ="([A-Za-z0-9_+]+)', _dot(out))))


def listed_inputs(out: mx.array) -> dict[str, list[int]]:
    """For each node of the graph behind `out`, by primitive, one entry a node: how many of the inputs it lists for
    MLX (which walks each at every eval) are arrays with no node (weights, the cache's buffers, token ids), and how
    many in all: [leaves, inputs]. (An Edge0 node keeps the arrays evaluated when it was built to itself: csrc Held.)"""
    import re

    text = _dot(out)
    leaves = set(re.findall(r'rank=source; "([^"]+)"', text))
    names = dict(re.findall(r'\{ (\d+) \[label ="([A-Za-z0-9_+]+)"', text))
    counts = {node: [0, 0] for node in names}
    for src, dst in re.findall(r'"?([A-Za-z0-9]+)"? -> "?([A-Za-z0-9]+)"?', text):
        if dst in counts:
            counts[dst][0] += src in leaves
            counts[dst][1] += 1
    found: dict[str, list[list[int]]] = {}
    for node, name in names.items():
        found.setdefault(name, []).append(counts[node])
    return found


def graph_nodes(store_path: str, kernel: str) -> tuple[dict[str, int], int]:
    """Nodes of one decode step's graph (resident executor: no per-layer sync), by primitive, and the inputs they
    list for MLX in all."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..model.load import load_store

    with Kernel.choose(kernel).active():
        store = load_store(store_path, executor="resident")
        cache = make_prompt_cache(store.model)
        mx.eval(store.model(mx.array([[1, 2, 3, 4]]), cache=cache), [c.state for c in cache])
        step = store.model(mx.array([[5]]), cache=cache)
        nodes, inputs = node_counts(step), sum(n for each in listed_inputs(step).values() for _, n in each)
        store.close()
    return nodes, inputs


def bench_kernels(args) -> dict:
    """Print and return G weights/s of each kernel (edge0 per code path and thread count, mlx) per shape."""
    threads = [int(t) for t in str(args.kernel_threads).split(",") if t]
    ext = kernels.load()
    impls = _impls(ext, getattr(args, "kernel_impls", None))
    seconds = args.kernel_seconds
    out = {"bytes_per_weight": BYTES_PER_WEIGHT, "group_size": GROUP, "experts": EXPERTS, "rows": {},
           "blas": "not used by quantized kernels" + (f" (LD_PRELOAD={os.environ['LD_PRELOAD']})"
                                                     if os.environ.get("LD_PRELOAD") else ""),
           "edge0_kernels": impls, "edge0_reason": kernels.reason(),
           "memory_read_gbs": {t: memory_read_gbs(t) for t in sorted(set(threads + [1]))}}
    say = (lambda *a: None) if args.kernel_json else print
    for t, gbs in out["memory_read_gbs"].items():
        say(f"memory read, {t} thread(s): {gbs:.1f} GB/s = {gbs / BYTES_PER_WEIGHT:.1f} G weights/s at 4-bit gs {GROUP} "
            "with bf16 scales")
    if not kernels.available():
        say(f"edge0 kernels {kernels.reason()}: measuring MLX's only")
        threads = []
    say(f"G weights/s (gs {GROUP}, float32 activations; scales float32 for mlx, bf16 for edge0; edge0 paths "
        f"{', '.join(impls) or 'none'})")
    cases = [(f"gather D{d} H{h} K{k}", lambda dt, d=d, h=h, k=k: _gather_case(d, h, k, seconds, dtype=dt))
             for d in (1024, 2048) for h in (512, 768) for k in (4, 8)]
    cases += [(f"dense {4 * d}x{d}", lambda dt, d=d: _dense_case(d, 4 * d, seconds, dtype=dt)) for d in (1024, 2048)]
    if args.kernel_prefill_rows:
        r = args.kernel_prefill_rows
        cases += [(f"prefill gather R{r} D2048 H768 K8",
                   lambda dt: _gather_case(2048, 768, 8, seconds, prefill_rows=r, dtype=dt)),
                  (f"prefill dense R{r} 4096x1024", lambda dt: _dense_case(1024, 4096, seconds, rows=r, dtype=dt))]
    default_impl = ext.impl() if ext is not None else None
    try:
        for name, fn in cases:
            row = {}
            with Kernel.choose("mlx").active():
                row["mlx"] = fn(mx.float32)
            for impl in impls:
                ext.set_impl(impl)
                for t in threads:
                    kernels.set_num_threads(t)
                    with Kernel.choose("edge0").active():
                        row[f"{impl} x{t}"] = fn(mx.bfloat16)
            out["rows"][name] = row
            say(f"  {name:34s} " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items())
                + (f"  ({row[f'{impls[0]} x{threads[0]}'] / row['mlx']:.1f}x)" if impls and threads else ""))
        out["attention_us"] = _attention_rows(threads, seconds, say)
        out["embedding_us"] = _embedding_rows(bool(threads), seconds, say)
    finally:
        if ext is not None:
            ext.set_impl(default_impl)
        kernels.set_num_threads(kernels.default_threads(), kernels.default_prompt_threads())
    if getattr(args, "kernel_graph", None):
        for kernel in ["mlx"] + (["edge0"] if ext is not None else []):
            nodes, inputs = graph_nodes(args.kernel_graph, kernel)
            out.setdefault("graph_nodes", {})[kernel] = nodes
            out.setdefault("graph_inputs", {})[kernel] = inputs
            top = ", ".join(f"{k} {v}" for k, v in sorted(nodes.items(), key=lambda kv: -kv[1])[:6])
            say(f"graph of one decode step, {kernel} kernel: {sum(nodes.values())} nodes ({top}, ...), "
                f"{inputs} inputs listed for MLX")
    if args.kernel_json:
        print(json.dumps(out))
    return out
