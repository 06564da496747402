"""`edge0 export-gguf STORE OUT.gguf`: an Edge0 store as a GGUF file that llama.cpp runs (edge0/export/gguf.py).

    edge0 export-gguf ~/stores/q3-paper ~/q3-paper.gguf             # q4_1: the store's very weights
"""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    from ..export.plan import TYPES

    p.add_argument("store", metavar="STORE", help="Edge0 store (made by `edge0 convert`)")
    p.add_argument("out", metavar="OUT.gguf", help="GGUF file to write")
    p.add_argument("--type", dest="qtype", default="q4_1", choices=TYPES,
                   help="q4_1: the store's 4-bit weights exactly (default); q4_0: experts re-quantized to Q4_0")
    p.add_argument("--force", action="store_true", help="replace OUT.gguf if it is a GGUF file (never other files)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from ..export.gguf import export_gguf
    from ..io.atomic import human

    r = export_gguf(args.store, args.out, qtype=args.qtype, force=args.force, progress=not args.quiet)
    inexact = (f"; Q4_1 scales and biases: {r.fp16_inexact} of {r.fp16_values} rounded to fp16" if r.fp16_inexact
               else f"; Q4_1 scales and biases: all {r.fp16_values} exact in fp16" if r.fp16_values else "")
    print(f"wrote {r.path} ({r.tensors} tensors, {human(r.bytes)}, {r.qtype}{inexact}) in {r.seconds:.1f} s",
          file=sys.stderr)
    return 0
