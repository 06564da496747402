"""The outputs a change to the kernels must leave bit for bit, saved and compared (docs/lab/cpu-kernels.md).

    python tools/output_bits.py --store S --replay R --out before.npz
    PYTHONPATH=/path/to/other/tree python tools/output_bits.py --store S --replay R --out after.npz --against before.npz

Saves, under predicted routing (where the store has heads) and native routing, the log-probabilities of every
position of the replay's prompt and tokens (forced) and the greedy tokens after the prompt. With --against, says
which arrays differ from that file's and exits 1 if any does. Run it from outside the repository to measure
another tree through PYTHONPATH.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def outputs(store: str, replay: dict, greedy: int) -> dict:
    import numpy as np

    from edge0.config import EngineConfig, RoutingConfig, ServingConfig
    from edge0.engine import default_heads, open_engine

    routings = (["predicted"] if default_heads(Path(store), None) else []) + ["native"]
    out = {}
    for routing in routings:
        with open_engine(EngineConfig(model=store, routing=RoutingConfig(mode=routing),
                                      serving=ServingConfig(prompt_cache_gib=0))) as engine:
            out[f"{routing}_logprobs"] = np.array(engine.forced_logprobs(replay["prompt"] + replay.get("tokens", [])))
            figures = engine.generate(engine.request(replay["prompt"], max_tokens=greedy, ignore_eos=True))
            out[f"{routing}_tokens"] = np.array(figures.tokens)
    return out


def main() -> int:
    import numpy as np

    from edge0.cli.run import read_replay
    from edge0.errors import Edge0Error

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--replay", required=True, help="JSON {prompt: [ids], tokens: [ids]}")
    p.add_argument("--greedy", type=int, default=200, help="greedy tokens after the prompt (default 200)")
    p.add_argument("--out", required=True, help=".npz to write")
    p.add_argument("--against", help=".npz of an earlier run to compare with")
    a = p.parse_args()
    try:
        replay = read_replay(a.replay)
        want = dict(np.load(a.against)) if a.against else None
    except (OSError, ValueError) as e:
        sys.exit(f"output_bits: error: --against {a.against}: {e}")
    except Edge0Error as e:
        sys.exit(f"output_bits: error: {e}")
    saved = outputs(a.store, replay, a.greedy)
    np.savez(a.out, **saved)
    if want is None:
        print(f"wrote {a.out}: {', '.join(f'{k} {v.shape}' for k, v in saved.items())}")
        return 0
    differ = [k for k in sorted(set(saved) | set(want))
              if k not in saved or k not in want or not np.array_equal(saved[k], want[k])]
    for k in sorted(set(saved) | set(want)):
        print(f"{k}: {'differs' if k in differ else 'equal'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
