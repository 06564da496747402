"""tools/disk_idle.py: a timeline's decode steps split into disk-busy and idle time, checked on a timeline written
by hand; a missing or foreign file is one line naming it."""

import json
import subprocess
import sys
from pathlib import Path

from edge0.sched.trace import FORMAT

TOOL = Path(__file__).resolve().parents[2] / "tools" / "disk_idle.py"


def run(*paths):
    return subprocess.run([sys.executable, str(TOOL), *map(str, paths)], capture_output=True, text=True, timeout=60)


def event(name, ts, dur, **args):
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": 0, "args": args}


def test_a_hand_made_step_splits_into_busy_and_idle(tmp_path):
    # step 1: 0-10 ms; reads 1-3 and 2-4 ms (one burst), 6-7 ms, and a read ahead 9-12 ms clipped to 9-10
    us = 1000
    events = [event("step", 0, 10 * us, step=1), event("step", 20 * us, 5 * us, step=0),  # step 0 (prompt): not counted
              event("read", 1 * us, 2 * us, bytes=1000), event("read", 2 * us, 2 * us, bytes=1000),
              event("read", 6 * us, 1 * us, bytes=1000), event("read", 9 * us, 3 * us, bytes=1000)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"format": FORMAT}}))
    got = run(path)
    assert got.returncode == 0, got.stderr
    # busy 3 + 1 + 1 = 5 ms; idle 5 = before 1 + between (4-6, 7-9) 4 + after 0; 3 bursts, 4 reads, 4000 B / 5 ms
    assert ("1 steps; per step (mean) 10.0 ms: disk busy 5.0, idle 5.0 = before the first read 1.0 + between its "
            "3.0 bursts of reads 4.0 + after the last 0.0; 4.0 reads, 1 MB/s while busy") in got.stdout, got.stdout


def test_bad_files_are_one_line_naming_them(tmp_path):
    junk, prompt_only = tmp_path / "junk.json", tmp_path / "prompt.json"
    junk.write_text("{not json")
    prompt_only.write_text(json.dumps({"traceEvents": [event("step", 0, 10, step=0)], "otherData": {"format": FORMAT}}))
    for path, says in ((tmp_path / "none.json", "no such trace file"), (junk, "not a trace (invalid JSON"),
                       (prompt_only, "no decode steps")):
        got = run(path)
        assert got.returncode == 2 and f"{path}: {says}" in got.stderr, got.stderr
        assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.stderr, got.stderr
