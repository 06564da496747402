"""`edge0 run` (also `python -m edge0.run`): generate text from an Edge0 store, streaming tokens.

    python -m edge0.run --prompt "def fib(n):" --max-tokens 32
    edge0 run --model ~/stores/qwen3-30b --cold --json
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import mlx.core as mx

from .errors import Edge0Error
from .model.demo import DEMO_PROMPT, DEMO_STORE

DEFAULT_PROMPT = DEMO_PROMPT


def demo_store() -> Path:
    """The built-in model: the project's own trained demo MoE (edge0/model/demo/MODEL_CARD.md)."""
    if not (DEMO_STORE / "edge0.json").exists():
        raise Edge0Error(f"{DEMO_STORE}: the built-in model is missing from this installation; reinstall edge0 "
                         "or pass --model")
    return DEMO_STORE


def memory_figures() -> dict:
    """Peak MLX allocation, peak RSS, and file-backed RSS now (GiB)."""
    gib = 2**30
    rss_file = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssFile:"):
                rss_file = int(line.split()[1]) * 1024
    except OSError:
        pass
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"peak_mlx_gib": mx.get_peak_memory() / gib, "peak_rss_gib": peak_rss / gib, "file_rss_gib": rss_file / gib}


def check_values(args) -> None:
    """Flag values, before anything is loaded."""
    for flag, value, ok, want in (
            ("--io-workers", args.io_workers, args.io_workers >= 1, "at least 1"),
            ("--kernel-threads", args.kernel_threads, args.kernel_threads is None or args.kernel_threads >= 1,
             "at least 1"),
            ("--slots", args.slots, args.slots is None or args.slots >= 1, "at least 1"),
            ("--seed", args.seed, args.seed is None or 0 <= args.seed < 2**64, "between 0 and 2**64 - 1"),
            ("--temp", args.temp, args.temp >= 0, "0 (greedy) or more"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]")):
        if not ok:
            raise Edge0Error(f"{flag} {value}: must be {want}")


def check_flags(args) -> None:
    """Flag combinations, once the default routing is known."""
    if args.heads is not None and args.routing == "prefetch" and args.predictor is None:
        args.predictor = "heads"  # --heads names what to read ahead with
    if args.heads is not None and args.routing == "prefetch" and args.predictor != "heads":
        raise Edge0Error(f"--heads: --predictor {args.predictor} does not read heads (use --predictor heads)")
    if args.routing is None:
        args.routing = "native"
    if args.predictor is not None and args.routing == "native":
        raise Edge0Error(f"--predictor {args.predictor}: only used with --routing prefetch or predicted")
    if args.routing == "predicted" and args.predictor not in (None, "heads"):
        raise Edge0Error(f"--routing predicted routes with trained heads; --predictor {args.predictor} does not apply")
    if args.routing != "native" and args.executor not in ("auto", "staged"):
        raise Edge0Error(f"--routing {args.routing} fills staged slot banks; --executor {args.executor} does not apply")
    if args.heads is not None and args.routing == "native":
        raise Edge0Error("--heads: used with --routing predicted or --routing prefetch --predictor heads")
    if args.max_tokens < 1:
        raise Edge0Error(f"--max-tokens {args.max_tokens}: must be at least 1")


def default_heads(store: Path, k: int | None) -> Path | None:
    """heads-k{K}.safetensors next to the store (K: --k or the model's own), if present."""
    from .io.manifest import read_manifest

    if not (store / "edge0.json").exists():
        return None
    k = k or read_manifest(store).top_k
    path = store / f"heads-k{k}.safetensors"
    return path if path.exists() else None


def set_top_k(store, k: int) -> None:
    """Run every MoE block at K routed experts (heads for that K are what make it sound)."""
    if not 1 <= k <= store.manifest.num_experts:
        raise Edge0Error(f"--k {k}: must be between 1 and the model's {store.manifest.num_experts} experts")
    for layer in store.runtime.executors:
        store.model.layers[layer].mlp.top_k = k


def read_replay(path: str) -> dict:
    """--replay FILE: {"prompt": [ids], "tokens": [ids]}: a fixed prompt and forced decode tokens (benchmarks)."""
    from .io.manifest import read_json

    if not Path(path).is_file():
        raise Edge0Error(f"--replay {path}: no such file")
    data = read_json(Path(path))
    ok = isinstance(data, dict) and not set(data) - {"prompt", "tokens"} and all(
        isinstance(data.get(k, []), list) and all(type(t) is int and t >= 0 for t in data.get(k, []))
        for k in ("prompt", "tokens"))
    if not ok or not data.get("prompt"):
        raise Edge0Error(f"{path}: expected {{\"prompt\": [token ids], \"tokens\": [token ids]}} and nothing else")
    return data


def check_token_ids(ids: list[int], vocab: int | None, where: str) -> None:
    """Token ids given by hand (a replay, a request) must exist in the model's vocabulary."""
    bad = [t for t in ids if not 0 <= t < (vocab or float("inf"))]
    if bad:
        raise Edge0Error(f"{where}: token id {bad[0]} is outside the model's vocabulary of {vocab}")


def open_store(args, trace=None):
    """Load the store `args` name (the demo model by default) the way `edge0 run` flags ask.

    Used by `edge0 run`, `edge0 serve` and `edge0 chat`; sets args.routing/args.predictor to what runs."""
    from .io.pagecache import evict
    from .model.arch import read_config
    from .model.heads import HeadSet
    from .model.load import load_store
    from .sched.prefetch import build_prefetch_runtime
    from .sched.trace import NULL

    trace = trace or NULL
    check_values(args)
    if getattr(args, "kernel", None):
        from .compute import qmm

        qmm.set_kernel(args.kernel)
    if getattr(args, "kernel_threads", None):
        from .compute import kernels

        kernels.set_num_threads(args.kernel_threads)
    path = Path(args.model) if args.model else demo_store()
    if args.routing is None and args.heads is None and default_heads(path, args.k) is not None:
        args.routing = "predicted"
        print(f"edge0: routing predicted by the prerouter heads in {default_heads(path, args.k)} "
              "(--routing native to use the model's own router)", file=sys.stderr)
    check_flags(args)
    if args.cold and path.is_dir():
        for f in path.rglob("*.safetensors"):
            evict(f)
    build = None
    predictor = "heads" if args.routing == "predicted" else args.predictor or "next-router"
    heads_file = args.heads or (default_heads(path, args.k) if predictor == "heads" else None)
    if args.routing != "native":
        args.predictor = predictor

        def build(reader, cdtype):
            heads = None
            if predictor == "heads":
                if heads_file is None:
                    raise Edge0Error(f"{path}: no prerouter heads next to this store; pass --heads FILE "
                                     "(train them with `edge0 train heads`)")
                heads = HeadSet.load(heads_file, reader.manifest, read_config(path), top_k=args.k)
            return build_prefetch_runtime(reader, cdtype, predictor=predictor, memory_budget_gib=args.memory_budget,
                                          slots=args.slots, workers=args.io_workers, trace=trace, heads=heads,
                                          predicted_routing=args.routing == "predicted")
    store = load_store(path, dtype=args.dtype, verify=args.verify, executor=args.executor, slots=args.slots,
                       memory_budget=args.memory_budget, io=args.io, io_throttle=args.io_throttle, build=build)
    store.runtime.trace = trace
    store.heads_file = heads_file if predictor == "heads" and args.routing != "native" else None
    if args.k is not None:
        set_top_k(store, args.k)
    return store


def run(args) -> int:
    from mlx_lm.sample_utils import make_sampler

    from .compute.qmm import kernel_in_use
    from .sched.generate import StepTimes, generate_steps
    from .sched.trace import NULL, Trace

    t0 = time.perf_counter()
    replay = read_replay(args.replay) if args.replay else None
    if args.trace and (Path(args.trace).is_dir() or not os.access(Path(args.trace).resolve().parent, os.W_OK)):
        raise Edge0Error(f"--trace {args.trace}: not a writable file path")
    trace = Trace({"model": str(args.model or "demo")}) if args.trace else NULL
    store = open_store(args, trace)
    if trace.on:
        trace.meta.update(routing=args.routing, predictor=args.predictor)  # as open_store resolved them
    path = store.path
    load_s = time.perf_counter() - t0
    try:
        tok = store.tokenizer
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        if replay is not None:
            prompt = replay["prompt"]
            from .model.arch import vocab_size

            check_token_ids(prompt + replay.get("tokens", []), vocab_size(store.config), args.replay)
        elif args.chat and getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            prompt = tok.encode(text)
        if not prompt:
            raise Edge0Error("--prompt: encodes to no tokens")
        from .model.arch import text_config

        limit = text_config(store.config).get("max_position_embeddings")
        if limit and len(prompt) + args.max_tokens > limit:
            raise Edge0Error(f"--prompt: {len(prompt)} tokens + --max-tokens {args.max_tokens} exceed the model's context of {limit}")
        mx.random.seed(args.seed)
        mx.reset_peak_memory()
        sampler = make_sampler(temp=args.temp, top_p=args.top_p)
        times = StepTimes()
        detok = tok.detokenizer
        detok.reset()
        detok.add_token(prompt[-1])  # context for the first token's spacing (a streaming detokenizer trims
        lead = detok.last_segment  # the leading space of its first token); not part of the output
        if not args.json and replay is None and not args.chat:
            print(text, end="", flush=True)  # the prompt, then its continuation as it comes
        eos = set(tok.eos_token_ids)
        forced = (replay.get("tokens") or None) if replay is not None else None  # no tokens: generate freely
        for t, _ in generate_steps(store.model, prompt, max_tokens=args.max_tokens, sampler=sampler, times=times,
                                   runtime=store.runtime, forced=forced):
            if t in eos and not args.ignore_eos:
                times.tokens.pop()
                break
            detok.add_token(t)
            if not args.json:
                print(detok.last_segment, end="", flush=True)
        detok.finalize()
        if not args.json:
            print(detok.last_segment, flush=True)
        stats = store.reader.stats
        rt = store.runtime
        sched = getattr(rt, "sched", None)
        steps = max(len(times.tokens), 1)
        result = {
            "tokens": times.tokens,
            "text": detok.text[len(lead):],
            "prompt_tokens": len(prompt),
            "decode_tok_s": times.decode_tok_s,
            "prefill_tok_s": times.prefill_tok_s,
            **memory_figures(),
            "bytes_read": stats.bytes,
            "reads": stats.reads,
            "cold_fraction": stats.cold_fraction,
            "hit_rate": rt.stats.hit_rate,
            "resident_expert_bytes": rt.resident_expert_bytes,
            "memory_budget_gib": args.memory_budget,
            "routing": args.routing,
            "predictor": args.predictor if sched else None,
            "heads": str(store.heads_file) if store.heads_file else None,
            "top_k": args.k or store.manifest.top_k,
            "stall_ms_per_token": 1e3 * sched.stats.stall_s / steps if sched else 0.0,
            "recall": sched.stats.recall if sched else None,
            "loads": sched.stats.loads if sched else stats.reads,
            "demand_loads": sched.stats.demand_loads if sched else stats.reads,
            "load_bytes": sched.stats.bytes if sched else stats.bytes,
            "load_cold_fraction": sched.stats.cold_fraction if sched else stats.cold_fraction,
            "executor": rt.executor,
            "whole_layer_prefill": rt.prefill is not None,
            "io": store.reader.io,
            "io_throttle_mbps": args.io_throttle,
            "kernel": kernel_in_use(),
            "dtype": str(store.dtype or "source").removeprefix("mlx.core."),
            "load_s": load_s,
            "model": str(path),
            "expert_gib": store.manifest.expert_bytes / 2**30,
        }
        if trace.on:
            trace.save(args.trace, summary={k: result[k] for k in ("decode_tok_s", "stall_ms_per_token", "recall",
                                                                   "loads", "load_bytes", "load_cold_fraction")})
        if args.json:
            print(json.dumps(result))
        else:
            print(f"[edge0] {args.routing} routing, {rt.executor}: prompt {len(prompt)} tok at {times.prefill_tok_s:.1f} tok/s, decode "
                  f"{len(times.tokens)} tok at {times.decode_tok_s:.2f} tok/s, read {stats.bytes / 2**20:.1f} MiB in "
                  f"{stats.reads} reads ({100 * stats.cold_fraction:.0f}% cold), slot hit rate "
                  f"{100 * rt.stats.hit_rate:.0f}%, peak MLX {result['peak_mlx_gib']:.2f} GiB", file=sys.stderr)
    finally:
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from .cli import main as cli_main

    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
