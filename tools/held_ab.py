"""Decode with the layer nodes' weights held by the nodes against listed as MLX inputs, in one process, for
docs/results/cpu-kernels.md (issue #19).

    python tools/held_ab.py --replay R [--store S] [--threads 1] [--routing native] [--rounds 15]

An Edge0 attention or MoE block node keeps the arrays it is given already evaluated (a layer's weights) and lists only
the others for MLX (csrc/bindings.cpp Held): MLX walks each listed input at every eval on the graph-building thread.
The other arm (`set_holding(False)`) lists them all, as before. Each round generates the replay's forced tokens once
per arm (the two in turn, alternating which goes first) on the built-in model (or --store) with the engine's defaults
and the given flags. Printed: each arm's median decode tok/s, and the median over rounds of held / listed within a
round (paired: the host's drift cancels); the tokens must be the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replay", required=True, help="JSON {prompt: [ids], tokens: [ids]}")
    p.add_argument("--store", help="an Edge0 store (default: the built-in model)")
    p.add_argument("--threads", type=int, help="--kernel-threads (default: the kernels' default)")
    p.add_argument("--routing", help="--routing (default: the engine's)")
    p.add_argument("--rounds", type=int, default=15, help="rounds, each generating once per arm (default 15)")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: must be at least 1")
    from edge0.commands.run import read_replay
    from edge0.compute import kernels
    from edge0.config import EngineConfig
    from edge0.engine import demo_store, open_engine
    from edge0.errors import Edge0Error

    ext = kernels.load()
    if ext is None:
        sys.exit(f"held_ab: the edge0 CPU kernels are {kernels.reason()}")
    figs: dict[str, list] = {"held": [], "listed": []}
    try:
        replay = read_replay(a.replay)
        forced = replay.get("tokens", [])
        if len(forced) < 2:
            raise Edge0Error(f"--replay {a.replay}: needs at least 2 forced tokens")
        cfg = EngineConfig(model=a.store or str(demo_store()), routing=a.routing, kernel_threads=a.threads,
                           kernel="edge0", prompt_cache_gib=0)
        with open_engine(cfg) as engine:
            req = engine.request(replay["prompt"], max_tokens=len(forced), forced=forced, ignore_eos=True)
            engine.generate(req)  # warm-up
            try:
                for i in range(a.rounds):
                    for arm in list(figs)[::1 if i % 2 == 0 else -1]:
                        ext.set_holding(arm == "held")
                        figs[arm].append(engine.generate(req))
            finally:
                ext.set_holding(True)
    except Edge0Error as e:
        sys.exit(f"held_ab: error: {e}")
    if len({tuple(f.tokens) for fs in figs.values() for f in fs}) != 1:
        sys.exit("held_ab: the arms gave different tokens (they must not)")
    med = {arm: statistics.median(f.decode_tok_s for f in fs) for arm, fs in figs.items()}
    ratio = statistics.median(x.decode_tok_s / y.decode_tok_s for x, y in zip(figs["held"], figs["listed"]))
    print(f"decode: held {med['held']:.2f} tok/s, listed {med['listed']:.2f} tok/s, held / listed {ratio:.3f}x "
          f"(paired, {a.rounds} rounds, {len(forced)} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
