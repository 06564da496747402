"""Each rank's share of one process's expert reads and memory (issue #62's per-rank goal), measured as `edge0 run`
would run: one process first, then N local ranks under mlx.launch, the same prompt, tokens and routing.

    python tools/dist_share.py --model /tmp/e60/olmoe --routes tests/data/olmoe/olmoe-1b-7b-seed1.json --tokens 96
    python tools/dist_share.py --model STORE --parallel experts --split cost --ranks 2

Prints, per rank, decode bytes read per token, peak MLX memory and weights as fractions of one process's (goal:
at most 1.15 / ranks), and the hidden-state bytes and messages it sent. Staged executor, native routing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROMPT = "The history of the city begins with a small settlement on the river, where"


def measure(model: str, tokens: int, routes: str | None) -> dict:
    """This process's (or rank's) figures for one generation."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from edge0 import dist
    from edge0.config import EngineConfig, IOConfig, RoutingConfig
    from edge0.dist.routes import rank_routes
    from edge0.io.routetrace import read_trace
    from edge0.model.traced import attach_routes

    config = EngineConfig(model=model, routing=RoutingConfig(mode="native", lora="none"),
                          io=IOConfig(executor="staged"))
    trace = read_trace(routes) if routes else None
    with dist.open_engine(config, quiet_others=False, routes=trace, routes_file=routes) as engine:
        req = engine.request(engine.encode_text(PROMPT), max_tokens=tokens, ignore_eos=True)
        if trace is not None:
            attach_routes(engine, rank_routes(engine, trace), req, routes_file=routes, record=None)
        stats, first = engine.store.reader.stats, []
        before = stats.bytes
        fig = engine.generate(req, cancelled=lambda: first.append(stats.bytes) or False)  # first call: prompt done
        link = getattr(engine, "stage", None) or getattr(engine, "traffic", None)
        return {"rank": int(os.environ.get("MLX_RANK", "0")), "tokens": fig.tokens,
                "decode_bytes": (before + fig.bytes_read - first[0]) / max(len(fig.tokens) - 1, 1),
                "peak": fig.peak_mlx_bytes, "weights": sum(v.nbytes for _, v in tree_flatten(
                    engine.store.model.parameters())), "active_after": mx.get_active_memory(),
                "sent": link.bytes_sent if link else 0, "messages": link.messages if link else 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--routes", help="a routing trace to force (docs/USAGE.md, Routing traces)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--parallel", choices=("pipeline", "experts"), default="pipeline")
    p.add_argument("--split", default="even")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank's run, under mlx.launch
    args = p.parse_args()
    if args.rank:
        print("dist_share " + json.dumps(measure(args.model, args.tokens, args.routes)), flush=True)
        return 0
    from edge0.cli.launch import LAUNCHER
    from edge0.dist import MODE_ENV
    from edge0.dist.split import SPLIT_ENV

    one = measure(args.model, args.tokens, args.routes)
    mine = [sys.executable, __file__, "--rank", "--model", args.model, "--tokens", str(args.tokens)]
    mine += ["--routes", args.routes] if args.routes else []
    out = subprocess.run([sys.executable, "-c", LAUNCHER, "-n", str(args.ranks), "--backend", "ring",
                          "--env", f"{MODE_ENV}={args.parallel}", "--env", f"{SPLIT_ENV}={args.split}", "--", *mine],
                         capture_output=True, text=True)
    ranks = sorted((json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
                    if line.startswith("dist_share ")), key=lambda r: r["rank"])
    if len(ranks) != args.ranks:
        sys.stderr.write(out.stderr[-2000:])
        return 1
    print(f"one process: {one['decode_bytes'] / 1e6:.1f} MB read per decode token, peak {one['peak'] / 1e9:.3f} GB")
    for r in ranks:
        print(f"rank {r['rank']}: reads {r['decode_bytes'] / one['decode_bytes']:.3f}, peak {r['peak'] / one['peak']:.3f}, "
              f"weights {r['weights'] / one['weights']:.3f}, sent {r['sent'] / max(len(r['tokens']), 1) / 1024:.1f} KiB "
              f"in {r['messages'] / max(len(r['tokens']), 1):.1f} messages a token, tokens as one process: "
              f"{r['tokens'] == one['tokens']}")
    print(f"goal: at most {1.15 / args.ranks:.3f}")
    return 0


if __name__ == "__main__":
    from edge0.errors import Edge0Error

    try:
        sys.exit(main())
    except Edge0Error as e:  # a missing model or trace, a flag out of range: one line
        print(f"dist_share: error: {e}", file=sys.stderr)
        sys.exit(2)
