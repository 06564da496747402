"""`edge0 bench` runs one of three benchmarks (model arms; --serve, the server under load; --kernels, the kernels
alone), each reading only some of the flags. A flag given to a benchmark that does not read it is refused with one
line naming it, instead of being dropped without a word."""

from __future__ import annotations

from ..errors import Edge0Error
from ..config.checks import positive, refuse_together, whole

ARMS, SERVE, KERNELS = "arms", "serve", "kernels"
SHARED = {ARMS, SERVE}  # the flags serve.py shares with the model arms
USED_BY = {  # flag's dest -> the benchmarks that read it
    **{d: {SERVE} for d in ("clients", "requests", "max_batch", "model")},
    **{d: {ARMS} for d in ("arms", "cache", "gguf", "io", "llama_python", "lora", "memory_cap", "replay", "replay_text",
                           "slots", "source", "store", "routes", "affinity", "batch")},
    **{d: SHARED for d in ("dtype", "io_throttle", "max_tokens", "memory_budget", "out", "prompt_tokens", "rounds",
                           "threads")},
    **{d: {KERNELS} for d in ("kernel_threads", "kernel_impls", "kernel_seconds", "kernel_prefill_rows", "kernel_json",
                              "kernel_graph")},
}


def check_mode(args, defaults: dict) -> str:
    """The benchmark the flags ask for, every flag it does not read refused (one whose value is not its default:
    `defaults`, edge0/cli/bench.py's); --kernels' own flags checked."""
    if args.serve and args.kernels:
        refuse_together("--serve", "--kernels", "each is a benchmark of its own; give one")
    mode = SERVE if args.serve else KERNELS if args.kernels else ARMS
    for dest, default in defaults.items():
        if dest in USED_BY and mode not in USED_BY[dest] and getattr(args, dest, default) != default:
            flag = "--" + dest.replace("_", "-")
            if mode == ARMS:
                raise Edge0Error(f"{flag}: only read by `edge0 bench --{' or --'.join(sorted(USED_BY[dest]))}`")
            refuse_together(flag, f"--{mode}", f"the {mode} benchmark does not read {flag}")
    if mode == KERNELS:
        counts = [t for t in str(args.kernel_threads).split(",") if t]
        if not counts or not all(t.isdigit() and int(t) >= 1 for t in counts):
            raise Edge0Error(f"--kernel-threads {args.kernel_threads}: thread counts of at least 1, comma-separated")
        positive("--kernel-seconds", args.kernel_seconds)
        whole("--kernel-prefill-rows", args.kernel_prefill_rows, 0)
    return mode
