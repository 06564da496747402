"""`edge0 bench --routes FILE`: every arm's routing forced from one trace, and what that routing allows.

    edge0 bench --store olmoe.edge0 --arms resident,native,hot --routes tests/data/olmoe/olmoe-1b-7b-seed2.json \
        --prompt-tokens 12 --max-tokens 120 --slots 16

Each Edge0 arm runs `edge0 run --routes FILE` (the trace's rows from the prompt's first token on); the routes
table adds per arm its slot hit rate beside the trace's own hit rates for the same memory (compute/eviction.py
replays the rows the arm's banks serve: LRU, and the optimum, Belady, which knows the future), the bytes it read
per token, the disk's bandwidth at the queue depth reads run at, and the step's limit: max(compute with every
expert resident, the arm's reads at that bandwidth).
"""

from __future__ import annotations

from .arms import split_arm
from .table import is_llama
from ..errors import Edge0Error

UNFORCED = ("mlx-lm", "predicted")  # arms whose routing a trace cannot force: mlx-lm's own, or the heads'



def check_routes(args, arms: list[str], m, given: dict | None):
    """The --routes trace, read and checked against the store and the replay's tokens (the prompt's and max tokens -
    1 rows), before anything runs; None without --routes. given: the --replay file's contents, if any."""
    check_affinity(args, arms)
    if not getattr(args, "routes", None):
        return None
    from ..io.routetrace import check_fits, read_trace

    what = f"--routes {args.routes}"
    for a in arms:
        base = split_arm(a)[0]
        if is_llama(base) or base.startswith(UNFORCED):
            raise Edge0Error(f"{what} and --arms {a}: a trace forces Edge0's native or prefetch routing only; drop the "
                             "arm")
    trace = read_trace(args.routes, what)
    prompt = len(given["prompt"]) if given else args.prompt_tokens
    tokens = len(given["tokens"]) if given and given.get("tokens") else args.max_tokens
    check_fits(trace, what, layers=len(m.layers), experts=m.num_experts, top_k=m.top_k, tokens=prompt + tokens - 1)
    return trace


def route_flags(args, arm: str | None = None) -> list[str]:
    """What every Edge0 arm (and the replay's recording run) adds to its command line: the trace, and the affinity
    table to the arms that read it (prefetch:affinity)."""
    flags = ["--routes", str(args.routes)] if getattr(args, "routes", None) else []
    if arm is not None and split_arm(arm)[0].split("/")[0] == "prefetch:affinity":
        flags += ["--affinity", str(args.affinity)]
    return flags


def check_affinity(args, arms: list[str]) -> None:
    """--affinity FILE: given exactly where an arm reads it (prefetch:affinity)."""
    reads = any(split_arm(a)[0].split("/")[0] == "prefetch:affinity" for a in arms)
    given = getattr(args, "affinity", None) is not None
    if reads != given:
        raise Edge0Error("--arms prefetch:affinity reads a co-activation table: give --affinity FILE (edge0 train "
                         "affinity)" if reads else f"--affinity {args.affinity}: no arm reads it (prefetch:affinity)")


def routes_section(trace, summary: dict, runs: dict, meta: dict, m) -> list[str]:
    """With --routes: the trace's hit rates into each arm's summary (trace_rates), and results.md's routes table."""
    if trace is None:
        return []
    trace_rates(trace, summary, runs, meta)
    return routes_table(summary, meta, m.bundle_bytes, m.top_k)


def trace_rates(trace, summary: dict, runs: dict, meta: dict) -> None:
    """Per arm with slot banks, the trace's LRU and optimal hit rates for its memory over the rows its banks serve
    (with whole-layer prefill: the prompt's last and each decode step's; else every row), into its summary."""
    from ..compute.eviction import trace_hit_rates

    p, n = meta["prompt_tokens"], meta["max_tokens"]
    for key, s in summary.items():
        run = next((r for r in runs[key] if "killed" not in r), {})
        slots, executor = run.get("slots"), run.get("executor")
        if not slots or executor not in ("staged", "hot") or run.get("held_layers"):
            continue
        rows = trace.ids[:, p - 1 if run.get("whole_layer_prefill") else 0:p + n - 1]
        rates = trace_hit_rates(rows, slots, ("lru", "belady"), trace.num_experts or int(trace.ids.max()) + 1,
                                shared=executor == "hot")
        s.update(slots=slots, trace_lru=rates["lru"], trace_optimum=rates["belady"])


def routes_table(summary: dict, meta: dict, bundle_bytes: int, top_k: int) -> list[str]:
    """results.md's routes section: per arm, its slot hits against the trace's, bytes per token and the step's
    limit at the disk's measured bandwidth (reads K at a time, cold: the rate of a layer's misses)."""
    cost = meta["read_cost"]
    mbps = bundle_bytes / cost["cold_parallel_ms"] / 1e3 if cost.get("cold_parallel_ms") else None
    floor = {key.rsplit("/", 1)[1]: s["step_ms"] for key, s in summary.items() if key.startswith("resident/")}
    lines = ["", f"Routing forced from {meta['routes']} (every arm); trace hit rates: the same memory replayed "
                 f"(compute/eviction.py), LRU and the optimum (Belady); disk "
                 + (f"{mbps:.0f} MB/s reading {top_k} bundles at a time, cold" if mbps else "not measured")
                 + "; limit: max(the resident arm's step, MiB read per token at that rate)", "",
             "| arm | cache | slots | slot hits | trace LRU | trace optimum | hits / optimum | MiB read/token | "
             "step ms | limit ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, s in summary.items():
        if s["killed"] == s["runs"]:
            continue
        arm, cache = key.rsplit("/", 1)
        per_token = s["bytes_read"] / max(1, meta["max_tokens"])
        read_ms = per_token / (mbps * 1e3) if mbps else None
        limit = max(floor[cache], read_ms) if cache in floor and read_ms is not None else None
        opt = s.get("trace_optimum")
        lines.append(f"| {arm} | {cache} | {s.get('slots', '-')} | {s['hit_rate']:.3f} | "
                     + (f"{s['trace_lru']:.3f} | {opt:.3f} | {s['hit_rate'] / opt:.2f}x | " if opt else "- | - | - | ")
                     + f"{per_token / 2**20:.1f} | {s['step_ms']:.0f} | "
                     + (f"{limit:.0f} |" if limit is not None else "- |"))
    return lines
