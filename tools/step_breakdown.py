"""Where a decode step's time goes, for docs/lab/cpu-kernels.md (issue #19).

    python tools/step_breakdown.py --store S [--replay R] [--threads 1] [--steps 48] [--routing native] [--slots N]
        [--lora none]

Runs one generation (the replay's prompt, then its tokens forced, or a prompt of Python source and greedy
tokens) and splits each decode step of the graph-building thread into
  * wait: inside mx.eval / mx.async_eval and the streamed path's host_eval / queue (the graph computing, or the
    stream's queue full),
  * python: the rest (building the graph, planning and issuing reads, sampling on the host);
and the stream thread's compute into the edge0 kernels' nodes by kind and width (timed inside the
kernels, EDGE0 set_profile) and the rest (MLX's own nodes: cache updates, adds, reshapes, the
embedding). Prints a markdown table; --json prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx


class EvalClock:
    """Wall time the calling thread spends inside mx.eval and mx.async_eval, and inside the extension's host_eval and
    queue (the streamed path's syncs, compute/kernels.py), all patched module-wide while it is entered."""

    def __init__(self):
        from edge0.compute import kernels

        self.s = 0.0
        ext = kernels.load()
        self._patched = [(mx, name) for name in ("eval", "async_eval")]
        self._patched += [(ext, name) for name in ("host_eval", "queue") if hasattr(ext, name)]  # older trees: none
        self._saved = [getattr(owner, name) for owner, name in self._patched]

    def __enter__(self):
        def timed(fn):
            def call(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.s += time.perf_counter() - t0
            return call
        for (owner, name), fn in zip(self._patched, self._saved):
            setattr(owner, name, timed(fn))
        return self

    def __exit__(self, *exc):
        for (owner, name), fn in zip(self._patched, self._saved):
            setattr(owner, name, fn)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--replay", help="JSON {prompt: [ids], tokens: [ids]} (default: Python source, greedy tokens)")
    p.add_argument("--threads", type=int, default=None, help="--kernel-threads (default: the kernels' default)")
    p.add_argument("--steps", type=int, default=48, help="decode steps timed (default 48)")
    p.add_argument("--routing", default="native", choices=("native", "prefetch", "predicted"))
    p.add_argument("--executor", default="auto", help="--executor (default auto: staged)")
    p.add_argument("--slots", type=int, default=None, help="--slots: slots per staged bank (default 2K)")
    p.add_argument("--lora", default=None, metavar="FILE",
                   help="--lora: the adapter (default: the store's, under predicted routing; none: without it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be at least 1")

    from edge0.errors import Edge0Error

    try:
        return breakdown(args)
    except Edge0Error as e:
        sys.exit(f"step_breakdown: error: {e}")


def read_replay(path: str) -> tuple[list[int], list[int] | None]:
    """A replay file's prompt ids and forced tokens, or one clear error naming the file."""
    from edge0.errors import Edge0Error

    try:
        replay = json.loads(Path(path).read_text())
        prompt, forced = replay["prompt"], replay.get("tokens")
    except OSError as e:
        raise Edge0Error(f"--replay {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise Edge0Error(f"--replay {path}: not a replay file (JSON with a 'prompt' list of ids): {e}") from None
    if not prompt or (forced is not None and len(forced) < 2):
        raise Edge0Error(f"--replay {path}: needs a prompt and at least 2 forced tokens")
    return prompt, forced


def breakdown(args) -> int:
    from mlx_lm.sample_utils import make_sampler

    from edge0.compute import kernels
    from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig, ServingConfig
    from edge0.engine import open_engine
    from edge0.decode.loop import generate_steps

    ext = kernels.load()
    if ext is None:
        sys.exit(f"edge0 kernels {kernels.reason()}: nothing to break down")
    prompt, forced = read_replay(args.replay) if args.replay else (None, None)
    config = EngineConfig(model=args.store, routing=RoutingConfig(mode=args.routing, lora=args.lora),
                          io=IOConfig(executor=args.executor, slots=args.slots),
                          kernel=KernelConfig(name="edge0", threads=args.threads),
                          serving=ServingConfig(prompt_cache_gib=0))
    with open_engine(config) as engine:
        if prompt is None:
            prompt = engine.encode_text(Path(argparse.__file__).read_text())[:256]
        steps = args.steps if forced is None else min(args.steps, len(forced))
        rt = engine.store.runtime
        per_step = []
        with engine.kernel.active(), EvalClock() as clock:
            gen = generate_steps(engine.store.model, prompt, max_tokens=steps + 1, sampler=make_sampler(0.0),
                                 runtime=rt, forced=forced[:steps + 1] if forced else None)
            next(gen)  # prefill and the first token, untimed
            ext.profile(True)
            ext.set_profile(True)
            t0, w0, c0 = time.perf_counter(), clock.s, time.thread_time()
            for _ in gen:
                t1, w1, c1 = time.perf_counter(), clock.s, time.thread_time()
                per_step.append((t1 - t0, w1 - w0, c1 - c0))
                t0, w0, c0 = t1, w1, c1
            ext.set_profile(False)
            nodes = ext.profile(True)
        threads = ext.num_threads()
    n = len(per_step)
    wall = sum(s[0] for s in per_step) / n
    wait = sum(s[1] for s in per_step) / n
    cpu = sum(s[2] for s in per_step) / n
    kinds = {k: (c / n, s / n) for k, (c, s) in sorted(nodes.items(), key=lambda kv: -kv[1][1])}
    kernel_s = sum(s for _, s in kinds.values())
    out = {"store": args.store, "routing": args.routing, "executor": args.executor, "decode_threads": threads, "steps": n,
           "step_ms": 1e3 * wall, "main_wait_ms": 1e3 * wait, "main_python_ms": 1e3 * (wall - wait),
           "main_cpu_ms": 1e3 * cpu, "kernel_nodes_ms": 1e3 * kernel_s,
           "nodes": {k: {"per_step": c, "ms": 1e3 * s} for k, (c, s) in kinds.items()}}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.store}: {n} decode steps, routing {args.routing}, {threads} decode thread(s); per step:")
    print("| part | ms | share of the step |\n|---|---|---|")
    print(f"| step (wall) | {1e3 * wall:.2f} | 100% |")
    print(f"| main thread: python (graph building, reads, host work) | {1e3 * (wall - wait):.2f} | "
          f"{(wall - wait) / wall:.0%} |")
    print(f"| main thread: waiting in mx.eval / async_eval / host_eval | {1e3 * wait:.2f} | {wait / wall:.0%} |")
    print(f"| stream: edge0 nodes | {1e3 * kernel_s:.2f} | {kernel_s / wall:.0%} |")
    for k, (c, s) in kinds.items():
        print(f"| - {k} (x{c:.1f}) | {1e3 * s:.3f} | {s / wall:.1%} |")
    print(f"| stream: the rest (MLX's nodes, dispatch, idle) | {1e3 * (wall - kernel_s):.2f} | "
          f"{(wall - kernel_s) / wall:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
