"""The affinity predictor (pipeline/affinity.py) and `edge0 train affinity`: the table counts what a hand count says,
names more of a held-out trace's experts than the previous token does, reads ahead under --routing prefetch on the
demo store without changing a token, and bad tables are refused by name."""

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from edge0.cli import main
from edge0.config import EngineConfig, IOConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.io.routetrace import RouteTrace, read_trace, write_trace
from edge0.model.traced import TracedRouting

from tests.helpers import OLMOE_TRACES

LAYERS, EXPERTS, K = 6, 32, 4  # the demo store's
TOKENS = 200  # rows of each OLMoE trace the held-out test uses
PROMPT = [317, 288, 1350, 269, 1245, 488, 10, 80, 302, 275, 306, 299]  # the demo prompt's ids


def _lines(path: Path, rows: dict) -> None:
    """A JSON-lines trace ({layer, token, experts}), one of the public layouts."""
    path.write_text("".join(json.dumps({"layer": l, "token": t, "experts": e}) + "\n"
                            for l, per in rows.items() for t, e in enumerate(per)))


def test_the_learned_table_is_the_hand_count(tmp_path, capsys):
    """3 layers, 5 experts, K 2, 3 tokens: counts[l][i][j] = tokens at which layer l routed i and l+1 routed j."""
    rows = {0: [[0, 1], [0, 2], [1, 0]], 1: [[3, 4], [3, 0], [4, 3]], 2: [[1, 2], [2, 4], [1, 2]]}
    _lines(tmp_path / "t.jsonl", rows)
    out = tmp_path / "a.npz"
    assert main(["train", "affinity", "--traces", str(tmp_path / "t.jsonl"), "--out", str(out)]) == 0
    z = np.load(out)
    want = np.zeros((2, 5, 5), int)
    # layer 0 -> 1: t0 {0,1}x{3,4}; t1 {0,2}x{3,0}; t2 {1,0}x{4,3}
    for i, j in [(0, 3), (0, 4), (1, 3), (1, 4), (0, 3), (0, 0), (2, 3), (2, 0), (1, 4), (1, 3), (0, 4), (0, 3)]:
        want[0, i, j] += 1
    # layer 1 -> 2: t0 {3,4}x{1,2}; t1 {3,0}x{2,4}; t2 {4,3}x{1,2}
    for i, j in [(3, 1), (3, 2), (4, 1), (4, 2), (3, 2), (3, 4), (0, 2), (0, 4), (4, 1), (4, 2), (3, 1), (3, 2)]:
        want[1, i, j] += 1
    assert (z["counts"] == want).all()
    assert (z["freq"] == [[3, 2, 1, 0, 0], [1, 0, 0, 3, 2], [0, 2, 3, 0, 1]]).all()


def test_on_a_held_out_trace_the_table_names_more_than_the_previous_token(tmp_path, capsys):
    """Learned from OLMoE seeds 1 and 2, on seed 3: the table's 2K likeliest experts of layer l+1 (from layer l's at the
    same token) hold more of the routed K than the layer's own K at the token before; both recalls recomputed here
    with plain counting (P(j | i) summed over layer l's ids)."""
    out, seeds = tmp_path / "a.npz", []
    for s in (1, 2, 3):  # their first TOKENS rows: the count below takes a second
        t = read_trace(OLMOE_TRACES / f"olmoe-1b-7b-seed{s}.json")
        seeds.append(str(tmp_path / f"s{s}.npz"))
        write_trace(seeds[-1], RouteTrace(t.ids[:, :TOKENS], None, t.layers, t.num_experts))
    assert main(["train", "affinity", "--traces", *seeds[:2], "--heldout", seeds[2], "--out", str(out), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)["recall"]["16"]
    pair, single = Counter(), Counter()
    for path in seeds[:2]:
        ids = read_trace(path).ids
        for l in range(ids.shape[0] - 1):
            for t in range(ids.shape[1]):
                single.update((l, i) for i in ids[l, t].tolist())
                pair.update((l, i, j) for i in ids[l, t].tolist() for j in ids[l + 1, t].tolist())
    ids = read_trace(seeds[2]).ids
    hit_a = hit_p = n_a = n_p = 0
    for l in range(ids.shape[0] - 1):
        for t in range(ids.shape[1]):
            score = {j: sum(pair[l, i, j] / max(1, single[l, i]) for i in ids[l, t].tolist()) for j in range(64)}
            top = sorted(score, key=lambda j: -score[j])[:16]
            want = set(ids[l + 1, t].tolist())
            hit_a += len(want.intersection(top))
            n_a += 8
            if t:
                hit_p += len(want.intersection(ids[l + 1, t - 1].tolist()))
                n_p += 8
    assert said["affinity"] == pytest.approx(hit_a / n_a, abs=0.01)  # (ties broken otherwise: by popularity)
    assert said["previous"] == pytest.approx(hit_p / n_p)
    assert said["affinity"] > said["previous"] + 0.1


def _chained(tokens: int, seed: int) -> RouteTrace:
    """A demo-shaped trace whose layer l+1 routes (ids of layer l + 1) mod E: a table learned from one such trace
    names every expert of another."""
    rng = np.random.default_rng(seed)
    first = np.stack([rng.permutation(EXPERTS)[:K] for _ in range(tokens)])
    ids = np.stack([(first + l) % EXPERTS for l in range(LAYERS)]).astype(np.int32)
    return RouteTrace(ids, None, list(range(LAYERS)), num_experts=EXPERTS)


def test_prefetch_affinity_reads_the_next_layer_ahead_and_keeps_the_tokens(tmp_path):
    """On the demo store forced from a chained trace, the layers after the first find nearly all their experts planned
    by the layer before (a plan that finds no free slot is dropped), read ahead, and the tokens are native routing's."""
    write_trace(tmp_path / "learn.json", _chained(60, 0))
    assert main(["train", "affinity", "--traces", str(tmp_path / "learn.json"), "--out", str(tmp_path / "a.npz")]) == 0
    run = _chained(30, 1)
    got = {}
    for mode, more in (("native", {}), ("prefetch", {"predictor": "affinity", "affinity": str(tmp_path / "a.npz"),
                                                     "read_ahead": "always"})):
        c = EngineConfig(routing=RoutingConfig(mode=mode, **more), io=IOConfig(executor="staged", slots=16))
        with open_engine(c) as engine:
            TracedRouting(engine.store.model, trace=run, record=False, what="--routes t")
            engine.prompt_cache = None
            tokens = engine.generate(engine.request(PROMPT, max_tokens=8, ignore_eos=True)).tokens
            got[mode] = tokens, getattr(engine.store.runtime, "sched", None)
    assert got["prefetch"][0] == got["native"][0]
    stats = got["prefetch"][1].stats
    assert stats.recall > 0.9 and stats.loads > stats.demand_loads


def test_bad_tables_and_traces_are_refused_by_name(tmp_path, capsys):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04 not a zip")
    assert main(["train", "affinity", "--traces", str(junk), "--out", str(tmp_path / "a.npz")]) == 2
    err = capsys.readouterr().err
    assert f"--traces {junk}: not a routing trace" in err and "Traceback" not in err
    small = tmp_path / "small.json"
    write_trace(small, RouteTrace(np.zeros((3, 4, K), np.int32) + np.arange(K, dtype=np.int32), None, [0, 1, 2], 8))
    assert main(["train", "affinity", "--traces", str(small), "--out", str(tmp_path / "s.npz")]) == 0
    cases = {str(junk): f"--affinity {junk}: not an affinity table",
             str(tmp_path / "s.npz"): "learned for 3 MoE layers x 8 experts; the store has 6 x 32",
             str(tmp_path / "none.npz"): f"--affinity {tmp_path / 'none.npz'}: no such file",
             os.devnull: f"--affinity {os.devnull}: not a regular file"}
    for table, said in cases.items():
        assert main(["run", "--routing", "prefetch", "--predictor", "affinity", "--affinity", table,
                     "--executor", "staged", "--max-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert main(["run", "--routing", "prefetch", "--predictor", "affinity", "--executor", "staged"]) == 2
    assert "--predictor affinity reads a co-activation table: give it --affinity FILE" in capsys.readouterr().err


def test_a_held_out_trace_of_one_token_is_refused_before_anything_is_written(tmp_path, capsys):
    """The previous token's recall needs a token before: one token was a ZeroDivisionError after the table was
    written."""
    ids = np.zeros((3, 5, 2), np.int32) + np.arange(2, dtype=np.int32)
    write_trace(tmp_path / "t.json", RouteTrace(ids, None, [0, 1, 2], 8))
    write_trace(tmp_path / "one.json", RouteTrace(ids[:, :1], None, [0, 1, 2], 8))
    out = tmp_path / "a.npz"
    assert main(["train", "affinity", "--traces", str(tmp_path / "t.json"), "--heldout", str(tmp_path / "one.json"),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--heldout {tmp_path / 'one.json'}: 1 token" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
