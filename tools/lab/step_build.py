"""What building a decode step's graph costs on the graph-building thread, for docs/lab/cpu-kernels.md (issue #19).

    python tools/lab/step_build.py --replay R [--store S] [--routing native] [--lora none] [--rounds 7]

Two figures, each run on the built-in model (or --store) with the engine's defaults and the given flags:
  * build: the same decode step's graph built 300 times and never evaluated, the KV cache's offsets put back after
    each (graph building alone: Python, the extension's node constructors); the minimum and median of --rounds;
  * decode: generations of the replay's forced tokens, each overlapped step split into building its graph and
    async_eval (which blocks while the stream still holds the step before: a bound there means the nodes' compute,
    not Python, sets the step).
Run it from outside the repository with PYTHONPATH=TREE to measure another tree.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replay", required=True, help="JSON {prompt: [ids], tokens: [ids]}")
    p.add_argument("--store", help="an Edge0 store (default: the built-in model)")
    p.add_argument("--routing", help="--routing (default: the engine's)")
    p.add_argument("--lora", help="--lora (default: the engine's)")
    p.add_argument("--rounds", type=int, default=7, help="build rounds of 300 steps, and generations (default 7)")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: must be at least 1")
    from edge0.errors import Edge0Error

    try:
        build_us, split = measure(a)
    except Edge0Error as e:
        sys.exit(f"step_build: error: {e}")
    print(f"build: {min(build_us):.1f} us a step (min), {statistics.median(build_us):.1f} (median of {a.rounds})")
    print(f"decode: {split['step']:.3f} ms a step = build {split['build']:.3f} + async_eval {split['async']:.3f} "
          f"+ the rest (median generation of {a.rounds})")
    return 0


def measure(a) -> tuple[list[float], dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import edge0.decode.step as steps
    from edge0.cli.run import read_replay
    from edge0.config import EngineConfig
    from edge0.engine import demo_store, open_engine
    from edge0.errors import Edge0Error

    replay = read_replay(a.replay)
    prompt, forced = replay["prompt"], replay.get("tokens", [])
    if len(prompt) < 2 or len(forced) < 2:
        raise Edge0Error(f"--replay {a.replay}: needs at least 2 prompt ids and 2 forced tokens")
    flags = {k: v for k, v in (("routing.mode", a.routing), ("routing.lora", a.lora)) if v is not None}
    with open_engine(EngineConfig.of({"model": a.store or str(demo_store()), "serving.prompt_cache_gib": 0,
                                      **flags})) as engine:
        split = _decode_split(engine, steps, mx, prompt, forced, a.rounds)
        model, rt = engine.store.model, engine.store.runtime
        with engine.kernel.active():
            cache = make_prompt_cache(model)
            if hasattr(rt, "reset_pipeline"):
                rt.reset_pipeline()
            model(mx.array(prompt[:-1], dtype=mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
            tok = mx.array([[prompt[-1]]], dtype=mx.uint32)
            for _ in range(2):  # two real steps: predicted routing has its heads' decisions for the next one
                mx.eval(model(tok, cache=cache))
                if hasattr(rt, "next_step"):
                    rt.next_step()
            gc.disable()
            try:
                build_us = []
                for _ in range(a.rounds):
                    t0 = time.perf_counter()
                    for _ in range(300):
                        model(tok, cache=cache)
                        for c in cache:
                            c.offset -= 1
                    build_us.append((time.perf_counter() - t0) / 300 * 1e6)
            finally:
                gc.enable()
    return build_us, split


def _decode_split(engine, steps, mx, prompt, forced, rounds) -> dict:
    """Median generation's ms a step, and its graph building and async_eval ms a step (overlapped decode)."""
    clock = {"build": 0.0, "async": 0.0, "n": 0}
    overlapped, async_eval = steps._overlapped, mx.async_eval

    def timed_overlapped(step, *args, **kw):
        def timed_step(tokens, n):
            t0 = time.perf_counter()
            out = step(tokens, n)
            clock["build"] += time.perf_counter() - t0
            clock["n"] += 1
            return out
        return overlapped(timed_step, *args, **kw)

    def timed_async(*arrays):
        t0 = time.perf_counter()
        async_eval(*arrays)
        clock["async"] += time.perf_counter() - t0

    runs = []
    steps._overlapped, mx.async_eval = timed_overlapped, timed_async
    try:
        for _ in range(rounds):
            clock.update(build=0.0, n=0)
            clock["async"] = 0.0
            fig = engine.generate(engine.request(prompt, max_tokens=len(forced), forced=forced, ignore_eos=True))
            n = max(clock["n"], 1)
            runs.append((1e3 / fig.decode_tok_s, clock["build"] / n * 1e3, clock["async"] / n * 1e3))
    finally:
        steps._overlapped, mx.async_eval = overlapped, async_eval
    step, build, wait = sorted(runs)[len(runs) // 2]
    return {"step": step, "build": build, "async": wait}


if __name__ == "__main__":
    sys.exit(main())
