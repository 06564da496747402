"""The `edge0` command: one console script, one subcommand per job (`edge0 --help`).

Each subcommand's flags and code live in its own module; this file only assembles the parser and
dispatches, importing a command's module when that command runs (start-up stays fast).
"""

from __future__ import annotations

import argparse
import sys

from .commands import guarded
from .errors import Edge0Error


def _convert_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="checkpoint directory (config.json, model*.safetensors, tokenizer)")
    p.add_argument("out", metavar="OUT", help="store directory to write (must be empty or absent)")
    p.add_argument("--bits", type=int, default=None,
                   help="quantization bits for float sources (default 4; an mlx-lm source keeps its own)")
    p.add_argument("--group-size", type=int, default=None,
                   help="quantization group size for float sources: 32, 64 or 128 (default 64)")
    p.add_argument("--force", action="store_true", help="replace OUT if it is an earlier store (never other files)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _make_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", required=True, help="an MoE family by mlx-lm's module name: qwen3_moe, qwen3_5_moe, "
                   "bailing_moe (all presets), mixtral, deepseek_v3, gpt_oss, ... (tiny; README lists them)")
    p.add_argument("--preset", default="tiny", help="tiny (tests) | small (benchmarks) | paper-35b (paper shapes, ~19 GB) | "
                   "olmoe-1b-7b, qwen3-30b-a3b (real models' shapes, qwen3_moe; 3.5 and 15.7 GiB of experts)")
    p.add_argument("--format", default="mlx", choices=["mlx", "hf"], help="mlx: mlx-lm 4-bit (default); hf: Hugging Face bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it is an earlier make-model output (never other files)")
    p.add_argument("out", metavar="OUT")


def _workload_flags(p: argparse.ArgumentParser) -> None:
    from .model.workload import add_workload_flags

    add_workload_flags(p)


def _train_flags(p: argparse.ArgumentParser) -> None:
    from .train.base import add_train_base_flags
    from .train.heads import add_train_heads_flags
    from .train.distill import add_train_distill_flags
    from .train.lora import add_train_lora_flags

    train = p.add_subparsers(dest="phase", required=True, metavar="PHASE")
    add_train_base_flags(train.add_parser("base", help="train a small MoE LM from scratch on the stdlib's source"))
    add_train_heads_flags(train.add_parser("heads", help="distil prerouter heads on a store (Phase 1)"))
    add_train_lora_flags(train.add_parser("lora", help="train the recovery adapter on the student path (Phase 2)"))
    add_train_distill_flags(train.add_parser("distill", help="distil the adapter on-policy from the teacher (Phase 3)"))


def _trace_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["summarize", "synth"], help="synth: write a SYNTHETIC routing trace to FILE "
                   "(no model's routing: statistics fitted to the OLMoE traces; docs/USAGE.md \"Routing traces\")")
    p.add_argument("file", metavar="FILE")
    for flag in ("--layers", "--experts", "--top-k", "--tokens"):
        p.add_argument(flag, type=int, help="synth: the trace's MoE layers, experts a layer, K, rows (each required)")
    p.add_argument("--seed", type=int, help="synth: the generator's seed (default 0)")
    p.add_argument("--plot", metavar="PNG", help="draw a few steps' timeline and the load-cost fit (.png, .svg or .pdf)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--windows", type=int, metavar="N", help="also the step times, stalls and reads of every N "
                   "decode steps (a run's trend; the stretches --read-ahead measured compares)")


def _bench_flags(p: argparse.ArgumentParser) -> None:
    from .bench import add_bench_flags
    from .bench_kernels import add_bench_kernels_flags

    add_bench_flags(p)
    p.add_argument("--kernels", action="store_true", help="the kernel micro-benchmark instead of model arms")
    add_bench_kernels_flags(p)


def _export_gguf_flags(p):
    from .export.gguf import add_export_gguf_flags

    add_export_gguf_flags(p)


def _run_flags(p):
    from .commands.run import add_run_flags

    add_run_flags(p)


def _eval_flags(p):
    from .eval import add_eval_flags

    add_eval_flags(p)


def _serve_flags(p):
    from .serve import add_serve_flags

    add_serve_flags(p)


def _chat_flags(p):
    from .serve import add_chat_flags

    add_chat_flags(p)


# name -> (help, description, flags); the order is `edge0 --help`'s
COMMANDS = {
    "run": ("generate text, streaming tokens to stdout", "Generate text with an Edge0 store.", _run_flags),
    "convert": ("mlx-lm 4-bit or Hugging Face MoE checkpoint -> Edge0 store",
                "Turn an mlx-lm (4-bit) or Hugging Face (bf16/fp16/fp32) MoE checkpoint into an Edge0 store.",
                _convert_flags),
    "export-gguf": ("store -> GGUF file for llama.cpp (q4_1: the same 4-bit weights)",
                    "Write a store as a GGUF file that llama.cpp runs, tensor by tensor.", _export_gguf_flags),
    "verify": ("check every file of a store against its manifest", "Check a store's files, checksums and manifest.",
               lambda p: p.add_argument("store", metavar="STORE", nargs="?", default=None,
                                        help="the store (default: the built-in model's)")),
    "make-model": ("write a random-weight MoE checkpoint of a real architecture",
                   "Write a random-weight checkpoint (mlx-lm or Hugging Face layout) with a tokenizer.", _make_model_flags),
    "make-workload": ("a store where reads matter: a trained model's experts widened, heads on every layer",
                      "Widen a trained store's experts (zero neurons: same outputs, larger reads) and train prerouter "
                      "heads for every MoE layer: the pipeline's benchmark workload.", _workload_flags),
    "train": ("train: base (the demo model), heads (Phase 1), lora (Phase 2), distill (Phase 3)",
              "Training phases: the base model, prerouter heads, the recovery adapter and its on-policy distillation.",
              _train_flags),
    "eval": ("quality of the served path: perplexity, top-1 agreement and KL vs a teacher",
             "Evaluate a store as served (or an mlx-lm checkpoint) on held-out text.", _eval_flags),
    "trace": ("read a timeline trace: breakdown, load-cost fit, plot",
              "Summarize a trace written by `edge0 run --trace PATH`.", _trace_flags),
    "bench": ("throughput experiments (each arm in its own process)", "Throughput experiments.", _bench_flags),
    "serve": ("OpenAI-compatible HTTP server (chat and text completions, SSE)",
              "Serve a store over an OpenAI-compatible HTTP API.", _serve_flags),
    "chat": ("interactive terminal chat", "Chat with a store.", _chat_flags),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge0", description="Serve MoE models larger than memory, experts streamed from SSD.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, description, flags) in COMMANDS.items():
        flags(sub.add_parser(name, help=help_, description=description))
    return parser


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command."""
    c = args.command
    if c == "run":
        from .commands.run import run

        return run(args)
    if c == "convert":
        return _convert(args)
    if c == "verify":
        return verify(args.store)
    if c == "export-gguf":
        from .export.gguf import export_gguf_cli

        return export_gguf_cli(args)
    if c == "make-model":
        from .flags import check_seed
        from .model.make import make_model

        check_seed(args.seed)
        print(f"wrote {make_model(args.arch, args.preset, args.out, fmt=args.format, seed=args.seed, force=args.force)}",
              file=sys.stderr)
        return 0
    if c == "make-workload":
        from .model.workload import workload_cli

        return workload_cli(args)
    if c == "train":
        return _train(args)
    if c == "eval":
        from .eval import eval_cli

        return eval_cli(args)
    if c == "trace":
        from .sched.summarize import trace_cli

        return trace_cli(args)
    if c == "bench":
        from .bench import bench_cli

        return bench_cli(args)
    if c in ("serve", "chat"):
        from .serve import chat_cli, serve_cli

        return (serve_cli if c == "serve" else chat_cli)(args)
    raise Edge0Error(f"`edge0 {c}`: unknown command")


def _convert(args) -> int:
    from .model.convert import convert

    quant = {k: v for k, v in (("bits", args.bits), ("group_size", args.group_size)) if v is not None}
    print(f"wrote {convert(args.src, args.out, force=args.force, progress=not args.quiet, **quant)}", file=sys.stderr)
    return 0


def verify(store: str | None) -> int:
    from .io.verify import verify_cli
    from .model.consistency import config_problems
    from .model.demo import DEMO_STORE

    return verify_cli(store or str(DEMO_STORE), config_problems)


def _train(args) -> int:
    if args.phase == "base":
        from .train.base import train_base_cli

        return train_base_cli(args)
    if args.phase == "heads":
        from .train.heads import train_heads_cli

        return train_heads_cli(args)
    if args.phase == "lora":
        from .train.lora import train_lora_cli

        return train_lora_cli(args)
    if args.phase == "distill":
        from .train.distill import train_distill_cli

        return train_distill_cli(args)
    raise Edge0Error(f"`edge0 train {args.phase}`: unknown phase")


def main(argv: list[str] | None = None) -> int:
    def parse_and_run() -> int:
        args = build_parser().parse_args(argv)
        if getattr(args, "log_json", False):
            from .log import configure

            configure(json=True)
        return dispatch(args)

    return guarded(parse_and_run)


if __name__ == "__main__":
    sys.exit(main())
