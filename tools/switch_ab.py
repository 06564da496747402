"""Decode with one of the kernels' switches on against off, in one process, for docs/lab/cpu-kernels.md (issue #19).

    python tools/switch_ab.py --switch held|placement --replay R [--store S] [--threads 2] [--routing native]
        [--executor staged] [--slots N] [--rounds 15]

Switches (each on by default; the same bits either way):
  held       an Edge0 node keeps the arrays it is given already evaluated (a layer's weights) and lists only the
             others for MLX, which walks each listed input at every eval on the graph-building thread (csrc/bindings.cpp
             Held); off, it lists them all;
  placement  where a decode step's threads outnumber the cores (two decode threads on two cores), MLX's stream thread
             keeps one core to itself, the kernels' workers and the graph-building thread run on the others
             (compute/kernels.py graph_thread); off, every thread runs anywhere.
Each round generates the replay's forced tokens once per arm (the two in turn, alternating which goes first) on the
built-in model (or --store) with the engine's defaults and the given flags. Printed: each arm's median decode tok/s,
and the median over rounds of on / off within a round (paired: the host's drift cancels); the tokens must be the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def switches(kernels) -> dict:
    ext = kernels.load()
    return {"held": ext.set_holding, "placement": kernels.set_placement}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--switch", required=True, choices=("held", "placement"), help="the switch to pair on and off")
    p.add_argument("--replay", required=True, help="JSON {prompt: [ids], tokens: [ids]}")
    p.add_argument("--store", help="an Edge0 store (default: the built-in model)")
    p.add_argument("--threads", type=int, help="--kernel-threads (default: the kernels' default)")
    p.add_argument("--routing", help="--routing (default: the engine's)")
    p.add_argument("--executor", help="--executor (default: the engine's)")
    p.add_argument("--slots", type=int, help="--slots (default: the engine's)")
    p.add_argument("--rounds", type=int, default=15, help="rounds, each generating once per arm (default 15)")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: must be at least 1")
    from edge0.commands.run import read_replay
    from edge0.compute import kernels
    from edge0.config import EngineConfig
    from edge0.engine import demo_store, open_engine
    from edge0.errors import Edge0Error

    if kernels.load() is None:
        sys.exit(f"switch_ab: the edge0 CPU kernels are {kernels.reason()}")
    switch = switches(kernels)[a.switch]
    figs: dict[str, list] = {"on": [], "off": []}
    try:
        replay = read_replay(a.replay)
        forced = replay.get("tokens", [])
        if len(forced) < 2:
            raise Edge0Error(f"--replay {a.replay}: needs at least 2 forced tokens")
        cfg = EngineConfig(model=a.store or str(demo_store()), routing=a.routing, kernel_threads=a.threads,
                           executor=a.executor or "auto", slots=a.slots, kernel="edge0", prompt_cache_gib=0)
        with open_engine(cfg) as engine:
            req = engine.request(replay["prompt"], max_tokens=len(forced), forced=forced, ignore_eos=True)
            engine.generate(req)  # warm-up
            try:
                for i in range(a.rounds):
                    for arm in list(figs)[::1 if i % 2 == 0 else -1]:
                        switch(arm == "on")
                        figs[arm].append(engine.generate(req))
            finally:
                switch(True)
    except Edge0Error as e:
        sys.exit(f"switch_ab: error: {e}")
    if len({tuple(f.tokens) for fs in figs.values() for f in fs}) != 1:
        sys.exit("switch_ab: the arms gave different tokens (they must not)")
    med = {arm: statistics.median(f.decode_tok_s for f in fs) for arm, fs in figs.items()}
    ratio = statistics.median(x.decode_tok_s / y.decode_tok_s for x, y in zip(figs["on"], figs["off"]))
    print(f"decode: {a.switch} on {med['on']:.2f} tok/s, off {med['off']:.2f} tok/s, on / off {ratio:.3f}x "
          f"(paired, {a.rounds} rounds, {len(forced)} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
