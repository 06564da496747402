"""The `edge0` command: one console script, one subcommand per job (`edge0 --help`)."""

from __future__ import annotations

import argparse
import sys

from .errors import Edge0Error



def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `edge0 run` (DESIGN.md section 1); machinery of later stages answers 'not available yet'."""
    p.add_argument("--model", metavar="DIR", help="Edge0 store (made by `edge0 convert`); default: the built-in demo model")
    p.add_argument("--prompt", default=None, help="prompt text (default: a short Python prompt)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument("--temp", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1.0: off)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--routing", choices=["native", "prefetch", "predicted"], default=None,
                   help="native: the model's router, experts read on demand; prefetch: the model's router decides, "
                        "predicted experts are read one token ahead by the I/O pool (same output as native); "
                        "predicted: trained prerouter heads route the consumer layers (default when the store has "
                        "heads-k{K}.safetensors, else native)")
    p.add_argument("--executor", choices=["auto", "exact", "staged", "hot", "resident"], default="auto",
                   help="exact: read the routed experts into fresh arrays every step; staged: per-layer double-buffered "
                        "slot banks, only changed slots read; hot: one LRU of bundles shared by all layers within "
                        "--memory-budget (auto: staged); resident: every expert loaded at start (the compute floor, "
                        "for benchmarks). staged and hot read each layer whole for prefill")
    p.add_argument("--predictor", choices=["repeat", "next-router", "heads"], default=None,
                   help="what --routing prefetch reads ahead: repeat (the layer's set at t), next-router (layer N+1's "
                        "router on layer N's input; default), heads (the trained prerouter heads, --heads)")
    p.add_argument("--io-workers", type=int, default=2, metavar="N", help="I/O pool threads for prefetch (default 2)")
    p.add_argument("--slots", type=int, default=None, metavar="S",
                   help="slots per staged bank (default 2K); more slots keep more experts between steps")
    p.add_argument("--heads", metavar="FILE", default=None,
                   help="prerouter heads (default: heads-k{K}.safetensors next to the store); implies --predictor heads "
                        "with --routing prefetch")
    p.add_argument("--k", type=int, default=None, metavar="K", help="routed experts per token (default: the model's)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="most GiB of expert bundles held resident (slot banks, LRU, prefill banks); hot default 1")
    p.add_argument("--io", choices=["pread", "mmap", "direct"], default="pread",
                   help="pread: preadv into the banks (default); mmap: copy from a mapping; direct: O_DIRECT")
    p.add_argument("--io-throttle", type=float, default=None, metavar="MBPS",
                   help="cap read bandwidth at MBPS MB/s (an experiment knob: a slow disk on a fast machine)")
    p.add_argument("--replay", metavar="FILE", default=None,
                   help='JSON {"prompt": [ids], "tokens": [ids]}: fixed prompt ids and forced decode tokens (benchmarks)')
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (float32 on CPU), source, float32, bfloat16, float16")
    p.add_argument("--kernel", choices=["auto", "mlx", "edge0"], default=None,
                   help="quantized products and per-token dense ops: edge0 (the built CPU extension: int8 activations, "
                        "AVX-512 VNNI or AVX2), mlx (MLX's own), "
                        "auto (edge0 on CPU when built; default, or $EDGE0_KERNEL)")
    p.add_argument("--kernel-threads", type=int, default=None, metavar="N", help="threads of the edge0 kernels")
    p.add_argument("--cold", action="store_true", help="evict the store from the page cache before loading")
    p.add_argument("--verify", action="store_true", help="check the checksum of every bundle read")
    p.add_argument("--trace", metavar="PATH", default=None,
                   help="write a Chrome trace-event timeline (Perfetto); analyse with `edge0 trace summarize PATH`")
    p.add_argument("--json", action="store_true", help="print only one JSON object with the tokens and figures, at the end")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge0", description="Serve MoE models larger than memory, experts streamed from SSD.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="generate text, streaming tokens to stdout", description="Generate text with an Edge0 store.")
    add_run_flags(p)

    p = sub.add_parser("convert", help="mlx-lm 4-bit or Hugging Face MoE checkpoint -> Edge0 store",
                       description="Turn an mlx-lm (4-bit) or Hugging Face (bf16/fp16/fp32) MoE checkpoint into an Edge0 store.")
    p.add_argument("src", metavar="SRC", help="checkpoint directory (config.json, model*.safetensors, tokenizer)")
    p.add_argument("out", metavar="OUT", help="store directory to write (must be empty or absent)")
    p.add_argument("--bits", type=int, default=4, help="quantization bits for float sources (default 4)")
    p.add_argument("--group-size", type=int, default=64, help="quantization group size for float sources (default 64)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("verify", help="check every bundle checksum and header of a store")
    p.add_argument("store", metavar="STORE")

    p = sub.add_parser("make-model", help="write a random-weight MoE checkpoint of a real architecture",
                       description="Write a random-weight checkpoint (mlx-lm or Hugging Face layout) with a tokenizer.")
    p.add_argument("--arch", required=True, help="qwen3_moe | qwen3_5_moe | bailing_moe")
    p.add_argument("--preset", default="tiny", help="tiny (tests) | small (benchmarks) | paper-35b (paper shapes, ~19 GB)")
    p.add_argument("--format", default="mlx", choices=["mlx", "hf"], help="mlx: mlx-lm 4-bit (default); hf: Hugging Face bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument("out", metavar="OUT")

    p = sub.add_parser("train", help="train: base (the demo model), heads (Phase 1)",
                       description="Training phases. LoRA (Phase 2) and distillation (Phase 3) are not available yet.")
    train = p.add_subparsers(dest="phase", required=True, metavar="PHASE")
    from .train.base import add_train_base_flags
    from .train.heads import add_train_heads_flags

    add_train_base_flags(train.add_parser("base", help="train a small MoE LM from scratch on the stdlib's source"))
    add_train_heads_flags(train.add_parser("heads", help="distil prerouter heads on a store (Phase 1)"))
    for phase in ("lora", "distill"):
        q = train.add_parser(phase, help=f"{phase} (not available yet)")
        q.add_argument("rest", nargs=argparse.REMAINDER)

    p = sub.add_parser("eval", help="quality of the served path: perplexity, top-1 agreement and KL vs a teacher",
                       description="Evaluate a store (or an mlx-lm checkpoint) on held-out text.")
    from .eval import add_eval_flags

    add_eval_flags(p)

    p = sub.add_parser("trace", help="read a timeline trace: breakdown, load-cost fit, plot",
                       description="Summarize a trace written by `edge0 run --trace PATH`.")
    p.add_argument("action", choices=["summarize"])
    p.add_argument("file", metavar="FILE")
    p.add_argument("--plot", metavar="PNG", help="draw a few steps' timeline and the load-cost fit")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")

    p = sub.add_parser("bench", help="throughput experiments (each arm in its own process)")
    from .bench import add_bench_flags
    from .bench_kernels import add_bench_kernels_flags

    add_bench_flags(p)
    p.add_argument("--kernels", action="store_true", help="the kernel micro-benchmark instead of model arms")
    add_bench_kernels_flags(p)

    from .serve import add_chat_flags, add_serve_flags

    add_serve_flags(sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and text completions, SSE)",
                                   description="Serve a store over an OpenAI-compatible HTTP API."))
    add_chat_flags(sub.add_parser("chat", help="interactive terminal chat", description="Chat with a store."))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            from .run import run

            return run(args)
        if args.command == "convert":
            from .model.convert import convert

            out = convert(args.src, args.out, bits=args.bits, group_size=args.group_size, force=args.force,
                          progress=not args.quiet)
            print(f"wrote {out}", file=sys.stderr)
            return 0
        if args.command == "verify":
            return verify(args.store)
        if args.command == "make-model":
            from .model.make import make_model

            out = make_model(args.arch, args.preset, args.out, fmt=args.format, seed=args.seed, force=args.force)
            print(f"wrote {out}", file=sys.stderr)
            return 0
        if args.command == "train":
            if args.phase == "base":
                from .train.base import train_base_cli

                return train_base_cli(args)
            if args.phase == "heads":
                from .train.heads import train_heads_cli

                return train_heads_cli(args)
            raise Edge0Error(f"`edge0 train {args.phase}`: not available yet")
        if args.command == "eval":
            from .eval import eval_cli

            return eval_cli(args)
        if args.command == "trace":
            from .sched.summarize import trace_cli

            return trace_cli(args)
        if args.command == "bench":
            if args.kernels:
                from .bench_kernels import bench_kernels

                bench_kernels(args)
                return 0
            from .bench import bench

            return bench(args)
        if args.command == "serve":
            from .serve import serve_cli

            return serve_cli(args)
        if args.command == "chat":
            from .serve import chat_cli

            return chat_cli(args)
        raise Edge0Error(f"`edge0 {args.command}`: unknown command")
    except Edge0Error as e:
        print(f"edge0: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def verify(store: str) -> int:
    from tqdm import tqdm

    from .io.manifest import read_manifest
    from .io.reader import verify_store

    manifest = read_manifest(store)
    total = manifest.num_experts * len(manifest.layers)
    with tqdm(total=total, unit="bundle", desc="verify", file=sys.stderr) as bar:
        problems = verify_store(store, bar)
    for p in problems:
        print(f"edge0: error: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"{store}: {total} bundles in {len(manifest.layers)} layer files verified", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
