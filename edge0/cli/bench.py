"""`edge0 bench`: throughput experiments: model arms, --serve (the server under load), --kernels (the kernels
alone); edge0/bench/ measures and prints.

    edge0 bench --arms mlx-lm:f32,resident --rounds 3
"""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    _arm_args(p)
    p.add_argument("--affinity", metavar="FILE", default=None,
                   help="the co-activation table the prefetch:affinity arm reads (edge0 train affinity)")
    p.add_argument("--batch", default=None, metavar="SIZES",
                   help="with --routes FILE[,FILE..]: batches of these sizes (2,4,8), each row forced from its own "
                        "trace window, against the same sequences one after another (bench/route_batch.py)")
    p.add_argument("--kernels", action="store_true", help="the kernel micro-benchmark instead of model arms")
    _kernel_args(p)


def main(args: argparse.Namespace) -> int:
    from ..bench import bench_cli

    if args.batch is not None:  # rows forced from their own traces: bench/route_batch.py
        from ..bench.route_batch import bench_batches

        print("\n".join(bench_batches(args)))
        return 0
    return bench_cli(args, defaults())


def defaults() -> dict:
    """Every flag's default, by its dest."""
    p = argparse.ArgumentParser(add_help=False)
    add_args(p)
    return vars(p.parse_args([]))


def _arm_args(p: argparse.ArgumentParser) -> None:
    from ..bench import LLAMA_SETUP
    from ..bench.arms import ARMS
    from ..compute.choices import IO_MODES

    p.add_argument("--source", metavar="DIR", help="the mlx-lm checkpoint (for the mlx-lm arm; default with the built-in "
                                                   "model: its bf16 checkpoint, which its store was converted from)")
    p.add_argument("--store", metavar="DIR", help="the Edge0 store converted from it (default: the built-in model)")
    p.add_argument("--arms", default=None, help=f"comma-separated arms from {', '.join(ARMS)} (default mlx-lm,exact; "
                   "on the built-in model mlx-lm:f32,resident,predicted:resident: mlx-lm on its bf16 checkpoint in float32, "
                   "which MLX's CPU needs, and Edge0 as `edge0 run` runs it, with and without the heads); "
                   "prefetch:PREDICTOR/N reads ahead N guesses per set (--guesses N); ARM+MODE runs a prefetch or "
                   "streamed predicted arm with --read-ahead MODE (always, never; e.g. predicted+never)")
    p.add_argument("--lora", metavar="FILE", help="the predicted arm's adapter (default: lora-k{K}.safetensors beside "
                                                  "the store; predicted:no-lora runs without one)")
    p.add_argument("--cache", default="warm", help="comma-separated page-cache states: cold, warm (default warm)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each round runs every arm once (default 3)")
    p.add_argument("--max-tokens", type=int, default=32, help="decode tokens per run (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length in tokens (default 256)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GIB", help="passed to the Edge0 arms")
    p.add_argument("--slots", type=int, default=None, metavar="S",
                   help="slots per staged bank, passed to the arms that stream through one (native, staged, predicted, "
                        "prefetch:*); more slots keep more of a layer's recent experts (default 2K)")
    p.add_argument("--io-throttle", type=float, default=None, metavar="MBPS", help="passed to the Edge0 arms")
    p.add_argument("--io", default=None, choices=IO_MODES,
                   help="passed to the Edge0 arms (direct: every read from the disk); also how the read cost is measured")
    p.add_argument("--dtype", default="auto", help="compute dtype of the Edge0 arms (auto: float32 on CPU)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="compute threads: --kernel-threads of the Edge0 arms and n_threads of llama.cpp "
                        "(default: each Edge0 arm its engine's default, as `edge0 run` chooses it; llama.cpp the "
                        "edge0 kernels' default where every expert is resident: 2 on 2 cores; or "
                        "$EDGE0_KERNEL_THREADS)")
    p.add_argument("--gguf", metavar="FILE", default=None,
                   help=f"the llama.cpp arm's GGUF of the same model (made by {LLAMA_SETUP})")
    p.add_argument("--llama-python", metavar="PYTHON", default=None,
                   help="interpreter with llama_cpp importable, for the llama.cpp arm (default: this one)")
    p.add_argument("--memory-cap", default=None, metavar="GIB",
                   help="run every arm in a memory cgroup of GIB (page cache counted: a smaller machine); "
                        "none: a cgroup without a limit, to measure each arm's peak")
    p.add_argument("--replay", metavar="FILE", default=None,
                   help='JSON {"prompt": [ids], "tokens": [ids]} to replay in every arm (tokens recorded by the '
                        "exact path when absent); default: --prompt-tokens ids of Python source")
    p.add_argument("--replay-text", metavar="FILE", default=None,
                   help="real text to replay instead: its first --prompt-tokens ids (the store's tokenizer) are the "
                        "prompt, the next --max-tokens ids the forced decode tokens, so routing varies as on real "
                        "text (a random model's greedy tokens loop)")
    p.add_argument("--routes", metavar="FILE", default=None,
                   help="force every arm's routing from this routing trace (docs/USAGE.md, Routing traces; Edge0's "
                        "arms but predicted ones) and add the trace's LRU and optimal slot hit rates to the table")
    p.add_argument("--out", default="results", help="directory for results (default ./results)")
    p.add_argument("--serve", action="store_true", help="the load benchmark of edge0 serve instead of arms "
                                                        "(bench/serve.py: --clients, batched against FIFO)")
    # --serve's own flags; it shares --max-tokens, --prompt-tokens, --rounds, --out, --memory-budget, --io-throttle,
    # --dtype and --threads with the model arms
    p.add_argument("--clients", type=int, default=8, metavar="N", help="--serve: concurrent clients (default 8)")
    p.add_argument("--requests", type=int, default=4, metavar="R",
                   help="--serve: requests per client, one after another (default 4)")
    p.add_argument("--max-batch", type=int, default=None, metavar="B",
                   help="--serve: the batched arm's --max-batch (default: --clients); FIFO (1) runs beside it")
    p.add_argument("--model", metavar="STORE", default=None, help="--serve: the store to serve (default: the built-in model)")


def _kernel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel-threads", default="1,2", help="compute thread counts of the edge0 kernels to measure")
    p.add_argument("--kernel-impls", default=None,
                   help="code paths of the edge0 kernels to measure: avx512, avx2, portable (default: the SIMD ones built)")
    p.add_argument("--kernel-seconds", type=float, default=0.3, help="time per measurement")
    p.add_argument("--kernel-prefill-rows", type=int, default=256, help="rows of the prefill measurement (0: skip)")
    p.add_argument("--kernel-json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--kernel-graph", metavar="STORE", default=None,
                   help="also count the MLX graph nodes of one decode step of STORE under each kernel")
