"""`edge0 bench --routes FILE` (bench/route_arms.py): every Edge0 arm forced from the trace, the routes table with the
trace's own hit rates for each arm's memory, and refusals before anything is written."""

import json
import subprocess
import sys

import numpy as np

from edge0.cli import main
from edge0.compute.eviction import replay, trace_hit_rates
from edge0.io.routetrace import RouteTrace, write_trace

LAYERS, EXPERTS, K = 6, 32, 4  # the demo store's
PROMPT = list(range(300, 312))


def _trace(path, rows: int):
    rng = np.random.default_rng(2)
    p = 1.0 / np.arange(1, EXPERTS + 1)
    ids = np.array([[rng.choice(EXPERTS, K, replace=False, p=p / p.sum()) for _ in range(rows)]
                    for _ in range(LAYERS)], dtype=np.int32)
    write_trace(path, RouteTrace(ids, None, list(range(LAYERS)), num_experts=EXPERTS))
    return ids


def test_bench_forces_every_arm_and_reports_the_traces_hit_rates(tmp_path):
    tokens = 10
    ids = _trace(tmp_path / "t.npz", len(PROMPT) + tokens - 1)
    (tmp_path / "replay.json").write_text(json.dumps({"prompt": PROMPT, "tokens": [5] * tokens}))
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "bench", "--arms", "staged,staged:lru,hot", "--rounds", "1",
                           "--replay", str(tmp_path / "replay.json"), "--routes", str(tmp_path / "t.npz"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (out,) = (tmp_path / "out").iterdir()
    results = json.loads((out / "results.json").read_text())
    rows = ids[:, len(PROMPT) - 1:]  # what the banks serve: the prompt's last row (whole-layer prefill), each step's
    staged = results["median"]["staged/warm"]
    assert staged["slots"] == 2 * K and results["runs"]["staged/warm"][0]["tokens"] == [5] * tokens
    want = trace_hit_rates(rows, 2 * K, ("lru", "belady"), num_keys=EXPERTS)
    assert (staged["trace_lru"], staged["trace_optimum"]) == (want["lru"], want["belady"])
    lfu = [replay(layer, 2 * K, "lfu", num_keys=EXPERTS) for layer in rows]  # the arm's own policy: forced, exactly
    assert staged["hit_rate"] == sum(h for h, _ in lfu) / sum(n for _, n in lfu)
    assert results["median"]["staged:lru/warm"]["hit_rate"] == want["lru"]  # --evict lru: the trace's LRU, exactly
    hot = results["median"]["hot/warm"]  # 1 GiB holds every expert: only first uses miss
    first = len({(layer, e) for layer in range(LAYERS) for e in rows[layer].ravel()})
    assert hot["trace_optimum"] == hot["trace_lru"] == hot["hit_rate"] == (rows.size - first) / rows.size
    md = (out / "results.md").read_text()
    assert f"| staged | warm | 8 | {staged['hit_rate']:.3f} | {want['lru']:.3f} | {want['belady']:.3f} |" in md


def test_bench_refuses_a_trace_that_cannot_route_its_arms_before_writing(capsys, tmp_path):
    _trace(tmp_path / "short.npz", 20)
    base = ["bench", "--rounds", "1", "--out", str(tmp_path / "out"), "--prompt-tokens", "16"]
    cases = [(["--arms", "staged", "--max-tokens", "8"], "the trace holds 20 tokens, shorter than the run's 23"),
             (["--arms", "staged,mlx-lm:f32"], "--arms mlx-lm:f32: a trace forces Edge0's native or prefetch"),
             (["--arms", "predicted"], "--arms predicted: a trace forces Edge0's native or prefetch")]
    for flags, message in cases:
        assert main([*base, *flags, "--routes", str(tmp_path / "short.npz")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
