"""When the disk idles in a decode step: a timeline of `edge0 run --trace` split into read time and idle time.

    python tools/disk_idle.py run.json [more.json ...]

Per decode step (as `edge0 trace summarize` takes them): the time at least one bundle read runs (busy), and the
idle rest: before the step's first read, between bursts of reads (on demand: one layer's misses land, its
experts and the next layer's attention and router run, the next layer's ids reach the host), after the last.
Means over the steps, and the MB/s the disk gave while busy.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def bursts(reads: list[tuple[float, float]]) -> list[list[float]]:
    """The union of read intervals (start, end), as disjoint bursts in time order."""
    out: list[list[float]] = []
    for s, t in sorted(reads):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return out


def idle(path: str) -> dict:
    """Mean ms per decode step: step, busy, idle before / between / after the reads; bursts, reads, MB/s busy."""
    events = json.load(open(path))["traceEvents"]
    steps = [e for e in events if e.get("name") == "step" and e["args"].get("step", 1) >= 1]
    reads = [e for e in events if e.get("name") == "read" and e.get("ph") == "X" and not e["args"].get("whole_layer")]
    rows = []
    for st in steps:
        a, b = st["ts"], st["ts"] + st["dur"]
        mine = [e for e in reads if a <= e["ts"] <= b]
        got = bursts([(e["ts"], e["ts"] + e["dur"]) for e in mine])
        busy = sum(t - s for s, t in got)
        gaps = sum(got[i + 1][0] - got[i][1] for i in range(len(got) - 1))
        first, after = (got[0][0] - a, b - got[-1][1]) if got else (st["dur"], 0.0)
        rows.append((st["dur"] / 1e3, busy / 1e3, first / 1e3, gaps / 1e3, after / 1e3, len(got), len(mine),
                     sum(e["args"].get("bytes", 0) for e in mine)))
    m = np.array(rows).mean(0)
    names = ("step_ms", "busy_ms", "idle_before_ms", "idle_between_ms", "idle_after_ms", "bursts", "reads")
    out = dict(zip(names, m[:7].tolist()))
    out.update(idle_ms=m[0] - m[1], busy_mb_s=m[7] / 1e3 / m[1] if m[1] else 0.0, steps=len(rows))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="timelines written by `edge0 run --trace`")
    for path in p.parse_args().traces:
        r = idle(path)
        print(f"{path}: {r['steps']} steps; per step (mean) {r['step_ms']:.1f} ms: disk busy {r['busy_ms']:.1f}, "
              f"idle {r['idle_ms']:.1f} = before the first read {r['idle_before_ms']:.1f} + between its "
              f"{r['bursts']:.1f} bursts of reads {r['idle_between_ms']:.1f} + after the last "
              f"{r['idle_after_ms']:.1f}; {r['reads']:.1f} reads, {r['busy_mb_s']:.0f} MB/s while busy")


if __name__ == "__main__":
    main()
