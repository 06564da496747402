"""A streamed layer's decided decode step as one node over its slot bank (pipeline/prefetch.py bank_step: Edge0MoeBlock
with a table of each candidate's slot) against the same step built call by call, in one process, for
docs/lab/pipeline.md (issue #18).

    python tools/lab/bank_step_ab.py [--store S] [--slots N] [--io pread|direct] [--rounds 9] [--replay FILE]
        [--prompt-tokens 256] [--max-tokens 129]

Predicted routing on the staged executor. Each round generates once with the one-node step and once without it (the
two in turn, alternating which goes first), on the same prompt and forced tokens: --replay's ({"prompt": [ids],
"tokens": [ids]}, as `edge0 bench --replay` takes), else --prompt-tokens ids of Python's json/decoder.py and the ids
after them, so routing varies as on real text. Printed: each arm's median decode tok/s and the median over rounds of
one node / call by call within a round (paired: the host's drift cancels). The tokens must be the same.
Rounds (after a warm-up of each arm), medians and the paired ratio are edge0/bench/harness.py's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from json import decoder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default=None, help="an Edge0 store with heads (default: the built-in model)")
    p.add_argument("--slots", type=int, default=None, help="--slots, slots per staged bank (default 2K)")
    p.add_argument("--io", default="pread", choices=("pread", "direct"), help="--io (direct: every read from the disk)")
    p.add_argument("--rounds", type=int, default=9, help="rounds, each generating once per arm (default 9)")
    p.add_argument("--replay", default=None, metavar="FILE", help="prompt and forced tokens (JSON)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=129)
    a = p.parse_args()
    if min(a.rounds, a.prompt_tokens, a.max_tokens) < 1:
        p.error("--rounds, --prompt-tokens and --max-tokens must be at least 1")
    from edge0.bench.harness import group, medians, paired, run_rounds
    from edge0.compute import kernels
    from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig, ServingConfig
    from edge0.engine import open_engine
    from edge0.errors import Edge0Error
    from edge0.decode.request import GenRequest
    from edge0.pipeline.prefetch import PrefetchExperts

    if kernels.load() is None:
        sys.exit(f"bank_step_ab: the edge0 CPU kernels are {kernels.reason()}")
    one_node = PrefetchExperts.bank_step
    arms = {"one node": one_node, "call by call": lambda self: None}
    try:
        with open_engine(EngineConfig(model=a.store, routing=RoutingConfig(mode="predicted"),
                                      io=IOConfig(executor="staged", slots=a.slots, mode=a.io),
                                      kernel=KernelConfig(name="edge0"),
                                      serving=ServingConfig(prompt_cache_gib=0))) as engine:
            if a.replay:
                try:
                    r = json.loads(open(a.replay).read())
                    prompt, forced = list(r["prompt"]), list(r["tokens"])[:a.max_tokens]
                except (OSError, ValueError, KeyError, TypeError) as e:
                    raise Edge0Error(f"--replay {a.replay}: not a replay file ({e})") from None
            else:
                ids = engine.encode_text(inspect.getsource(decoder))
                prompt, forced = ids[:a.prompt_tokens], ids[a.prompt_tokens:a.prompt_tokens + a.max_tokens]
            req = GenRequest(prompt=prompt, max_tokens=len(forced), ignore_eos=True, forced=forced)

            def measure(arm, r):
                PrefetchExperts.bank_step = arms[arm]
                f = engine.generate(req)
                return {"decode_tok_s": f.decode_tok_s, "tokens": tuple(f.tokens)}

            try:
                by = group(run_rounds(list(arms), a.rounds, measure, warmup=1))
            finally:
                PrefetchExperts.bank_step = one_node
    except Edge0Error as e:
        sys.exit(f"bank_step_ab: {e}")
    if len({row["tokens"] for rows in by.values() for row in rows}) != 1:
        sys.exit("bank_step_ab: the arms gave different tokens (they must not)")
    med = {arm: m["decode_tok_s"] for arm, m in medians(by, ["decode_tok_s"]).items()}
    ratio = paired(by, "decode_tok_s", "call by call")["one node"].median
    print(f"decode: one node {med['one node']:.2f} tok/s, call by call {med['call by call']:.2f} tok/s, "
          f"one node / call by call {ratio:.3f}x (paired, {a.rounds} rounds, {len(forced)} tokens, --io {a.io})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
