"""tools/evict_study.py (and evict_shared.py behind --shared): bad input is one line naming what is wrong, and a
small study runs to its table."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from edge0.io.routetrace import RouteTrace, write_trace

TOOL = Path(__file__).resolve().parents[2] / "tools" / "evict_study.py"


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=120)


def traces(where, n=2, layers=2, tokens=24, experts=8, k=2):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        ids = np.stack([[rng.choice(experts, k, replace=False) for _ in range(tokens)] for _ in range(layers)])
        path = where / f"L{layers}-t{i}.json"
        write_trace(path, RouteTrace(ids.astype(np.int32), None, list(range(layers)), experts))
        out.append(path)
    return out


def test_bad_input_is_one_line(tmp_path):
    a, b = traces(tmp_path)
    other = traces(tmp_path, n=1, layers=3)[0]
    for args, says in (([a], "give two or more traces"), ([a, tmp_path / "none.json"], "none.json: no such file"),
                       ([a, other], "the traces are of different models"), ([a, b, "--slots", "4,x"], "--slots 4,x: "
                       "expected whole numbers"), ([a, b, "--shared", "6", "--rows", "90:99"], "--rows 90:99: no row"),
                       ([a, b, "--tokens", "1"], "--tokens 1: at least 2")):
        got = run(*args)
        assert got.returncode == 2 and says in got.stderr and "Traceback" not in got.stderr, got.stderr
        assert len(got.stderr.strip().splitlines()) == 1, got.stderr


def test_a_small_study_prints_its_tables(tmp_path):
    a, b = traces(tmp_path)
    got = run(a, b, "--slots", "4")
    assert got.returncode == 0 and "S=4 (ratio to the optimum" in got.stdout and "oracle-next" in got.stdout, got.stderr
    got = run(a, b, "--shared", "6", "--rows", "2:20")
    assert got.returncode == 0 and "6 shared slots" in got.stdout, got.stderr
