"""What the unmerged adapter costs a decode step, in one process (issue #15): the engine's generations on real text
with the adapter as served (bfloat16), the adapter in float32, and no adapter, the three in an order rotated round by
round (edge0/bench/harness.py, after a warm-up of each), for docs/lab/cpu-kernels.md.

    python tools/lab/adapter_ab.py [--store S] [--rounds 9] [--prompt-tokens 256] [--max-tokens 257]
        [--executor staged] [--slots N]

Each round runs every arm once on the same prompt (--prompt-tokens ids of Python's json/decoder.py) and the same
forced tokens (the ids after it: routing varies as in use, and every arm does the same work); the arms swap the
model's adapted projections in place (model/lora.py LoRALinear, or the bare projection; an MoE block's
LoRABranch, or none). Printed: each arm's median
prefill and decode tok/s and, for each, the median over rounds of its ratio to `none` within the round (paired: the
host's drift cancels). The store must have an adapter (the built-in model's is lora-k4.safetensors).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from json import decoder

ARMS = ("bfloat16", "float32", "none")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default=None, help="an Edge0 store with an adapter (default: the built-in model)")
    p.add_argument("--rounds", type=int, default=9, help="rounds, each generating once per arm (default 9)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=257)
    p.add_argument("--lora", default=None, metavar="FILE", help="the adapter (default: the one the store serves)")
    p.add_argument("--executor", default="auto", help="--executor (default auto); staged: the streamed pipeline")
    p.add_argument("--slots", type=int, default=None, help="--slots, slots per staged bank (default 2K)")
    a = p.parse_args()
    if min(a.rounds, a.prompt_tokens, a.max_tokens) < 1:
        p.error("--rounds, --prompt-tokens and --max-tokens must be at least 1")
    import mlx.core as mx

    from edge0.bench.harness import group, medians, paired, run_rounds
    from edge0.config import EngineConfig, IOConfig, RoutingConfig, ServingConfig
    from edge0.engine import open_engine
    from edge0.errors import Edge0Error
    from edge0.decode.request import GenRequest
    from edge0.model.lora import Adapter, LoRABranch, LoRALinear, adapted, put_projection

    def place(model, name: str, m) -> None:
        """An arm's module at `name`; None: no branch beside the MoE block there."""
        if m is not None:
            put_projection(model, name, m)
        else:
            block = model.layers[int(name.split(".")[1])]["mlp"]
            if "branch" in block:
                del block["branch"]

    def float32(k, m):
        a_, b_ = originals[k]
        return LoRABranch(a_, b_, m.scale) if isinstance(m, LoRABranch) else LoRALinear(m["base"], a_, b_, m.scale)

    try:
        with open_engine(EngineConfig(model=a.store, routing=RoutingConfig(lora=a.lora),
                                      io=IOConfig(executor=a.executor, slots=a.slots),
                                      serving=ServingConfig(prompt_cache_gib=0))) as engine:
            served = adapted(engine.store.model)
            if not served:
                raise Edge0Error(f"{engine.config.model}: the engine serves no adapter (--lora none, or none beside the "
                                 "store)")
            originals = Adapter.read(engine.config.routing.lora).weights
            arms = {"bfloat16": served,
                    "float32": {k: float32(k, m) for k, m in served.items()},
                    "none": {k: None if isinstance(m, LoRABranch) else m["base"] for k, m in served.items()}}
            mx.eval([m.parameters() for m in arms["float32"].values()])
            ids = engine.encode_text(inspect.getsource(decoder))
            if len(ids) < a.prompt_tokens + a.max_tokens:
                raise Edge0Error(f"--prompt-tokens + --max-tokens: json/decoder.py has {len(ids)} tokens")
            req = GenRequest(prompt=ids[:a.prompt_tokens], max_tokens=a.max_tokens, ignore_eos=True,
                             forced=ids[a.prompt_tokens:a.prompt_tokens + a.max_tokens])

            def measure(arm, r):
                for name, m in arms[arm].items():
                    place(engine.store.model, name, m)
                f = engine.generate(req)
                return {"prefill_tok_s": f.prefill_tok_s, "decode_tok_s": f.decode_tok_s}

            try:
                by = group(run_rounds(ARMS, a.rounds, measure, warmup=1))
            finally:
                for name, m in served.items():
                    place(engine.store.model, name, m)
    except Edge0Error as e:
        sys.exit(f"adapter_ab: {e}")
    print(f"{engine.config.routing.lora}: {len(served)} adapted projections, {a.rounds} rounds, "
          f"{a.prompt_tokens}-token prompt, {a.max_tokens} forced tokens")
    for what in ("prefill_tok_s", "decode_tok_s"):
        med, ratio = medians(by, [what]), paired(by, what, "none")
        parts = [f"{arm} {med[arm][what]:.1f} tok/s ({ratio[arm].median:.3f}x none)" for arm in ARMS]
        print(f"{what.split('_')[0]}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
