"""The command-line flags that several commands share, and the typed configs they build.

`add_engine_flags` (which model and how it runs: run, serve, chat, eval, bench arms) builds an
EngineConfig with `engine_config(args)`; `add_sampling_flags` builds a Sampling. Each flag is defined
once here, so help texts, defaults and checks agree across commands.
"""

from __future__ import annotations

import argparse

from ..compute.choices import DTYPES, EVICTIONS, EXECUTORS, IO_MODES, KERNELS, PLACEMENTS, PREDICTORS, READ_AHEAD, ROUTINGS
from ..config import EngineConfig, Sampling
from ..io.pool import IO_WORKERS
from ..errors import Edge0Error

# EngineConfig's settings (their paths) -> the flags that give them: how engine_config reads the flags, and how a
# SettingError of the library is said on the command line
SETTING_FLAGS = {
    "model": "--model", "routing.mode": "--routing", "routing.predictor": "--predictor", "routing.heads": "--heads",
    "routing.guesses": "--guesses", "routing.candidates": "--candidates", "routing.read_ahead": "--read-ahead",
    "routing.lora": "--lora", "routing.top_k": "--k", "routing.affinity": "--affinity",
    "io.executor": "--executor", "io.slots": "--slots", "io.placement": "--placement", "io.evict": "--evict",
    "io.memory_budget_gib": "--memory-budget", "io.mode": "--io", "io.workers": "--io-workers",
    "io.throttle_mbps": "--io-throttle", "io.verify": "--verify", "io.cold": "--cold",
    "kernel.name": "--kernel", "kernel.threads": "--kernel-threads", "kernel.dtype": "--dtype",
    "serving.model_id": "--model-id", "serving.prompt_cache_gib": "--prompt-cache-gib",
    "serving.max_batch": "--max-batch",
}


def add_engine_flags(p: argparse.ArgumentParser, *, model_help: str | None = None) -> None:
    """Which store and how its experts are read, routed and computed."""
    p.add_argument("--model", metavar="DIR",
                   help=model_help or "Edge0 store (made by `edge0 convert`); default: the built-in demo model")
    p.add_argument("--routing", choices=ROUTINGS, default=None,
                   help="native: the model's router, experts read on demand; prefetch: the model's router decides, "
                        "predicted experts are read one token ahead by the I/O pool (same output as native); "
                        "predicted: trained prerouter heads route the consumer layers (default when the store has "
                        "heads-k{K}.safetensors and the executor is auto, staged or resident, else native)")
    p.add_argument("--executor", choices=EXECUTORS, default="auto",
                   help="exact: read the routed experts into fresh arrays every step; staged: per-layer slot banks, "
                        "only changed slots read; hot: one LRU of bundles shared by all layers within "
                        "--memory-budget; resident: every expert loaded at start, no host sync inside a step (the "
                        "fastest for a model that fits in RAM; under predicted routing the heads route inside the graph). "
                        "auto (default): resident under native and predicted routing when every expert fits in "
                        "--memory-budget, or in half the memory available, else staged. "
                        "staged and hot read each layer whole for prefill")
    p.add_argument("--predictor", choices=PREDICTORS, default=None,
                   help="what --routing prefetch reads ahead: repeat (the layer's set at t), next-router (layer N+1's "
                        "router on layer N's input; default), heads (the trained prerouter heads, --heads), affinity "
                        "(layer N+1's experts that follow layer N's at the same token, --affinity)")
    p.add_argument("--heads", metavar="FILE", default=None,
                   help="prerouter heads (default: heads-k{K}.safetensors next to the store); without --routing they "
                        "route (--routing predicted); implies --predictor heads with --routing prefetch")
    p.add_argument("--guesses", type=int, default=None, metavar="N",
                   help="--routing prefetch: read ahead only the predictor's N likeliest experts of each set, at "
                        "most K (default: all K); fewer guesses read less on a busy disk, and miss more")
    p.add_argument("--affinity", metavar="FILE", default=None,
                   help="--routing prefetch --predictor affinity: the co-activation table of `edge0 train affinity` "
                        "(which experts of layer L+1 follow those of layer L): the next layer's likeliest experts are "
                        "read while a layer computes")
    p.add_argument("--candidates", type=int, default=None, metavar="M",
                   help="--routing predicted: each head names its layer's M likeliest experts a token ahead (those are "
                        "read), and the layer's own router chooses and weighs K of them (default: 2K where every expert "
                        "is resident and nothing is read, K when experts are streamed; between K and the model's experts)")
    p.add_argument("--read-ahead", choices=READ_AHEAD, default="measured",
                   help="streamed prefetch or predicted routing: measured (default) reads ahead while reads come from the "
                        "disk and steps measure faster with it than without (prefetch: never where every bank holds every "
                        "expert); always: every step, warm or not; never: no step")
    p.add_argument("--lora", metavar="FILE", default=None,
                   help="recovery adapter served beside the int4 weights, trained with the heads in use (default: "
                        "lora-k{K}.safetensors next to the store under predicted routing with its heads); none: without")
    p.add_argument("--k", type=int, default=None, metavar="K", help="routed experts per token (default: the model's)")
    _add_memory_flags(p)
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="compute dtype of non-quantized tensors: auto (float32 on CPU), source, float32, bfloat16, float16")
    p.add_argument("--kernel", choices=KERNELS, default=None,
                   help="quantized products and per-token dense ops: edge0 (the built CPU extension: int8 activations, "
                        "AVX-512 VNNI or AVX2), mlx (MLX's own), auto (edge0 on CPU when built; default, or $EDGE0_KERNEL)")
    p.add_argument("--kernel-threads", type=int, default=None, metavar="N",
                   help="threads of the edge0 kernels, at most the machine's cores (default: one for decode steps and every core for prompts on 2 cores; cores - 1 and every core above)")
    p.add_argument("--prompt-cache-gib", type=float, default=1.0, metavar="GIB",
                   help="KV caches kept so that a prompt sharing a prefix with an earlier one (a chat's next turn) "
                        "prefills only the rest (default 1; 0: off)")
    p.add_argument("--cold", action="store_true", help="evict the store from the page cache before loading")
    p.add_argument("--verify", action="store_true",
                   help="also check every expert bundle's checksum as it is read (every load checks the small "
                        "files' checksums and each layer file's size and header; `edge0 verify STORE` checks every "
                        "byte)")


def _add_memory_flags(p: argparse.ArgumentParser) -> None:
    """Where the experts wait and how they are read: slots, placement, budget, I/O."""
    p.add_argument("--slots", type=int, default=None, metavar="S",
                   help="slots per staged bank, at most the model's experts (default 2K)")
    p.add_argument("--placement", choices=PLACEMENTS, default="auto",
                   help="streamed routing with heads (predicted; prefetch --predictor heads): auto (default) keeps "
                        "every expert of the layers no head routes in memory (they route by their own router: no read "
                        "and no host sync inside a step), the other layers' banks sharing the rest of S slots a layer, "
                        "where that leaves them 2M slots each and S is under the model's experts; even: S slots every "
                        "layer")
    p.add_argument("--evict", choices=EVICTIONS, default="lfu",
                   help="which held expert a slot bank (staged, hot) replaces: lfu (default), the one used least often "
                        "lately; lru, the least recently used")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="most GiB of expert bundles held resident (slot banks, LRU, prefill banks); hot default 1")
    p.add_argument("--io", choices=IO_MODES, default="pread",
                   help="pread: preadv into the banks (default); mmap: copy from a mapping; direct: O_DIRECT")
    p.add_argument("--io-workers", type=int, default=IO_WORKERS, metavar="N",
                   help=f"I/O pool threads, every read of the store (default {IO_WORKERS})")
    p.add_argument("--io-throttle", type=float, default=None, metavar="MBPS",
                   help="cap read bandwidth at MBPS MB/s, more than 0 (an experiment knob: a slow disk on a fast machine)")


def add_sampling_flags(p: argparse.ArgumentParser, *, max_tokens: int, seed: int | None = 0,
                       seed_help: str = "random seed (default 0)") -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temp", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling, in (0, 1] (default 1: off)")
    p.add_argument("--seed", type=int, default=seed, metavar="S", help=seed_help)
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="F",
                   help="subtracted from a token's log-probability once if it is among the last 20 tokens, in "
                        "[-2, 2] (OpenAI's presence_penalty, as mlx-lm applies it; default 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtracted for each time a token is among the last 20, in [-2, 2] (default 0: off)")


def add_log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-json", action="store_true", help="log events on stderr as JSON lines (default: plain lines)")


def add_serving_flags(p: argparse.ArgumentParser, *, seed_help: str) -> None:
    """serve's and chat's shared flags: the engine's, sampling's (512 tokens, no seed) and the log's."""
    add_engine_flags(p)
    add_sampling_flags(p, max_tokens=512, seed=None, seed_help=seed_help)
    add_log_flags(p)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of `add_engine_flags`' flags (and serve's --model-id and --max-batch where given), checked."""
    dests = {path: flag.removeprefix("--").replace("-", "_") for path, flag in SETTING_FLAGS.items()}
    return EngineConfig.of({path: getattr(args, d) for path, d in dests.items() if hasattr(args, d)}).check()


def sampling(args: argparse.Namespace) -> Sampling:
    """The Sampling of `add_sampling_flags`' flags, checked."""
    return Sampling(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, seed=args.seed,
                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty).check()


def serve_configs(args: argparse.Namespace) -> tuple[EngineConfig, Sampling]:
    """(EngineConfig, Sampling) of serve's or chat's flags, checked."""
    return engine_config(args), sampling(args)



def flags_given(args: argparse.Namespace, add_flags, skip: tuple = ()) -> list[str]:
    """The flags of `add_flags` (e.g. add_engine_flags) whose values in args are not their defaults, as typed."""
    p = argparse.ArgumentParser(add_help=False)
    add_flags(p)
    return [a.option_strings[0] for a in p._actions if a.option_strings and a.dest not in skip
            and getattr(args, a.dest, a.default) != a.default]


def add_route_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routes", metavar="FILE", default=None,
                   help="force every MoE layer's routing from a routing trace (docs/USAGE.md, Routing traces) whose "
                        "MoE layers, experts and K are the model's; runs native routing (or --routing prefetch)")
    p.add_argument("--record-routes", metavar="FILE", default=None,
                   help="write what every MoE layer routed each token to (ids, weights; prompt and decode marked): "
                        "NPZ where FILE ends in .npz, else JSON; FILE must not exist")


def route_files(args: argparse.Namespace):
    """Before the model loads: --record-routes names a new file in a writable directory; --routes' trace (a
    RouteTrace of io/routetrace.py), read and checked; --routes runs native routing unless --routing prefetch
    (predicted routing would read other experts)."""
    import tempfile
    from pathlib import Path

    if args.record_routes is not None:
        path = Path(args.record_routes)
        if path.exists() or path.is_symlink():
            raise Edge0Error(f"--record-routes {path}: exists; name a new file (no file is written over)")
        try:  # a real file made and dropped: os.access says yes to root on a read-only mount
            tempfile.TemporaryFile(dir=path.parent.resolve()).close()
        except OSError as e:
            raise Edge0Error(f"--record-routes {path}: its directory cannot take a file ({e.strerror})") from None
    if args.routes is None:
        return None
    if args.routing == "predicted":
        raise Edge0Error("--routes and --routing predicted: the trace decides every layer's experts, the heads would "
                         "read others; give --routing native (the default with --routes) or prefetch")
    args.routing = args.routing or "native"
    from ..io.routetrace import read_trace

    return read_trace(args.routes, what=f"--routes {args.routes}")
