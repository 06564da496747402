"""Before/after arms of `edge0 run --json` on one store, alternating, for docs/lab/pipeline.md.

    python tools/pipeline_ab.py --store S --replay R --rounds 4 --io direct,warm --out results.jsonl \\
        'native|/tmp/e0base|--routing native --executor staged' 'predicted|/tmp/e0after|--routing predicted'

An arm is LABEL|CODE|FLAGS: CODE is a directory holding an `edge0` package (a snapshot of the code to
measure, put first on PYTHONPATH; '-' for the installed one). Each run is its own process; arms rotate
across rounds; `direct` runs with --io direct --cold (every read from the disk), `warm` reads the store's
files once first and runs with pread. Every run's JSON goes to --out; the medians are printed as markdown, with
each arm's paired ratio to the first arm (the median over rounds of their ratio in the same round: robust to a host
whose speed drifts between rounds). --figure prefill_tok_s compares the prompts' speed instead of decode's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the edge0 package beside this script

from edge0.bench.harness import group, median, paired, schedule, write_rows  # noqa: E402

def warm(store: Path) -> None:
    for f in store.rglob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def run(store: Path, replay: str, code: str, flags: list[str], io: str) -> dict:
    env = dict(os.environ)
    if code != "-":
        env["PYTHONPATH"] = code
    tokens = len(json.loads(Path(replay).read_text())["tokens"])
    cmd = [sys.executable, "-m", "edge0.run", "--model", str(store), "--replay", replay, "--ignore-eos", "--json",
           "--max-tokens", str(tokens), *flags]
    if io == "direct":
        cmd += ["--io", "direct", "--cold"]
    else:
        warm(store)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/")
    if proc.returncode:
        raise SystemExit(f"{cmd}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--replay", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--io", default="direct")
    p.add_argument("--out", required=True)
    p.add_argument("--figure", default="decode_tok_s", choices=("decode_tok_s", "prefill_tok_s"),
                   help="the figure compared (default decode_tok_s; prefill_tok_s: the prompt's)")
    p.add_argument("arms", nargs="+")
    a = p.parse_args()
    a.store, a.replay = str(Path(a.store).resolve()), str(Path(a.replay).resolve())  # runs start in /
    parts = [x.split("|", 2) for x in a.arms]
    bad = next((x for x, arm in zip(a.arms, parts) if len(arm) != 3), None)
    if bad is not None:
        p.error(f"arm {bad!r}: expected LABEL|CODE|FLAGS (CODE: a directory holding edge0/, or -)")
    arms = {label: (code, flags) for label, code, flags in parts}
    if len(arms) < len(parts):
        p.error("arms: each LABEL once")
    for code, _ in arms.values():
        if code != "-" and not (Path(code) / "edge0").is_dir():
            p.error(f"arm code {code!r}: no edge0/ package there")
    if not Path(a.store, "edge0.json").is_file():
        p.error(f"--store {a.store}: not an Edge0 store (no edge0.json)")
    try:
        json.loads(Path(a.replay).read_text())["tokens"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"--replay {a.replay}: not a replay file ({e})")
    ios, rows = a.io.split(","), []
    for r, io, label in schedule(list(arms), a.rounds, ios):  # the arms' order rotated round by round
        code, flags = arms[label]
        d = run(Path(a.store), a.replay, code, flags.split(), io)
        d.update(arm=label, io=io, round=r, store=a.store)
        write_rows(a.out, [{k: v for k, v in d.items() if k != "text"}], append=True)
        rows.append(d)
        print(f"round {r} {label:28s} {io:6s} {d[a.figure]:7.2f} tok/s", file=sys.stderr, flush=True)
    print("\n".join(table(rows, list(arms)[0], ios, a.figure)))


def table(rows: list[dict], first: str, ios: list[str], figure: str) -> list[str]:
    """The markdown table: per arm and --io mode the medians, and the figure paired with the first arm's (the
    median over rounds of their ratio in the same round: robust to a host whose speed drifts between rounds)."""
    what = figure.replace("_tok_s", "")
    lines = [f"| arm | io | {what} tok/s | runs | x {first} (paired) | stall ms/tok | sched ms/tok (cpu) | loads/step "
             "| recall |", "|---|---|---|---|---|---|---|---|---|"]
    for io in ios:
        by = group([d for d in rows if d["io"] == io])
        ratios = paired(by, figure, first)
        for label, ds in by.items():
            def med(k):
                return median(ds, k, missing=0.0)
            steps = max(len(ds[0]["tokens"]) - 1, 1)
            p = ratios[label]
            lines.append(f"| {label} | {io} | {med(figure):.2f} | {', '.join('%.2f' % d[figure] for d in ds)} | "
                         f"{p.median:.3f}x ({p.faster}/{len(ds)} faster) | {med('stall_ms_per_token'):.1f} | "
                         f"{med('sched_ms_per_token'):.1f} ({med('sched_cpu_ms_per_token'):.1f}) | "
                         f"{med('loads') / steps:.1f} | {med('recall'):.2f} |")
    return lines


if __name__ == "__main__":
    main()
