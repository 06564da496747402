"""The `edge0` command: one console script, one subcommand per job (`edge0 --help`).

Each subcommand is a module of this package with `add_args(parser)` and `main(args)`; this file's one table
(COMMANDS) names them. A command module imports what it runs inside main (building the parser, --help, stays
fast). Every command-line flag is defined in this package; the library takes plain values.
"""

from __future__ import annotations

import argparse
from importlib import import_module

from ..errors import Edge0Error
from .guard import guarded

# The one table of subcommands: name -> (module of edge0.cli, help, description); the order is `edge0 --help`'s
COMMANDS = {
    "run": ("run", "generate text, streaming tokens to stdout", "Generate text with an Edge0 store."),
    "convert": ("convert", "mlx-lm 4-bit or Hugging Face MoE checkpoint -> Edge0 store",
                "Turn an mlx-lm (4-bit) or Hugging Face (bf16/fp16/fp32) MoE checkpoint into an Edge0 store."),
    "export-gguf": ("export_gguf", "store -> GGUF file for llama.cpp (q4_1: the same 4-bit weights)",
                    "Write a store as a GGUF file that llama.cpp runs, tensor by tensor."),
    "verify": ("verify", "check every file of a store against its manifest",
               "Check a store's files, checksums and manifest."),
    "make-model": ("make_model", "write a random-weight MoE checkpoint of a real architecture",
                   "Write a random-weight checkpoint (mlx-lm or Hugging Face layout) with a tokenizer."),
    "make-workload": ("make_workload", "a store where reads matter: a trained model's experts widened, heads on every "
                      "layer", "Widen a trained store's experts (zero neurons: same outputs, larger reads) and train "
                      "prerouter heads for every MoE layer: the pipeline's benchmark workload."),
    "train": ("train", "train: base (the demo model), heads (Phase 1), lora (Phase 2), distill (Phase 3)",
              "Training phases: the base model, prerouter heads, the recovery adapter and its on-policy distillation."),
    "eval": ("eval", "quality of the served path: perplexity, top-1 agreement and KL vs a teacher",
             "Evaluate a store as served (or an mlx-lm checkpoint) on held-out text."),
    "trace": ("trace", "read a timeline trace: breakdown, load-cost fit, plot",
              "Summarize a trace written by `edge0 run --trace PATH`."),
    "bench": ("bench", "throughput experiments (each arm in its own process)", "Throughput experiments."),
    "serve": ("serve", "OpenAI-compatible HTTP server (chat and text completions, SSE)",
              "Serve a store over an OpenAI-compatible HTTP API."),
    "chat": ("chat", "interactive terminal chat", "Chat with a store."),
    "launch": ("launch", "run or serve on several ranks with mlx.launch (layers split across them)",
               "Run `edge0 run` or `edge0 serve` on several ranks (processes or machines), the layers split across them."),
}


def command(name: str):
    """The module of the command `name` (edge0.cli.<module>), imported now."""
    return import_module(f"edge0.cli.{COMMANDS[name][0]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge0", description="Serve MoE models larger than memory, experts streamed from SSD.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_, description) in COMMANDS.items():
        command(name).add_args(sub.add_parser(name, help=help_, description=description))
    return parser


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command."""
    if args.command not in COMMANDS:
        raise Edge0Error(f"`edge0 {args.command}`: unknown command")
    return command(args.command).main(args)


def main(argv: list[str] | None = None) -> int:
    def parse_and_run() -> int:
        args = build_parser().parse_args(argv)
        if getattr(args, "log_json", False):
            from ..log import configure

            configure(json=True)
        return dispatch(args)

    return guarded(parse_and_run)
