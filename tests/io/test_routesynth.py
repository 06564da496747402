"""Synthetic routing traces (io/routesynth.py, `edge0 trace synth`): their kept share and popularity skew match
the real OLMoE traces', both measured here with plain Python on the files as they are."""

import json
from collections import Counter

import pytest

from edge0.cli import main
from edge0.io.routesynth import synth_trace
from edge0.io.routetrace import read_trace

from tests.helpers import OLMOE_TRACES

SEEDS = [OLMOE_TRACES / f"olmoe-1b-7b-seed{s}.json" for s in (1, 2, 3)]


def _stats(layers: list[list[list[int]]], experts: int) -> tuple[float, float]:
    """Mean over layers of (the share of a token's experts that the last token routed too, the share of routings
    that the quarter of experts used most takes)."""
    kept, top = [], []
    for rows in layers:
        rows = [r for r in rows if min(r) >= 0]
        kept.append(sum(len(set(a) & set(b)) for a, b in zip(rows, rows[1:])) / (len(rows) - 1) / len(rows[0]))
        counts = sorted(Counter(e for r in rows for e in r).values(), reverse=True)
        top.append(sum(counts[: experts // 4]) / sum(counts))
    return sum(kept) / len(kept), sum(top) / len(top)


@pytest.mark.parametrize("layers,experts,seed", [(16, 64, 0), (48, 128, 1)])
def test_kept_share_and_skew_match_the_olmoe_traces(layers, experts, seed):
    real = [_stats(list(json.loads(p.read_text())["expert_trace"].values()), 64) for p in SEEDS]
    kept, top = (sum(r[i] for r in real) / len(real) for i in (0, 1))
    t = synth_trace(layers, experts, 8, 500, seed=seed)
    assert t.ids.shape == (layers, 500, 8) and t.ids.min() >= 0 and t.ids.max() < experts
    assert all(len(set(r)) == 8 for lay in t.ids.tolist() for r in lay)  # K distinct experts a row
    s_kept, s_top = _stats(t.ids.tolist(), experts)
    assert abs(s_kept - kept) < 0.02, (s_kept, kept)
    assert abs(s_top - top) < 0.04, (s_top, top)
    # without the fitted skew (uniform popularity) the share would be near a quarter: the fit is what matches
    u_kept, u_top = _stats(synth_trace(4, experts, 8, 500, seed=seed, top_quarter=0.26).ids.tolist(), experts)
    assert u_top < top - 0.2


def test_trace_synth_writes_a_new_trace_and_refuses_what_it_does_not_read(tmp_path, capsys):
    out = tmp_path / "s.npz"
    assert main(["trace", "synth", str(out), "--layers", "3", "--experts", "16", "--top-k", "4", "--tokens", "30"]) == 0
    assert "SYNTHETIC" in capsys.readouterr().out
    t = read_trace(out)
    assert t.ids.shape == (3, 30, 4) and t.num_experts == 16 and t.weights is None
    before = out.read_bytes()
    assert main(["trace", "synth", str(out), "--layers", "3", "--experts", "16", "--top-k", "4", "--tokens", "9"]) == 2
    assert "exists" in capsys.readouterr().err and out.read_bytes() == before
    assert main(["trace", "synth", str(tmp_path / "b.npz"), "--layers", "3", "--experts", "16", "--tokens", "9"]) == 2
    assert "--top-k" in capsys.readouterr().err and not (tmp_path / "b.npz").exists()
    for flag, value, words in (("--tokens", "10**30", "from 1 to 100000"), ("--experts", "10000000000", "from 1 to 4096"),
                               ("--experts", "3", "at least 4"), ("--layers", "100000000", "from 1 to 1024")):
        shape = {"--layers": "3", "--experts": "16", "--top-k": "2", "--tokens": "9", flag: str(eval(value))}
        assert main(["trace", "synth", str(tmp_path / "c.npz"), *[x for kv in shape.items() for x in kv]]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert main(["trace", "summarize", str(out), "--tokens", "9"]) == 2
    assert "--tokens: only `edge0 trace synth`" in capsys.readouterr().err
