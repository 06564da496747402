"""A replay's generation repeated in one process, for profilers that need a long steady decode (perf, strace, py-spy).

    perf record -F 5000 -D 3000 -- python tools/decode_loop.py --replay R --repeat 60
    strace -f -c -e trace=futex -- python tools/decode_loop.py --replay R --repeat 10

Each round prefills the replay's prompt and decodes --tokens of its forced tokens on the built-in model (or
--store), with the engine's defaults (or --routing); prints the rounds' median decode tok/s and the decode steps
run.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    from edge0.cli.run import read_replay
    from edge0.bench.harness import median, run_rounds
    from edge0.config import EngineConfig, RoutingConfig, ServingConfig
    from edge0.engine import demo_store, open_engine
    from edge0.errors import Edge0Error

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", help="an Edge0 store (default: the built-in model)")
    p.add_argument("--replay", required=True, help="JSON {prompt: [ids], tokens: [ids]}")
    p.add_argument("--repeat", type=int, default=20, help="generations (default 20)")
    p.add_argument("--tokens", type=int, default=128, help="forced tokens decoded a generation (default 128)")
    p.add_argument("--routing", default=None, help="--routing (default: the engine's)")
    a = p.parse_args()
    try:
        replay = read_replay(a.replay)
        forced = replay.get("tokens", [])[:a.tokens]
        if len(forced) < 2:
            raise Edge0Error(f"--replay {a.replay}: needs at least 2 forced tokens")
        with open_engine(EngineConfig(model=a.store or str(demo_store()), routing=RoutingConfig(mode=a.routing),
                                      serving=ServingConfig(prompt_cache_gib=0))) as engine:
            def generation(arm, r):
                req = engine.request(replay["prompt"], max_tokens=len(forced), forced=forced, ignore_eos=True)
                return {"decode_tok_s": engine.generate(req).decode_tok_s}

            rows = run_rounds(["decode"], a.repeat, generation)
    except Edge0Error as e:
        sys.exit(f"decode_loop: error: {e}")
    rate = median(rows, "decode_tok_s")
    print(f"{a.repeat} generations, {a.repeat * (len(forced) - 1)} decode steps, median {rate:.1f} decode tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
