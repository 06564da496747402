"""When the disk idles in a decode step: a timeline of `edge0 run --trace` split into read time and idle time.

    python tools/disk_idle.py run.json [more.json ...]

Per decode step (as `edge0 trace summarize` takes them): the time at least one bundle read runs (busy), and the
idle rest: before the step's first read, between bursts of reads (on demand: one layer's misses land, its
experts and the next layer's attention and router run, the next layer's ids reach the host), after the last.
Means over the steps, and the MB/s the disk gave while busy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge0.errors import Edge0Error  # noqa: E402
from edge0.sched.summarize import bursts, load_trace  # noqa: E402


def idle(path: str) -> dict:
    """Mean ms per decode step: step, busy, idle before / between / after the reads; bursts, reads, MB/s busy."""
    events = load_trace(path)["traceEvents"]  # (a missing or damaged file: one Edge0Error naming it)
    steps = [e for e in events if e.get("name") == "step" and e["args"].get("step", 1) >= 1]
    reads = [e for e in events if e.get("name") == "read" and e.get("ph") == "X" and not e["args"].get("whole_layer")]
    rows = []
    for st in steps:
        a, b = st["ts"], st["ts"] + st["dur"]
        mine = [e for e in reads if a <= e["ts"] <= b]
        got = bursts([(max(e["ts"], a), min(e["ts"] + e["dur"], b)) for e in reads  # clipped to the step: a read
                      if e["ts"] < b and e["ts"] + e["dur"] > a])  # running on past its end is the next step's
        busy = sum(t - s for s, t in got)
        gaps = sum(got[i + 1][0] - got[i][1] for i in range(len(got) - 1))
        first, after = (got[0][0] - a, b - got[-1][1]) if got else (st["dur"], 0.0)
        rows.append((st["dur"] / 1e3, busy / 1e3, first / 1e3, gaps / 1e3, after / 1e3, len(got), len(mine),
                     sum(e["args"].get("bytes", 0) for e in mine)))
    if not rows:
        raise Edge0Error(f"{path}: no decode steps (a timeline of `edge0 run --trace` with --max-tokens 2 or more)")
    m = np.array(rows).mean(0)
    names = ("step_ms", "busy_ms", "idle_before_ms", "idle_between_ms", "idle_after_ms", "bursts", "reads")
    out = dict(zip(names, m[:7].tolist()))
    out.update(idle_ms=m[0] - m[1], busy_mb_s=m[7] / 1e3 / m[1] if m[1] else 0.0, steps=len(rows))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="timelines written by `edge0 run --trace`")
    for path in p.parse_args().traces:
        try:
            r = idle(path)
        except Edge0Error as e:
            print(f"disk_idle: error: {e}", file=sys.stderr)
            return 2
        print(f"{path}: {r['steps']} steps; per step (mean) {r['step_ms']:.1f} ms: disk busy {r['busy_ms']:.1f}, "
              f"idle {r['idle_ms']:.1f} = before the first read {r['idle_before_ms']:.1f} + between its "
              f"{r['bursts']:.1f} bursts of reads {r['idle_between_ms']:.1f} + after the last "
              f"{r['idle_after_ms']:.1f}; {r['reads']:.1f} reads, {r['busy_mb_s']:.0f} MB/s while busy")


if __name__ == "__main__":
    sys.exit(main())
