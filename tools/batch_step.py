"""What one batched decode step costs (issue #17): B sequences admitted into one BatchDecoder (the server's
batch), then the median time of a decode step for all of them, and the graph nodes of one step.

    python tools/batch_step.py [--store S] [--batch 1,2,4,8] [--steps 50] [--prompt-tokens 128] [--rounds 3]
                               [--profile] [--ahead on,off] [ENGINE FLAGS]

Each sequence's prompt is a different window of real text (Python's json/decoder.py in the store's tokenizer),
greedy, EOS ignored; the store's defaults otherwise (for the built-in model: predicted routing over resident
experts, so the batch builds each step ahead). Prints one line per batch size: admission (prefill and first
token) per sequence, step ms, tokens/s of the batch, nodes per step; with --profile also the time per step
inside each kind of edge0 node (the kernels' own profile, as tools/step_breakdown.py reads it). With --ahead
on,off the rounds alternate between the batch building its next step while one evaluates (where the runtime allows
it: batching.py) and one step at a time, and a line per arm gives its median step, with the ratio of the two medians. The arms time different stretches of one greedy generation (the order
rotated each round), so their reads are not the same: the same tokens both ways are the tests'. ENGINE FLAGS: --routing, --executor, --slots, --io, --io-throttle,
--kernel-threads, as `edge0 run` takes them (e.g. `--executor staged --slots 28 --io direct`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from contextlib import nullcontext
from json import decoder


def graph_nodes(engine, batch) -> int:
    """Nodes of the graph of one more step of the batch (built, not evaluated, then dropped)."""
    import mlx.core as mx

    from edge0.bench.kernels import node_counts

    inputs = mx.array([[s.next_input] for s in batch.seqs], dtype=mx.uint32)
    state, routing = [c.state for c in batch.cache], engine.store.runtime.snapshot()
    with engine.kernel.active():
        nodes = node_counts(engine.store.model(inputs, cache=batch.cache))
    for c, st in zip(batch.cache, state):  # the step built for counting leaves no trace in the caches
        c.state = st
    engine.store.runtime.join([(routing, len(batch.seqs))])  # nor in the routing history
    return sum(nodes.values())


def measure(engine, ids: list[int], size: int, args) -> dict:
    from edge0.bench.switches import one_step_at_a_time
    from edge0.decode.batch import BatchDecoder
    from edge0.compute import kernels

    batch = BatchDecoder(engine, size)
    reqs = [engine.request(ids[i * 50:i * 50 + args.prompt_tokens], max_tokens=args.steps * (args.rounds + 1) + 8,
                           ignore_eos=True) for i in range(size)]
    t0 = time.perf_counter()
    for r in reqs:
        batch.admit(r, lambda text: None, lambda: False)
    admit_ms = 1e3 * (time.perf_counter() - t0) / size
    batch.step()
    batch.settle()  # nothing built ahead while the graph is counted
    nodes = graph_nodes(engine, batch)
    ext = kernels.load() if args.profile else None
    if ext is not None:
        ext.profile(True)
        ext.set_profile(True)
    arms = getattr(args, "ahead", None) or [None]
    rounds = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:  # rotated: neither always runs first
            if arm is not None:
                batch.settle()  # the step built ahead ran with the arm before
            with one_step_at_a_time(engine.store.runtime) if arm == "off" else nullcontext():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    batch.step()
                rounds[arm].append((time.perf_counter() - t0) / args.steps)
    batch.settle()
    step = statistics.median(rounds[arms[0]])
    out = {"batch": size, "admit_ms": admit_ms, "step_ms": 1e3 * step, "tok_s": size / step, "nodes": nodes}
    if arms != [None]:
        out["arm_step_ms"] = {arm: 1e3 * statistics.median(r) for arm, r in rounds.items()}
        a, b = arms
        out["paired"] = statistics.median(x / y for x, y in zip(rounds[b], rounds[a]))  # b's step / a's, per round
    if ext is not None:
        ext.set_profile(False)
        n = args.rounds * args.steps + 1  # the steps timed and the one settled after them
        out["kernel_ms"] = {k: 1e3 * sec / n for k, (_, sec) in sorted(ext.profile(True).items(), key=lambda kv: -kv[1][1])}
    return out


def main() -> int:
    from edge0.errors import Edge0Error

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None, help="an Edge0 store (default: the built-in model)")
    p.add_argument("--batch", default="1,2,4,8", help="batch sizes to measure")
    p.add_argument("--steps", type=int, default=50, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per batch size (the median is printed)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--profile", action="store_true", help="also ms per step inside each kind of edge0 node")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.add_argument("--ahead", default=None,
                   help="on,off: alternate rounds between decoding ahead and one step at a time")
    p.add_argument("--routing", default=None)
    p.add_argument("--executor", default="auto")
    p.add_argument("--slots", type=int, default=None)
    p.add_argument("--io", default="pread", help="pread | mmap | direct (every read from the disk)")
    p.add_argument("--io-throttle", type=float, default=None, metavar="MBPS")
    p.add_argument("--kernel-threads", type=int, default=None)
    args = p.parse_args()
    if args.ahead is not None:
        args.ahead = [x for x in args.ahead.split(",") if x]
        if sorted(args.ahead) != ["off", "on"]:
            sys.exit(f"--ahead {','.join(args.ahead)}: expected on,off (or off,on)")
    try:
        sizes = [int(b) for b in args.batch.split(",") if b]
    except ValueError:
        sys.exit(f"--batch {args.batch}: expected batch sizes like 1,4,8")
    if not sizes or min(sizes) < 1 or args.steps < 1 or args.rounds < 1 or args.prompt_tokens < 1:
        sys.exit("--batch sizes, --steps, --rounds and --prompt-tokens must be at least 1")
    try:
        return run(args, sizes)
    except Edge0Error as e:
        sys.exit(f"batch_step: {e}")


def run(args, sizes: list[int]) -> int:
    from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig, ServingConfig
    from edge0.engine import open_engine

    out = []
    config = EngineConfig(model=args.store, routing=RoutingConfig(mode=args.routing),
                          io=IOConfig(executor=args.executor, slots=args.slots, mode=args.io,
                                      throttle_mbps=args.io_throttle), kernel=KernelConfig(threads=args.kernel_threads),
                          serving=ServingConfig(max_batch=max(sizes), prompt_cache_gib=0)).check()
    with open_engine(config) as engine:
        ids = engine.encode_text(inspect.getsource(decoder))
        if len(ids) < 50 * (max(sizes) - 1) + args.prompt_tokens:
            sys.exit(f"json/decoder.py is {len(ids)} tokens in this tokenizer: too few for these prompts")
        for size in sizes:
            out.append(measure(engine, ids, size, args))
            if not args.json:
                r = out[-1]
                print(f"batch {r['batch']}: admission {r['admit_ms']:.1f} ms a sequence, step {r['step_ms']:.2f} ms, "
                      f"{r['tok_s']:.1f} tok/s, {r['nodes']} graph nodes a step")
                if "arm_step_ms" in r:
                    ms = r["arm_step_ms"]
                    a, b = list(ms)
                    print("    " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                          + f" a step ({b} / {a}: {ms[b] / ms[a]:.2f}x of the medians, {r['paired']:.2f}x paired)")
                for kind, ms in r.get("kernel_ms", {}).items():
                    print(f"    {kind}: {ms:.3f} ms a step")
                if "kernel_ms" in r:
                    print(f"    edge0 nodes in all: {sum(r['kernel_ms'].values()):.2f} ms a step")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
