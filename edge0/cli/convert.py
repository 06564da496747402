"""`edge0 convert SRC OUT`: an mlx-lm (4-bit) or Hugging Face MoE checkpoint as an Edge0 store."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="checkpoint directory (config.json, model*.safetensors, tokenizer)")
    p.add_argument("out", metavar="OUT", help="store directory to write (must be empty or absent)")
    p.add_argument("--bits", type=int, default=None,
                   help="quantization bits for float sources (default 4; an mlx-lm source keeps its own)")
    p.add_argument("--group-size", type=int, default=None,
                   help="quantization group size for float sources: 32, 64 or 128 (default 64)")
    p.add_argument("--force", action="store_true", help="replace OUT if it is an earlier store (never other files)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from ..model.convert import convert

    quant = {k: v for k, v in (("bits", args.bits), ("group_size", args.group_size)) if v is not None}
    print(f"wrote {convert(args.src, args.out, force=args.force, progress=not args.quiet, **quant)}", file=sys.stderr)
    return 0
