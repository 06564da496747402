"""Routing trace files (io/routetrace.py): the layouts read, Edge0's written back bit for bit, and every file
that is not a trace, or does not fit a run, refused by name."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from edge0.errors import Edge0Error
from edge0.io.routetrace import check_fits, read_trace, write_trace

from tests.helpers import OLMOE_TRACES

OLMOE_SEED1 = OLMOE_TRACES / "olmoe-1b-7b-seed1.json"


def _ids(layers=3, tokens=5, k=2, experts=8, seed=0) -> np.ndarray:
    """(L, T, K) distinct ids a row."""
    rng = np.random.default_rng(seed)
    return np.stack([[rng.permutation(experts)[:k] for _ in range(tokens)] for _ in range(layers)]).astype(np.int32)


def test_the_public_expert_trace_layout_reads_and_drops_its_padding_row_saying_so_once(tmp_path, capsys):
    """The real OLMoE traces' layout (tests/data/olmoe): {"num_layers", "num_experts", "top_k", "expert_trace":
    {"<layer>": rows}} with a last row of -1 (here 12 layers, so a layer sorted as text, "10" before "2", would be out of order)."""
    ids = _ids(layers=12, tokens=4, k=3, experts=16)
    doc = {"model": "x", "num_layers": 12, "num_experts": 16, "top_k": 3, "generated_ids": [1, 2, 3, 4],
           "expert_trace": {str(n): ids[n].tolist() + [[-1, -1, -1]] for n in range(12)}}
    path = tmp_path / "seed1.json"
    path.write_text(json.dumps(doc))
    t = read_trace(path)
    assert t.ids.shape == (12, 4, 3) and (t.ids == ids).all() and t.layers == list(range(12))
    assert t.weights is None and t.num_experts == 16 and t.prompt_tokens is None
    err = capsys.readouterr().err
    assert err.count("padding") == 1 and "1 trailing padding row" in err and str(path) in err


def test_json_lines_read_in_any_order_with_their_weights(tmp_path):
    ids = _ids(layers=2, tokens=3, k=2)
    w = np.random.default_rng(1).random(ids.shape).astype(np.float32)
    lines = [json.dumps({"layer": la * 4, "token": t, "experts": ids[la, t].tolist(), "weights": w[la, t].tolist()})
             for t in range(3) for la in range(2)]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(reversed(lines)) + "\n")
    t = read_trace(path)
    assert t.layers == [0, 4] and (t.ids == ids).all() and (t.weights == w).all()


@pytest.mark.parametrize("name", ["r.json", "r.npz"])
def test_edge0_traces_write_and_read_back_bit_for_bit(tmp_path, name):
    from edge0.io.routetrace import RouteTrace

    ids = _ids(layers=4, tokens=6, k=3, experts=300)  # ids above 255 in the NPZ too
    w = np.random.default_rng(2).standard_normal(ids.shape).astype(np.float32)
    t = RouteTrace(ids, w, [1, 2, 3, 5], num_experts=300, prompt_tokens=4, tokens=[9, 8, 7, 6, 5, 4])
    write_trace(tmp_path / name, t)
    u = read_trace(tmp_path / name)
    assert (u.ids == ids).all() and u.weights.tobytes() == w.tobytes()
    assert (u.layers, u.num_experts, u.prompt_tokens, u.tokens) == ([1, 2, 3, 5], 300, 4, [9, 8, 7, 6, 5, 4])
    assert [p.name for p in tmp_path.iterdir()] == [name]  # written atomically: no temporary left


def _write(path: Path, what) -> Path:
    if isinstance(what, bytes):
        path.write_bytes(what)
    elif isinstance(what, str):
        path.write_text(what)
    else:
        path.write_text(json.dumps(what))
    return path


def _trace(**over):
    return {"num_experts": 8, "top_k": 2, "expert_trace": {"0": [[1, 2], [3, 4]], "1": [[0, 5], [6, 7]]}, **over}


BAD = {
    "not JSON": ("x.json", "{not json\n", "line 1 is not JSON"),
    "no expert_trace": ("x.json", {"tokens": [1, 2]}, "without an expert_trace"),
    "binary": ("x.json", b"\xff\xfe\x00garbage", "not UTF-8"),
    "empty": ("x.json", "", "no routing"),
    "ragged rows": ("x.json", _trace(expert_trace={"0": [[1, 2], [3]], "1": [[0, 5], [6, 7]]}), "rows of 1 and of 2"),
    "layers of other lengths": ("x.json", _trace(expert_trace={"0": [[1, 2]], "1": [[0, 5], [6, 7]]}),
                                "layer 0 has 1 tokens of 2, layer 1 2 of 2"),
    "not ids": ("x.json", _trace(expert_trace={"0": [[1, "a"], [3, 4]], "1": [[0, 5], [6, 7]]}), "not an expert id"),
    "bad layer name": ("x.json", _trace(expert_trace={"x": [[1, 2]]}), "layer 'x' is not a number"),
    "padding inside": ("x.json", _trace(expert_trace={"0": [[-1, 2], [3, 4]], "1": [[0, 5], [6, 7]]}),
                       "layer 0 token 0 has a negative id before the trailing padding"),
    "only padding": ("x.json", _trace(expert_trace={"0": [[-1, -1]], "1": [[-1, -1]]}), "no token routed"),
    "an expert twice": ("x.json", _trace(expert_trace={"0": [[1, 2], [4, 4]], "1": [[0, 5], [6, 7]]}),
                        "layer 0 token 1 names an expert twice"),
    "id past its experts": ("x.json", _trace(num_experts=6), "an id of 7 with num_experts 6"),
    "top_k not its rows": ("x.json", _trace(top_k=3), "top_k 3 but rows of 2"),
    "weights of another shape": ("x.json", _trace(weights={"0": [[0.5, 0.5]], "1": [[0.5, 0.5]]}),
                                 "weights of shape (2, 1, 2), not the ids' (2, 2, 2)"),
    "another format": ("x.json", _trace(format="other"), "format 'other'"),
    "lines without experts": ("x.jsonl", '{"layer": 0, "token": 0, "ids": [1]}\n', "line 1 is not an object"),
    "lines missing a token": ("x.jsonl", '{"layer": 0, "token": 1, "experts": [1, 2]}\n', "layer 0 lacks token 0"),
    "torn NPZ": ("x.npz", b"PK\x03\x04torn", "unreadable NPZ"),
    "an id past int32": ("x.json", _trace(num_experts=None, expert_trace={"0": [[2**32 + 1, 2], [3, 4]],
                                                                           "1": [[0, 5], [6, 7]]}), "not an expert id"),
    "an id past int64": ("x.json", _trace(expert_trace={"0": [[10**30, 2], [3, 4]], "1": [[0, 5], [6, 7]]}),
                         "not an expert id"),
    "a weight past float": ("x.json", _trace(weights={"0": [[10**400, 0.5], [0.5, 0.5]], "1": [[0.5, 0.5]] * 2}),
                            "not a finite number"),
    "nested too deep": ("x.json", "[" * 100000 + "]" * 100000, "JSON nested too deep"),
    "lines of a far token": ("x.jsonl", '{"layer": 0, "token": 100000000000, "experts": [1]}\n',
                             "layer 0 lacks token 0"),
}


def _npz(path: Path, **arrays) -> bytes:
    meta = json.dumps({"format": "edge0-routes", "version": 1})
    np.savez_compressed(path, meta=np.array(meta), **arrays)
    return path.read_bytes()


@pytest.mark.parametrize("arrays, words", [
    (dict(ids=np.full((1, 2, 2), 2**40, np.int64), layers=np.array([0])), "an id of 1099511627776, too large"),
    (dict(ids=np.ones((1, 2, 2), np.int64), layers=np.array(["a"])), "expected (L, T, K) integers"),
    (dict(ids=np.ones((1, 2, 2), np.int64), layers=np.array([-1])), "expected (L, T, K) integers"),
    (dict(ids=np.ones((1, 2, 2), np.int64), layers=np.array([0]), tokens=np.zeros((2, 2), np.int64)),
     "tokens of shape (2, 2)")])
def test_an_npz_of_the_wrong_kinds_is_refused_by_name(tmp_path, arrays, words):
    path = tmp_path / "x.npz"
    _npz(path, **arrays)
    with pytest.raises(Edge0Error, match=re.escape(f"{path}: not a routing trace (")) as e:
        read_trace(path)
    assert words in str(e.value), str(e.value)


def test_a_corrupt_compressed_npz_and_a_device_are_refused_by_name(tmp_path):
    path = tmp_path / "x.npz"
    data = bytearray(_npz(path, ids=np.arange(4000, dtype=np.int64).reshape(10, 100, 4) % 64, layers=np.arange(10)))
    at = data.index(b"ids.npy") + 200  # inside its deflated bytes
    data[at:at + 30] = bytes(b ^ 0x5A for b in data[at:at + 30])
    path.write_bytes(bytes(data))
    with pytest.raises(Edge0Error, match="unreadable NPZ"):
        read_trace(path)
    with pytest.raises(Edge0Error, match="/dev/zero: not a regular file"):
        read_trace("/dev/zero")


@pytest.mark.parametrize("case", BAD)
def test_a_file_that_is_not_a_trace_is_refused_by_name(tmp_path, case):
    name, content, words = BAD[case]
    path = _write(tmp_path / name, content)
    with pytest.raises(Edge0Error, match=re.escape(f"{path}: not a routing trace (")) as e:
        read_trace(path)
    assert words in str(e.value), str(e.value)


def test_an_npz_without_the_arrays_of_a_trace_is_refused(tmp_path):
    np.savez(tmp_path / "x.npz", ids=np.zeros((1, 2, 2), np.int32))
    with pytest.raises(Edge0Error, match="not a routing trace .*without ids, layers and meta"):
        read_trace(tmp_path / "x.npz")
    with pytest.raises(Edge0Error, match=re.escape(f"--routes {tmp_path}: a directory, not a file")):
        read_trace(tmp_path, what=f"--routes {tmp_path}")


@pytest.mark.parametrize("shape, words", [
    (dict(layers=4), "the trace routes 3 MoE layers, the model has 4"),
    (dict(experts=16), "the trace's model has 8 experts a layer, this one 16"),
    (dict(top_k=4), "the trace routes 2 experts a token, this run 4 (--k)"),
    (dict(tokens=6), "the trace holds 5 tokens, shorter than the run's 6"),
])
def test_a_trace_of_another_shape_than_the_run_is_refused_by_name(shape, words):
    from edge0.io.routetrace import RouteTrace

    t = RouteTrace(_ids(), None, [0, 1, 2], num_experts=8)
    run = {"layers": 3, "experts": 8, "top_k": 2, "tokens": 5}
    check_fits(t, "--routes t.json", **run)  # the run's own shape fits
    with pytest.raises(Edge0Error, match=re.escape(f"--routes t.json: {words}")):
        check_fits(t, "--routes t.json", **{**run, **shape})
    t.num_experts = None  # a file that does not say its experts: its ids must still be the model's
    with pytest.raises(Edge0Error, match="the trace routes to expert 7, the model has 6 experts"):
        check_fits(t, "--routes t.json", **{**run, "experts": 6})


def test_the_real_olmoe_trace_reads():
    t = read_trace(OLMOE_SEED1)
    assert t.ids.shape == (16, 499, 8) and t.num_experts == 64 and t.ids.max() < 64
