"""`edge0 bench`: throughput arms, each in its own process, rotated across rounds, medians reported.

    edge0 bench --source /tmp/small-mlx --store /tmp/small-store --arms mlx-lm,exact --cache cold,warm --rounds 3

Arms: `mlx-lm` (mlx_lm's model fully resident, loaded from --source, in its stored dtype, as users run
it), `mlx-lm:f32` (the same in float32, like with like on CPU) and `exact` (Edge0's exact path on --store). Every arm decodes the same prompt greedily for the same number of tokens, EOS ignored.
Cache `cold` evicts the checkpoint's files before each run; `warm` reads them once first.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .errors import Edge0Error

ARMS = ("mlx-lm", "mlx-lm:f32", "exact", "staged", "hot", "resident", "native", "prefetch:repeat",
        "prefetch:next-router", "prefetch:heads", "predicted")
FIGURES = ("decode_tok_s", "prefill_tok_s", "peak_mlx_gib", "peak_rss_gib", "file_rss_gib", "bytes_read",
           "cold_fraction", "hit_rate", "resident_expert_bytes", "stall_ms_per_token", "recall", "loads_per_step",
           "load_cold_fraction")


def arm_flags(arm: str) -> list[str]:
    """`ARM@KERNEL` runs ARM with --kernel KERNEL (mlx or edge0)."""
    arm, _, kernel = arm.partition("@")
    extra = ["--kernel", kernel] if kernel else []
    return _arm_flags(arm) + extra


def _arm_flags(arm: str) -> list[str]:
    if arm == "native":
        return ["--routing", "native", "--executor", "staged"]
    if arm == "predicted":
        return ["--routing", "predicted"]  # the heads next to the store, for its K
    if arm.startswith("prefetch:"):
        return ["--routing", "prefetch", "--predictor", arm.split(":", 1)[1]]
    return ["--routing", "native", "--executor", arm]


def add_bench_flags(p) -> None:
    p.add_argument("--source", metavar="DIR", help="the mlx-lm checkpoint (for the mlx-lm arm)")
    p.add_argument("--store", metavar="DIR", help="the Edge0 store converted from it")
    p.add_argument("--arms", default="mlx-lm,exact", help=f"comma-separated arms from {', '.join(ARMS)}")
    p.add_argument("--cache", default="warm", help="comma-separated page-cache states: cold, warm (default warm)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each round runs every arm once (default 3)")
    p.add_argument("--max-tokens", type=int, default=32, help="decode tokens per run (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length in tokens (default 256)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GIB", help="passed to the Edge0 arms")
    p.add_argument("--io-throttle", type=float, default=None, metavar="MBPS", help="passed to the Edge0 arms")
    p.add_argument("--dtype", default="auto", help="compute dtype of the Edge0 arms (auto: float32 on CPU)")
    p.add_argument("--out", default="results", help="directory for results (default ./results)")


def blas_in_use() -> str:
    """Which BLAS the MLX CPU backend would call: an LD_PRELOADed one, else the wheel's reference BLAS."""
    pre = os.environ.get("LD_PRELOAD", "")
    return f"preloaded {pre}" if "blas" in pre.lower() else "netlib reference BLAS (mlx[cpu] wheel)"


def _evict_tree(path: Path) -> None:
    from .io.pagecache import evict

    for f in path.rglob("*.safetensors"):
        evict(f)


def _warm_tree(path: Path) -> None:
    for f in path.rglob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def make_replay(args, out: Path) -> Path:
    """Prompt ids cut from Python source, and the exact path's greedy tokens for them: replay.json."""
    import inspect
    import json as json_mod

    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(args.store))
    text = inspect.getsource(json_mod.decoder) * 8
    ids = tok.encode(text)[:args.prompt_tokens]
    path = out / "replay.json"
    path.write_text(json.dumps({"prompt": ids, "tokens": []}))
    cmd = [sys.executable, "-m", "edge0.run", "--model", str(args.store), "--replay", str(path), "--max-tokens",
           str(args.max_tokens), "--ignore-eos", "--json", "--dtype", args.dtype, "--routing", "native",
           "--executor", "exact"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Edge0Error(f"recording the replay tokens failed: {proc.stderr.strip()[-300:]}")
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])["tokens"]
    path.write_text(json.dumps({"prompt": ids, "tokens": tokens}))
    return path


def run_arm(arm: str, args, cache: str, replay: Path) -> dict:
    resident = arm.startswith("mlx-lm")
    path = Path(args.source if resident else args.store)
    (_evict_tree if cache == "cold" else _warm_tree)(path)
    if resident:
        dtype = "float32" if arm == "mlx-lm:f32" else "source"
        cmd = [sys.executable, "-m", "edge0.bench", "mlx-lm", str(path), str(replay), dtype]
    else:
        cmd = [sys.executable, "-m", "edge0.run", "--model", str(path), "--replay", str(replay), "--max-tokens",
               str(args.max_tokens), "--ignore-eos", "--json", "--dtype", args.dtype, *arm_flags(arm)]
        if args.memory_budget is not None:
            cmd += ["--memory-budget", str(args.memory_budget)]
        if args.io_throttle is not None:
            cmd += ["--io-throttle", str(args.io_throttle)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Edge0Error(f"arm {arm} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = max(len(res.get("tokens", [])), 1)
    res["loads_per_step"] = res.get("loads", 0) / steps
    res["recall"] = res.get("recall") or 0.0
    res.setdefault("stall_ms_per_token", 0.0)
    res.setdefault("load_cold_fraction", res.get("cold_fraction", 0.0))
    return res


def read_cost(store: Path, throttle: float | None, samples: int = 48) -> dict:
    """ms per bundle read, cold (after eviction) and warm, one thread, with the arms' throttle."""
    import random
    import time

    from .io.reader import BundleReader

    reader = BundleReader(store, probe=False, throttle_mbps=throttle)
    m = reader.manifest
    rng = random.Random(0)
    picks = [(rng.choice(m.layers).layer, rng.randrange(m.num_experts)) for _ in range(samples)]
    bufs = [bytearray(p.nbytes) for p in m.pieces]
    out = {}
    reader.evict()
    for state in ("cold", "warm"):
        t0 = time.perf_counter()
        for layer, e in picks:
            reader.read_into(layer, e, bufs)
        out[f"{state}_ms"] = 1e3 * (time.perf_counter() - t0) / samples
    reader.close()
    return out


def bench(args) -> int:
    arms = [a for a in args.arms.split(",") if a]
    caches = [c for c in args.cache.split(",") if c]
    for a in arms:
        base, _, kernel = a.partition("@")
        if base not in ARMS or kernel not in ("", "mlx", "edge0") or (kernel and base.startswith("mlx-lm")):
            raise Edge0Error(f"--arms: unknown arm '{a}' (choose from {', '.join(ARMS)}; Edge0 arms take @mlx or @edge0)")
        a = base
        if a not in ARMS:
            raise Edge0Error(f"--arms: unknown arm '{a}' (choose from {', '.join(ARMS)})")
        resident = a.startswith("mlx-lm")
        if not (args.source if resident else args.store):
            raise Edge0Error(f"--arms {a}: needs --{'source' if resident else 'store'}")
    for c in caches:
        if c not in ("cold", "warm"):
            raise Edge0Error(f"--cache: unknown state '{c}' (cold or warm)")
    out = Path(args.out) / f"bench-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    replay = make_replay(args, out) if args.store else None
    if replay is None:
        raise Edge0Error("--store: needed to record the replayed tokens")
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]  # rotate arm order across rounds
        for cache in caches:
            for arm in order:
                res = run_arm(arm, args, cache, replay)
                runs.setdefault(f"{arm}/{cache}", []).append(res)
                print(f"round {r + 1} {arm:10s} {cache}: {res['decode_tok_s']:.2f} tok/s decode, "
                      f"{res['prefill_tok_s']:.1f} tok/s prefill, "
                      f"peak MLX {res['peak_mlx_gib']:.3f} GiB, RSS {res['peak_rss_gib']:.3f} GiB", file=sys.stderr)
    summary = {key: {**{f: statistics.median(x.get(f, 0.0) or 0.0 for x in rs) for f in FIGURES},
                     "dtype": rs[0]["dtype"], "kernel": rs[0].get("kernel", "mlx")} for key, rs in runs.items()}
    cost = read_cost(Path(args.store), args.io_throttle)
    for s in summary.values():
        s["step_ms"] = 1e3 / s["decode_tok_s"] if s["decode_tok_s"] else 0.0
    for key, s in summary.items():
        arm, cache = key.split("/")
        cf = s["load_cold_fraction"]
        s["read_ms_per_step"] = s["loads_per_step"] * (cf * cost["cold_ms"] + (1 - cf) * cost["warm_ms"])
        floor = summary.get(f"resident/{cache}") or summary.get("resident/warm")
        if floor:
            s["compute_ms_per_step"] = floor["step_ms"]
            s["limit_ms_per_step"] = max(floor["step_ms"], s["read_ms_per_step"])
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cores": os.cpu_count(), "blas": blas_in_use(),
            "rounds": args.rounds, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
            "dtype": args.dtype, "source": args.source, "store": args.store, "memory_budget_gib": args.memory_budget,
            "io_throttle_mbps": args.io_throttle, "read_cost": cost}
    (out / "results.json").write_text(json.dumps({"meta": meta, "median": summary, "runs": runs}, indent=1))
    throttle = f", read throttle {args.io_throttle} MB/s" if args.io_throttle else ""
    lines = [f"cores {meta['cores']}, BLAS: {meta['blas']}, {args.rounds} rounds, "
             f"prompt {args.prompt_tokens} tokens, {args.max_tokens} decode tokens (replayed), medians{throttle}; "
             f"one bundle read: {cost['cold_ms']:.2f} ms cold, {cost['warm_ms']:.2f} ms warm", "",
             "| arm | dtype | kernel | cache | decode tok/s | step ms | limit ms | stall ms/tok | recall | loads/step | "
             "prefill tok/s | peak MLX GiB | peak RSS GiB | MiB read | cold | slot hits | resident experts MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, s in summary.items():
        arm, cache = key.split("/")
        limit = f"{s['limit_ms_per_step']:.0f}" if "limit_ms_per_step" in s else "-"
        lines.append(f"| {arm} | {s['dtype']} | {s['kernel']} | {cache} | {s['decode_tok_s']:.2f} | {s['step_ms']:.0f} | {limit} | "
                     f"{s['stall_ms_per_token']:.1f} | {s['recall']:.2f} | {s['loads_per_step']:.1f} | "
                     f"{s['prefill_tok_s']:.1f} | {s['peak_mlx_gib']:.3f} | {s['peak_rss_gib']:.3f} | "
                     f"{s['bytes_read'] / 2**20:.1f} | {s['cold_fraction']:.2f} | {s['hit_rate']:.2f} | "
                     f"{s['resident_expert_bytes'] / 2**20:.0f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {out}/results.json and results.md", file=sys.stderr)
    return 0


def mlx_lm_arm(path: str, replay_path: str, dtype: str) -> None:
    """One resident mlx-lm run; prints the same JSON figures as `edge0 run --json`."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx.utils import tree_flatten
    from mlx_lm.sample_utils import make_sampler

    from .model.load import cast_floats, compute_dtype
    from .run import memory_figures
    from .sched.generate import StepTimes, generate_steps

    model, tok = load(path)
    cast_floats(model, compute_dtype(dtype))
    dtype = next(str(v.dtype) for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    dtype = dtype.removeprefix("mlx.core.")
    mx.eval(model.parameters())
    mx.reset_peak_memory()
    times = StepTimes()
    replay = json.loads(Path(replay_path).read_text())
    for _ in generate_steps(model, replay["prompt"], max_tokens=len(replay["tokens"]), sampler=make_sampler(0.0),
                            times=times, forced=replay["tokens"]):
        pass
    print(json.dumps({"tokens": times.tokens, "dtype": dtype, "decode_tok_s": times.decode_tok_s,
                      "prefill_tok_s": times.prefill_tok_s, **memory_figures(), "bytes_read": 0, "cold_fraction": 0.0,
                      "hit_rate": 0.0, "resident_expert_bytes": 0}))


if __name__ == "__main__":
    _, arm, path, replay_file, dtype = sys.argv
    mlx_lm_arm(path, replay_file, dtype)
