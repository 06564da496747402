"""edge0/bench/harness.py: the rounds' order, warm-up, medians and paired ratios, against values worked out by hand."""

import json
import math

from edge0.bench import harness


def test_each_round_rotates_the_arms_left_by_one():
    assert [harness.rotation("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert harness.rotation([], 3) == []


def test_the_schedule_runs_every_condition_under_the_rounds_rotation():
    got = list(harness.schedule(["a", "b"], 2, within=["cold", "warm"]))
    assert got == [(0, "cold", "a"), (0, "cold", "b"), (0, "warm", "a"), (0, "warm", "b"),
                   (1, "cold", "b"), (1, "cold", "a"), (1, "warm", "b"), (1, "warm", "a")]


def test_warm_up_runs_every_arm_first_and_returns_no_row():
    calls, seen = [], []

    def measure(arm, r):
        calls.append((arm, r))
        return {"x": len(calls)}

    rows = harness.run_rounds(["a", "b"], 2, measure, warmup=1, on_row=seen.append)
    assert calls == [("a", -1), ("b", -1), ("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert rows == seen == [{"arm": "a", "round": 0, "x": 3}, {"arm": "b", "round": 0, "x": 4},
                            {"arm": "b", "round": 1, "x": 5}, {"arm": "a", "round": 1, "x": 6}]


def test_medians_by_arm_odd_and_even_counts_and_rows_without_the_figure():
    rows = [{"arm": "a", "f": 3}, {"arm": "b", "f": 4}, {"arm": "a", "f": 1}, {"arm": "b", "f": 1},
            {"arm": "a", "f": 2}, {"arm": "b", "f": 3}, {"arm": "b", "f": 2}, {"arm": "b", "f": None}]
    by = harness.group(rows)
    assert list(by) == ["a", "b"]
    assert harness.medians(by, ["f"]) == {"a": {"f": 2}, "b": {"f": 2.5}}  # b: 1 2 3 4, the None left out
    assert harness.medians(by, ["f"], missing=0.0)["b"]["f"] == 2  # b: 0 1 2 3 4
    assert harness.median([{"g": 1}], "f") is None


def test_the_paired_ratio_follows_the_round_where_the_medians_mislead():
    """The host slows between rounds: the arm is 1.2x the baseline in two rounds of three, though its median is
    0.9x the baseline's (180 against 200)."""
    rows = [{"arm": "base", "round": 0, "t": 100.0}, {"arm": "new", "round": 0, "t": 120.0},
            {"arm": "new", "round": 1, "t": 180.0}, {"arm": "base", "round": 1, "t": 200.0},
            {"arm": "base", "round": 2, "t": 400.0}, {"arm": "new", "round": 2, "t": 480.0}]
    by = harness.group(rows)
    m = harness.medians(by, ["t"])
    assert math.isclose(m["new"]["t"] / m["base"]["t"], 0.9)
    p = harness.paired(by, "t", baseline="base")
    assert math.isclose(p["new"].median, 1.2) and math.isclose(p["new"].low, 0.9) and math.isclose(p["new"].high, 1.2)
    assert (p["new"].faster, p["new"].rounds) == (2, 3)
    assert p["base"] == harness.Paired(1.0, 1.0, 1.0, 0, 3)


def test_rounds_the_baseline_missed_or_measured_as_zero_are_left_out():
    base = [{"round": 0, "t": 100.0}, {"round": 2, "t": 0.0}]
    rows = [{"round": 0, "t": 150.0}, {"round": 1, "t": 90.0}, {"round": 2, "t": 80.0}, {"round": 3}]
    assert harness.ratios(rows, base, "t") == [1.5]
    p = harness.paired({"base": base, "new": rows[1:2]}, "t", "base")["new"]
    assert math.isnan(p.median) and p.rounds == 0 and p.faster == 0


def test_rows_are_json_lines_replaced_whole_or_appended(tmp_path):
    path = tmp_path / "rows.jsonl"
    harness.write_rows(path, [{"arm": "a", "round": 0, "t": 1.5}])
    harness.write_rows(path, [{"arm": "b", "round": 0, "t": 2.5}], append=True)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"arm": "a", "round": 0, "t": 1.5}, {"arm": "b", "round": 0, "t": 2.5}]
    harness.write_rows(path, [])
    assert path.read_text() == ""


def test_edge0_bench_runs_its_arms_in_the_harness_order_and_reports_their_medians(monkeypatch, tmp_path):
    """Arms and cache states over three rounds, each run's figure its place in the run order: the order and the
    medians per arm and cache state worked out by hand."""
    import edge0.bench
    from edge0.cli import main

    order = []

    def run_arm(arm, args, cache, replay, cap=None):
        order.append((arm, cache))
        return {"decode_tok_s": float(len(order)), "prefill_tok_s": 1.0, "peak_mlx_gib": 0.0, "peak_rss_gib": 0.0,
                "peak_cgroup_gib": None, "dtype": "float32", "kernel": "edge0", "threads": 1, "tokens": [1]}

    monkeypatch.setattr(edge0.bench, "run_arm", run_arm)
    monkeypatch.setattr(edge0.bench, "read_cost", lambda *a, **k: {"cold_ms": 1.0, "warm_ms": 1.0})
    assert main(["bench", "--arms", "resident,staged", "--cache", "cold,warm", "--rounds", "3", "--max-tokens", "4",
                 "--prompt-tokens", "16", "--out", str(tmp_path)]) == 0
    r, s = "resident", "staged"
    assert order == [(r, "cold"), (s, "cold"), (r, "warm"), (s, "warm"), (s, "cold"), (r, "cold"), (s, "warm"),
                     (r, "warm"), (r, "cold"), (s, "cold"), (r, "warm"), (s, "warm")]
    (out,) = tmp_path.iterdir()
    median = json.loads((out / "results.json").read_text())["median"]
    assert {k: v["decode_tok_s"] for k, v in median.items()} == {"resident/cold": 6.0, "staged/cold": 5.0,
                                                                 "resident/warm": 8.0, "staged/warm": 7.0}
