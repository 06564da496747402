"""The `edge0` command: one console script, one subcommand per job (`edge0 --help`).

Each subcommand's flags and code live in its own module; this file's one table (COMMANDS) names them, and a
command's module is imported only when that command is parsed or runs (start-up stays fast).
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


def _lazy(module: str, name: str):
    """`name` of edge0's `module`, imported when it is called (start-up and --help stay fast)."""
    def call(arg):
        from importlib import import_module

        return getattr(import_module(f"edge0.{module}"), name)(arg)

    return call


def _bench_flags(p: argparse.ArgumentParser) -> None:
    from .bench import add_bench_flags
    from .bench.kernels import add_bench_kernels_flags

    add_bench_flags(p)
    p.add_argument("--kernels", action="store_true", help="the kernel micro-benchmark instead of model arms")
    add_bench_kernels_flags(p)


def _make_model(args) -> int:
    from .flags import check_seed
    from .model.make import make_model

    check_seed(args.seed)
    print(f"wrote {make_model(args.arch, args.preset, args.out, fmt=args.format, seed=args.seed, force=args.force)}",
          file=sys.stderr)
    return 0


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


def _verify_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", nargs="?", default=None, help="the store (default: the built-in model's)")


# `edge0 train PHASE`: phase -> (help, flags, main)
PHASES = {
    "base": ("train a small MoE LM from scratch on the stdlib's source",
             _lazy("train.base", "add_train_base_flags"), _lazy("train.base", "train_base_cli")),
    "heads": ("distil prerouter heads on a store (Phase 1)",
              _lazy("train.heads", "add_train_heads_flags"), _lazy("train.heads", "train_heads_cli")),
    "lora": ("train the recovery adapter on the student path (Phase 2)",
             _lazy("train.lora", "add_train_lora_flags"), _lazy("train.lora", "train_lora_cli")),
    "distill": ("distil the adapter on-policy from the teacher (Phase 3)",
                _lazy("train.distill", "add_train_distill_flags"), _lazy("train.distill", "train_distill_cli")),
}


def _train_flags(p: argparse.ArgumentParser) -> None:
    train = p.add_subparsers(dest="phase", required=True, metavar="PHASE")
    for name, (help_, flags, _) in PHASES.items():
        flags(train.add_parser(name, help=help_))


# The one table of subcommands: name -> (help, description, flags, main); the order is `edge0 --help`'s
COMMANDS = {
    "run": ("generate text, streaming tokens to stdout", "Generate text with an Edge0 store.",
            _lazy("commands.run", "add_run_flags"), _lazy("commands.run", "run")),
    "convert": ("mlx-lm 4-bit or Hugging Face MoE checkpoint -> Edge0 store",
                "Turn an mlx-lm (4-bit) or Hugging Face (bf16/fp16/fp32) MoE checkpoint into an Edge0 store.",
                _convert_flags, _convert),
    "export-gguf": ("store -> GGUF file for llama.cpp (q4_1: the same 4-bit weights)",
                    "Write a store as a GGUF file that llama.cpp runs, tensor by tensor.",
                    _lazy("export.gguf", "add_export_gguf_flags"), _lazy("export.gguf", "export_gguf_cli")),
    "verify": ("check every file of a store against its manifest", "Check a store's files, checksums and manifest.",
               _verify_flags, lambda args: verify(args.store)),
    "make-model": ("write a random-weight MoE checkpoint of a real architecture",
                   "Write a random-weight checkpoint (mlx-lm or Hugging Face layout) with a tokenizer.",
                   _make_model_flags, _make_model),
    "make-workload": ("a store where reads matter: a trained model's experts widened, heads on every layer",
                      "Widen a trained store's experts (zero neurons: same outputs, larger reads) and train prerouter "
                      "heads for every MoE layer: the pipeline's benchmark workload.",
                      _lazy("model.workload", "add_workload_flags"), _lazy("model.workload", "workload_cli")),
    "train": ("train: base (the demo model), heads (Phase 1), lora (Phase 2), distill (Phase 3)",
              "Training phases: the base model, prerouter heads, the recovery adapter and its on-policy distillation.",
              _train_flags, lambda args: PHASES[args.phase][2](args)),
    "eval": ("quality of the served path: perplexity, top-1 agreement and KL vs a teacher",
             "Evaluate a store as served (or an mlx-lm checkpoint) on held-out text.",
             _lazy("eval", "add_eval_flags"), _lazy("eval", "eval_cli")),
    "trace": ("read a timeline trace: breakdown, load-cost fit, plot",
              "Summarize a trace written by `edge0 run --trace PATH`.", _trace_flags, _lazy("sched.summarize", "trace_cli")),
    "bench": ("throughput experiments (each arm in its own process)", "Throughput experiments.",
              _bench_flags, _lazy("bench", "bench_cli")),
    "serve": ("OpenAI-compatible HTTP server (chat and text completions, SSE)",
              "Serve a store over an OpenAI-compatible HTTP API.",
              _lazy("serve", "add_serve_flags"), _lazy("serve", "serve_cli")),
    "chat": ("interactive terminal chat", "Chat with a store.", _lazy("serve", "add_chat_flags"), _lazy("serve", "chat_cli")),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge0", description="Serve MoE models larger than memory, experts streamed from SSD.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, description, flags, _) in COMMANDS.items():
        flags(sub.add_parser(name, help=help_, description=description))
    return parser


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command."""
    if args.command not in COMMANDS:
        raise Edge0Error(f"`edge0 {args.command}`: unknown command")
    return COMMANDS[args.command][3](args)


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
