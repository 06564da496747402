"""`edge0 eval`: the quality of the served path (perplexity, top-1 agreement and KL vs a teacher), edge0/bench/quality.py.

    edge0 eval --model edge0/model/demo/store --teacher edge0/model/demo/fp
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .flags import add_engine_flags, engine_config, flags_given


def add_args(p: argparse.ArgumentParser) -> None:
    from ..bench.quality import MAX_TOKENS, SEQ_LEN

    add_engine_flags(p, model_help="an Edge0 store (scored as `edge0 run` serves it: the same routing defaults) "
                                   "or an mlx-lm checkpoint; default the built-in model")
    p.add_argument("--data", default=None,
                   help="a text file, a directory (its .py files), or a .npy of token ids; default the stdlib held-out split")
    p.add_argument("--teacher", default=None, help="the reference model (normally the float checkpoint) for agreement and KL")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens scored at most")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per window")
    p.add_argument("--routing-stats", action="store_true", help="also expert usage and cross-token overlap per layer")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def main(args: argparse.Namespace) -> int:
    from ..errors import Edge0Error
    from ..bench.quality import evaluate
    from ..model.demo import DEMO_STORE

    if args.max_tokens < 1 or args.seq_len < 1:
        raise Edge0Error("--max-tokens and --seq-len must be positive")
    model = Path(args.model) if args.model else DEMO_STORE
    config = engine_config(args) if (model / "edge0.json").exists() else None
    given = flags_given(args, add_engine_flags, skip=("model", "dtype")) if config is None else []
    if given:  # an mlx-lm checkpoint is scored as mlx-lm loads it: the store's flags would be dropped
        raise Edge0Error(f"{given[0]}: used with an Edge0 store; --model {model} is not one (no edge0.json)")
    r = evaluate(model, args.data, teacher=args.teacher, max_tokens=args.max_tokens, seq_len=args.seq_len,
                 dtype=args.dtype, routing=args.routing_stats, config=config)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['model']} ({r['kind']}) on {r['data']}: {r['tokens']} tokens, loss {r['loss']:.4f} nats/token, ppl {r['ppl']:.3f}")
    if "teacher" in r:
        print(f"teacher {r['teacher']}: ppl {r['teacher_ppl']:.3f}; top-1 agreement {r['top1_agreement']:.4f}, "
              f"KL(teacher||model) {r['kl']:.5f} nats/token")
    if "routing" in r:
        s = r["routing"]
        for i, (u, e, o) in enumerate(zip(s["used_fraction"], s["effective_fraction"], s["overlap"])):
            print(f"layer {i}: experts used {u:.2f}, effective {e:.2f}, overlap t->t+1 {o:.3f}")
        print(f"mean overlap {s['overlap_mean']:.3f} (independent routing: {s['overlap_independent']:.3f})")
    return 0
