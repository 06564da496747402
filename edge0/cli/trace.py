"""`edge0 trace summarize FILE` (a timeline's breakdown, edge0/sched/summarize.py) and `edge0 trace synth FILE`
(a SYNTHETIC routing trace, edge0/io/routesynth.py).

    edge0 trace summarize traces/run.json --plot traces/run.png
"""

from __future__ import annotations

import argparse
import json


def add_args(p: argparse.ArgumentParser) -> None:
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


def main(args: argparse.Namespace) -> int:
    from ..errors import Edge0Error
    from ..sched.summarize import check_plot, load_trace, plot, summarize, windows

    if args.action == "synth":
        return _synth(args)
    given = [f for f in ("layers", "experts", "top_k", "tokens", "seed") if getattr(args, f, None) is not None]
    if given:
        raise Edge0Error(f"--{given[0].replace('_', '-')}: only `edge0 trace synth` reads it")
    if args.action != "summarize":
        raise Edge0Error(f"`edge0 trace {args.action}`: unknown action (summarize)")
    if args.windows is not None and args.windows < 1:
        raise Edge0Error(f"--windows {args.windows}: must be at least 1 (decode steps a window)")
    if args.plot:
        check_plot(args.plot, args.file)
    data = load_trace(args.file)
    s = summarize(data)
    if args.windows:
        s["windows"] = windows(data, args.windows)
    if args.json:
        print(json.dumps(s))
    else:
        print_summary(s)
        if args.windows:
            print_windows(s["windows"])
    if args.plot:
        plot(data, s, args.plot)
    return 0


def _synth(args: argparse.Namespace) -> int:
    from ..errors import Edge0Error
    from ..io.routesynth import synth_file

    for flag in ("plot", "windows"):
        if getattr(args, flag) is not None:
            raise Edge0Error(f"--{flag}: `edge0 trace synth` does not read it (summarize does)")
    if args.json:
        raise Edge0Error("--json: `edge0 trace synth` does not read it (summarize does)")
    print(synth_file(args.file, layers=args.layers, experts=args.experts, top_k=args.top_k, tokens=args.tokens,
                     seed=args.seed))
    return 0


def print_summary(s: dict) -> None:
    fit = s["load_cost_fit"]
    rows = [
        ("steps", f"{s['steps']} decode steps"),
        ("decode", f"{s['tok_s']:.2f} tok/s ({s['step_ms']:.1f} ms/step)"),
        ("stall", f"{s['stall_ms_per_token']:.2f} ms/token (the graph-building thread waiting on reads)"),
        ("scheduler", f"{s['sched_ms_per_token']:.2f} ms/token on the graph-building thread (of which "
                      f"{s.get('loop_wait_ms_per_token', 0.0):.2f} waiting for the loop), "
                      f"{s.get('loop_ms_per_token', 0.0):.2f} on the scheduler's loop"),
        ("loads", f"{s['loads_per_step']:.1f}/step, {s['mib_per_load']:.2f} MiB/load, {100 * s['cold_fraction']:.0f}% cold, "
                  f"{s['demand_loads']} on demand"),
        ("reads", f"{s['read_ms_per_step']:.1f} ms/step with a read in flight, {s['read_depth']:.1f} in flight on "
                  f"average, {s['read_mb_s']:.0f} MB/s"),
        ("compute", f"{s['eval_ms_per_step']:.1f} ms/step waiting for MLX, graph build {s['graph_build_ms_per_step']:.1f} "
                    "ms/step"),
        ("recall", "-" if s["recall"] is None else f"{100 * s['recall']:.1f}%"),
    ]
    if s.get("prompt_last_step_ms") is not None:  # where a first use's work (a bank's memory) lands before decode
        rows.insert(0, ("prompt", f"its last token's step {s['prompt_last_step_ms']:.1f} ms (the first token's; "
                                  "in the prompt's time, not decode's)"))
    if s.get("layer_sched_us") is not None or s.get("demand_layer_sched_us") is not None:
        def us(name: str) -> str:
            v, least = s.get(f"{name}_sched_us"), s.get(f"{name}_sched_min_us")
            return "-" if v is None else f"{v:.1f} us ({s[f'{name}s_per_step']:.1f}/step, least {least:.1f})"

        rows.insert(rows.index(next(r for r in rows if r[0] == "scheduler")) + 1, (
            "layers", f"{us('layer')} of it a routed layer without a demand read, {us('demand_layer')} with one; "
                      "medians"))
    if fit["a_ms"] is not None:
        rows.append(("load cost", f"{fit['a_ms']:.3f} ms + {fit['b_ms']:.3f} ms x cold (rms residual "
                                  f"{fit['rms_residual_ms']:.3f} ms, max {fit['max_residual_ms']:.3f} ms)"))
    for k, v in rows:
        print(f"{k:>10}  {v}")


def print_windows(rows: list[dict]) -> None:
    print("| steps | step ms (median) | shortest | longest | stall ms/step | loads/step | ahead/step | read ms |")
    print("|---|---|---|---|---|---|---|---|")
    for w in rows:
        read = "-" if w["read_ms"] is None else f"{w['read_ms']:.2f}"
        print(f"| {w['first_step']}-{w['first_step'] + w['steps'] - 1} | {w['step_ms']:.1f} | {w['min_step_ms']:.1f} | "
              f"{w['max_step_ms']:.1f} | {w['stall_ms_per_step']:.1f} | {w['loads_per_step']:.1f} | "
              f"{w['ahead_per_step']:.1f} | {read} |")
