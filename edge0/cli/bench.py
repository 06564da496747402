"""`edge0 bench`: throughput experiments: model arms, --serve (the server under load), --kernels (the kernels
alone); edge0/bench/ measures and prints.

    edge0 bench --arms mlx-lm:f32,resident --rounds 3
"""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    from ..bench import add_bench_flags
    from ..bench.kernels import add_bench_kernels_flags

    add_bench_flags(p)
    p.add_argument("--kernels", action="store_true", help="the kernel micro-benchmark instead of model arms")
    add_bench_kernels_flags(p)


def main(args: argparse.Namespace) -> int:
    from ..bench import bench_cli

    return bench_cli(args)
