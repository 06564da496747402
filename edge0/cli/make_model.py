"""`edge0 make-model --arch A OUT`: a random-weight checkpoint of a real MoE architecture, with a tokenizer."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", required=True, help="an MoE family by mlx-lm's module name: qwen3_moe, qwen3_5_moe, "
                   "bailing_moe (all presets), mixtral, deepseek_v3, gpt_oss, ... (tiny; README lists them)")
    p.add_argument("--preset", default="tiny", help="tiny (tests) | small (benchmarks) | paper-35b (paper shapes, ~19 GB) | "
                   "olmoe-1b-7b, qwen3-30b-a3b (real models' shapes, qwen3_moe; 3.5 and 15.7 GiB of experts)")
    p.add_argument("--format", default="mlx", choices=["mlx", "hf"], help="mlx: mlx-lm 4-bit (default); hf: Hugging Face bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it is an earlier make-model output (never other files)")
    p.add_argument("out", metavar="OUT")


def main(args: argparse.Namespace) -> int:
    from ..config.checks import check_seed
    from ..model.make import make_model

    check_seed(args.seed)
    print(f"wrote {make_model(args.arch, args.preset, args.out, fmt=args.format, seed=args.seed, force=args.force)}",
          file=sys.stderr)
    return 0
