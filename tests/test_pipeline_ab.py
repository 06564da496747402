"""tools/pipeline_ab.py: its arms run in the harness's rotated order, every run is a row of --out, and the table
pairs each arm with the first round by round (its runs faked: each a figure worked out by hand)."""

import importlib.util
import json
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("pipeline_ab", Path(__file__).parents[1] / "tools" / "pipeline_ab.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

# the host slows down round by round; b is 1.2x a in rounds 0 and 2, 0.9x in round 1 (its median is 0.9x a's)
SPEED = {"a": [100.0, 200.0, 400.0], "b": [120.0, 180.0, 480.0]}


def test_arms_rotate_every_run_is_a_row_and_the_ratio_is_paired(tmp_path, monkeypatch, capsys):
    store, replay, out = tmp_path / "store", tmp_path / "replay.json", tmp_path / "runs.jsonl"
    store.mkdir()
    (store / "edge0.json").write_text("{}")
    replay.write_text(json.dumps({"prompt": [1], "tokens": [1, 2, 3]}))
    calls = []

    def run(store_, replay_, code, flags, io):
        arm = flags[-1]
        calls.append((arm, io))
        r = sum(c == (arm, io) for c in calls) - 1
        return {"decode_tok_s": SPEED[arm][r] * (2 if io == "warm" else 1), "tokens": [1, 2, 3], "text": "x"}

    monkeypatch.setattr(tool, "run", run)
    monkeypatch.setattr(sys, "argv", ["pipeline_ab.py", "--store", str(store), "--replay", str(replay), "--rounds",
                                      "3", "--io", "direct,warm", "--out", str(out), "a|-|--arm a", "b|-|--arm b"])
    tool.main()
    assert calls == [("a", "direct"), ("b", "direct"), ("a", "warm"), ("b", "warm"), ("b", "direct"),
                     ("a", "direct"), ("b", "warm"), ("a", "warm"), ("a", "direct"), ("b", "direct"), ("a", "warm"),
                     ("b", "warm")]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["arm"], r["io"], r["round"]) for r in rows] == [(a, io, i // 4) for i, (a, io) in enumerate(calls)]
    assert all("text" not in r for r in rows)
    table = capsys.readouterr().out
    assert "| b | direct | 180.00 | 120.00, 180.00, 480.00 | 1.200x (2/3 faster) |" in table
    assert "| b | warm | 360.00 | 240.00, 360.00, 960.00 | 1.200x (2/3 faster) |" in table
    assert "| a | direct | 200.00 | 100.00, 200.00, 400.00 | 1.000x (0/3 faster) |" in table
