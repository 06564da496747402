"""`edge0 bench`: throughput arms, each in its own process, rotated across rounds, medians reported.

    edge0 bench --source /tmp/small-mlx --store /tmp/small-store --arms mlx-lm,exact --cache cold,warm --rounds 3

Arms: `mlx-lm` (mlx_lm's model fully resident, loaded from --source, in its stored dtype, as users run
it), `mlx-lm:f32` (the same in float32, like with like on CPU) and `exact` (Edge0's exact path on --store). Every arm decodes the same prompt greedily for the same number of tokens, EOS ignored.
Cache `cold` evicts the checkpoint's files before each run; `warm` reads them once first.

`llama.cpp` (optional) runs the same replay on a GGUF of the same model (--gguf) with llama-cpp-python, in
the interpreter --llama-python names (a separate venv: tools/llama_cpp_setup.py builds it; Edge0 never
depends on llama_cpp). Its n_threads is --threads, the edge0 kernels' thread count in the other arms.

`--memory-cap GIB` runs every arm inside a memory cgroup limited to GIB, page cache included (bench/cap.py):
a checkpoint larger than the cap behaves as on a smaller machine, and an arm killed for memory is a row of
the table. `--replay FILE` replays given prompt ids and decode tokens (recorded by the exact path if absent).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from .arms import ARMS, arm_flags, check_slots, split_arm, streams_staged
from .cap import GIB, ArmRun, MemoryCap, launch
from .harness import schedule
from .replay import given_replay, make_replay, text_replay
from .route_arms import check_routes, route_flags, routes_section
from .table import LLAMA_ARM, is_llama, summarize, table
from ..compute.choices import READ_AHEAD
from ..compute.machine import blas
from ..errors import Edge0Error
from ..config.checks import non_negative, whole
from ..io.atomic import write_atomic

LLAMA_SETUP = "tools/llama_cpp_setup.py"



def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(path.rglob("*.safetensors"))


def _evict_tree(path: Path) -> None:
    from ..io.pagecache import evict

    for f in _files(path):
        evict(f)


def _warm_tree(path: Path) -> None:
    for f in _files(path):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def threads(args) -> int:
    """The llama.cpp arm's threads: --threads, else the edge0 kernels' default where every expert is resident (the
    Edge0 arms without --threads take their engine's default, which each reports)."""
    from ..compute.kernels import default_threads

    return args.threads or default_threads(resident=True)


def llama_python(args) -> str:
    return args.llama_python or sys.executable


def check_llama_arm(args) -> str:
    """Refuse the llama.cpp arm without a GGUF or without llama_cpp; its llama_cpp version otherwise."""
    how = f"build it in its own venv with `python3 {LLAMA_SETUP}` and pass --llama-python VENV/bin/python"
    if not args.gguf:
        raise Edge0Error(f"--arms {LLAMA_ARM}: needs --gguf FILE, a GGUF of the same model ({LLAMA_SETUP} makes one)")
    if not Path(args.gguf).is_file():
        raise Edge0Error(f"--gguf {args.gguf}: no such file")
    py = llama_python(args)
    try:
        proc = subprocess.run([py, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                              text=True, timeout=120)
    except OSError as e:
        raise Edge0Error(f"--llama-python {py}: cannot run it ({e.strerror}); {how}") from None
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["import failed"])[-1]
        raise Edge0Error(f"--arms {LLAMA_ARM}: {py} cannot import llama_cpp ({why}); {how}")
    return proc.stdout.strip()


# The llama.cpp arm is a script of its own (bench/llama.py), run by the interpreter --llama-python names.
LLAMA_ARM_SCRIPT = Path(__file__).with_name("llama.py")


def arm_command(arm: str, args, path: Path, replay: Path) -> list[str]:
    if is_llama(arm):  # llama.cpp:no-mmap reads the whole GGUF into memory at load instead of mapping it
        mmap = "no-mmap" if arm.endswith(":no-mmap") else "mmap"
        return [llama_python(args), str(LLAMA_ARM_SCRIPT), str(path), str(replay), str(threads(args)), mmap]
    if arm.startswith("mlx-lm"):
        dtype = "float32" if arm == "mlx-lm:f32" else "source"
        return [sys.executable, "-m", "edge0.bench", "mlx-lm", str(path), str(replay), dtype]
    cmd = [sys.executable, "-m", "edge0.run", "--model", str(path), "--replay", str(replay), "--max-tokens",
           str(args.max_tokens), "--ignore-eos", "--json", "--dtype", args.dtype, *arm_flags(arm), *route_flags(args, arm)]
    if args.threads:
        cmd += ["--kernel-threads", str(args.threads)]
    if args.memory_budget is not None:
        cmd += ["--memory-budget", str(args.memory_budget)]
    if getattr(args, "slots", None) is not None and streams_staged(arm):
        cmd += ["--slots", str(args.slots)]
    if getattr(args, "lora", None) and split_arm(arm)[0] in ("predicted", "predicted:resident"):
        cmd += ["--lora", args.lora]
    if args.io_throttle is not None:
        cmd += ["--io-throttle", str(args.io_throttle)]
    if args.io is not None:
        cmd += ["--io", args.io]
    return cmd


def run_arm(arm: str, args, cache: str, replay: Path, cap: MemoryCap | None = None) -> dict:
    path = Path(args.gguf if is_llama(arm) else args.source if arm.startswith("mlx-lm") else args.store)
    cmd = arm_command(arm, args, path, replay)
    if cap is None:
        (_evict_tree if cache == "cold" else _warm_tree)(path)
        run = launch(cmd)
    else:  # pages cached by an earlier reader are not charged to the arm's cgroup: read them again inside it
        _evict_tree(path)
        run = cap.run(cmd, warm=_files(path) if cache == "warm" else None)
    if run.oom_killed:
        why = f"out of memory at {cap.gib:g} GiB" if cap.gib else "out of memory"
        return {"killed": why, "tokens": [], "dtype": "-", "kernel": "-",
                **_run_figures(run)}
    if run.returncode != 0:
        raise Edge0Error(f"arm {arm} failed: {run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.returncode}")
    res = {**json.loads(run.stdout.strip().splitlines()[-1]), **_run_figures(run)}
    if not is_llama(arm):  # the edge0 kernels run on --threads threads; MLX's own kernels on MLX's pool
        res["threads"] = res.get("kernel_threads") if res.get("kernel") == "edge0" else None
    steps = max(len(res.get("tokens", [])), 1)
    res["loads_per_step"] = res.get("loads", 0) / steps
    res["recall"] = res.get("recall") or 0.0
    res.setdefault("stall_ms_per_token", 0.0)
    res.setdefault("load_cold_fraction", res.get("cold_fraction", 0.0))
    return res


def _run_figures(run: ArmRun) -> dict:
    peak = run.peak_cgroup_bytes
    return {"major_faults": run.major_faults, "disk_read_bytes": run.disk_read_bytes,
            "peak_cgroup_gib": peak / GIB if peak is not None else None}


def read_cost(store: Path, throttle: float | None, samples: int = 48, io: str | None = None) -> dict:
    """ms per bundle read, cold (after eviction) and warm, with the arms' throttle and I/O mode: one thread at a
    time, and through the arms' I/O pool K reads at a time (a layer's misses; the pipeline limit's rate)."""
    import random
    import time

    from ..io.pool import ReadTask
    from ..io.reader import BundleReader

    reader = BundleReader(store, probe=False, throttle_mbps=throttle, io=io or "pread")
    m = reader.manifest
    rng = random.Random(0)
    picks = [(rng.choice(m.layers).layer, rng.randrange(m.num_experts)) for _ in range(samples)]
    bufs = [[bytearray(p.nbytes) for p in m.pieces] for _ in range(m.top_k)]
    out = {}
    for depth in (1, m.top_k):
        reader.evict()
        for state in ("cold", "warm"):
            t0 = time.perf_counter()
            for i in range(0, samples, depth):
                reader.pool.wait(reader.pool.submit([ReadTask(layer, e, bufs[j], demand=True)
                                                     for j, (layer, e) in enumerate(picks[i:i + depth])]),
                                 layer=-1, why="measure")
            out[f"{state}_ms" if depth == 1 else f"{state}_parallel_ms"] = 1e3 * (time.perf_counter() - t0) / samples
    reader.close()
    return out


def bench_cli(args, defaults: dict) -> int:
    """`edge0 bench`; defaults: every flag's default (edge0/cli/bench.py), to refuse those another benchmark reads."""
    from .modes import SERVE, KERNELS, check_mode

    mode = check_mode(args, defaults)  # the flags another benchmark reads are refused
    if mode == SERVE:
        from .serve import bench_serve

        return bench_serve(args)
    if mode == KERNELS:
        from .kernels import bench_kernels

        bench_kernels(args)
        return 0
    return bench(args)


def check_args(args) -> tuple[list[str], list[str]]:
    """(arms, cache states) of the flags, checked before anything runs."""
    from ..model.demo import DEMO_FP, DEMO_STORE

    if not args.store and not args.source:  # the built-in model, as `edge0 run` and `edge0 eval` default to
        args.store = str(DEMO_STORE)
    if not args.source and Path(args.store or "").resolve() == DEMO_STORE.resolve():
        args.source = str(DEMO_FP)
    if args.arms is None:
        demo = Path(args.source or "").resolve() == DEMO_FP.resolve()
        args.arms = "mlx-lm:f32,resident,predicted:resident" if demo else "mlx-lm,exact"
    arms = [a for a in args.arms.split(",") if a]
    caches = [c for c in args.cache.split(",") if c]
    for a in arms:
        base, ahead, kernel = split_arm(a)
        if ahead and (ahead not in READ_AHEAD or not base.startswith(("prefetch:", "predicted")) or ":resident" in base):
            raise Edge0Error(f"--arms {a}: +MODE is --read-ahead's {', '.join(READ_AHEAD)}, on a prefetch or streamed "
                             "predicted arm")
        base, _, guesses = base.partition("/") if base.startswith("prefetch:") else (base, "", "")
        if guesses and not (guesses.isascii() and guesses.isdigit() and len(guesses) <= 9 and int(guesses) >= 1):
            raise Edge0Error(f"--arms {a}: a prefetch arm's /N (guesses read ahead) is a whole number of at least 1")
        if base not in ARMS or kernel not in ("", "mlx", "edge0") or (kernel and (base.startswith("mlx-lm")
                                                                                   or is_llama(base))):
            raise Edge0Error(f"--arms: unknown arm '{a}' (choose from {', '.join(ARMS)}; Edge0 arms take @mlx or @edge0)")
    for c in caches:
        if c not in ("cold", "warm"):
            raise Edge0Error(f"--cache: unknown state '{c}' (cold or warm)")
    if not arms or not caches:
        raise Edge0Error("--arms and --cache: name at least one each")
    for flag, value in (("--rounds", args.rounds), ("--max-tokens", args.max_tokens),
                        ("--prompt-tokens", args.prompt_tokens)):
        if value < 1:
            raise Edge0Error(f"{flag} {value}: must be at least 1")
    if args.io_throttle is not None and not (0 < args.io_throttle < float("inf")):
        raise Edge0Error(f"--io-throttle {args.io_throttle}: must be a finite number more than 0 (omit it for no cap)")
    whole("--threads", args.threads, 1)  # passed to every arm: said once here, not by each arm's process
    non_negative("--memory-budget", args.memory_budget)
    for flag, path in (("--store", args.store), ("--source", args.source)):
        if path and not Path(path).is_dir():
            raise Edge0Error(f"{flag} {path}: no such model directory")
    for a in arms:  # after the paths: a store that is not there is the first thing to say
        base = split_arm(a)[0]
        if not is_llama(base) and not (args.source if base.startswith("mlx-lm") else args.store):
            raise Edge0Error(f"--arms {base}: needs --{'source' if base.startswith('mlx-lm') else 'store'}")
    if not args.store:
        raise Edge0Error("--store: needed to record the replayed tokens")
    if args.replay and getattr(args, "replay_text", None):
        raise Edge0Error("--replay and --replay-text: give one")
    if args.memory_cap is not None and args.memory_cap != "none":
        try:
            ok = 0 < float(args.memory_cap) < float("inf")
        except ValueError:
            ok = False
        if not ok:
            raise Edge0Error(f"--memory-cap {args.memory_cap}: must be GiB more than 0, or none")
    return arms, caches


def results_dir(root: str, inputs: dict, kind: str = "bench") -> Path:
    """A new directory under --out for one bench's results (KIND-YYYYmmdd-HHMMSS), never inside an input."""
    from ..io.outputs import refuse_inputs

    refuse_inputs(root, inputs, "--out", replaces=False)  # the results go in a new directory: never into an input
    out = Path(root) / f"{kind}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    try:
        out.mkdir(parents=True, exist_ok=False)
    except FileExistsError:  # two benches in one second: do not mix their files
        out = out.with_name(f"{out.name}-{os.getpid()}")
        out.mkdir(parents=True)
    except OSError as e:
        raise Edge0Error(f"--out {root}: cannot be written ({e.strerror})") from None
    return out


def bench(args) -> int:
    arms, caches = check_args(args)
    llama_version = check_llama_arm(args) if any(map(is_llama, arms)) else None
    from ..io.manifest import read_manifest

    m = read_manifest(Path(args.store))  # a missing or broken store is said now, before anything is written
    if getattr(args, "slots", None) is not None:
        check_slots(args.slots, arms, m)
    given = given_replay(args.replay) if args.replay else None
    trace = check_routes(args, arms, m, given)  # --routes: read and checked before anything is written
    if getattr(args, "replay_text", None):  # a short or unreadable text is said before anything is written
        text_replay(args.replay_text, Path(args.store), args.prompt_tokens, args.max_tokens)
    cap = None if args.memory_cap is None else MemoryCap(None if args.memory_cap == "none" else float(args.memory_cap))
    out = results_dir(args.out, {"--store": args.store, "--source": args.source})
    replay = make_replay(args, out)
    played = json.loads(replay.read_text())
    args.max_tokens, args.prompt_tokens = len(played["tokens"]), len(played["prompt"])
    runs: dict[str, list[dict]] = {}
    for r, cache, arm in schedule(arms, args.rounds, caches):  # the arms' order rotated round by round
        res = run_arm(arm, args, cache, replay, cap)
        runs.setdefault(f"{arm}/{cache}", []).append(res)
        print(f"round {r + 1} {arm:10s} {cache}: " + (f"killed: {res['killed']}" if "killed" in res else
              f"{res['decode_tok_s']:.2f} tok/s decode, {res['prefill_tok_s']:.1f} tok/s prefill, peak MLX "
              f"{res['peak_mlx_gib']:.3f} GiB, RSS {res['peak_rss_gib']:.3f} GiB") +
              (f", cgroup peak {res['peak_cgroup_gib']:.2f} GiB" if res["peak_cgroup_gib"] else ""), file=sys.stderr)
    cost = read_cost(Path(args.store), args.io_throttle, io=args.io)
    summary = summarize(runs, cost)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cores": os.cpu_count(), "blas": blas(),
            "rounds": args.rounds, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
            "dtype": args.dtype, "source": args.source, "store": args.store, "memory_budget_gib": args.memory_budget,
            "slots": getattr(args, "slots", None), "io_throttle_mbps": args.io_throttle, "io": args.io, "read_cost": cost,
            "threads": args.threads,
            "gguf": args.gguf if llama_version else None, "llama_cpp": llama_version,
            "memory_cap_gib": cap.gib if cap else None, "cgroup": str(cap.parent) if cap else None,
            "replay": args.replay, "routes": getattr(args, "routes", None)}
    routes = routes_section(trace, summary, runs, meta, m)  # the trace's own hit rates, into the summary
    write_atomic(out / "results.json", json.dumps({"meta": meta, "median": summary, "runs": runs}, indent=1).encode())
    lines = table(summary, meta) + routes
    write_atomic(out / "results.md", ("\n".join(lines) + "\n").encode())
    print("\n".join(lines))
    print(f"\nwrote {out}/results.json and results.md", file=sys.stderr)
    return 0


def mlx_lm_arm(path: str, replay_path: str, dtype: str) -> None:
    """One resident mlx-lm run; prints the same JSON figures as `edge0 run --json`."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx.utils import tree_flatten
    from mlx_lm.sample_utils import make_sampler

    from ..model.load import cast_floats, compute_dtype
    from ..engine import memory_figures
    from ..decode.loop import generate_steps
    from ..decode.step import StepTimes

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

