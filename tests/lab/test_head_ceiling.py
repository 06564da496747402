"""tools/lab/head_ceiling.py trains heads from other owners and features: untrained, the served owner's head is the
next-router predictor and the consumer's own is repeat (the project's recall figures on the same window), the next
token's embedding beats what a head knows a step ahead, and bad input gets one line."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from edge0.model.demo import DEMO_STORE
from edge0.model.heads import HeadSet
from edge0.model.load import load_store
from edge0.train.corpus import token_stream
from edge0.train.head_phase import _windows, recall, window_targets
from edge0.train.student import mlx_kernel

pytestmark = pytest.mark.lab  # a finished study's tool: run with -m lab
LAB = Path(__file__).parents[2] / "tools" / "lab"
spec = importlib.util.spec_from_file_location("head_ceiling", LAB / "head_ceiling.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def table(out: str) -> dict:
    """{(consumer, variant): (owner, untrained, trained)} of the printed table's rows."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    return {(int(c[0]), c[1]): (int(c[2]), float(c[3]), float(c[4])) for c in cells if c[0].isdigit()}


def test_untrained_heads_are_the_projects_predictors_and_the_next_token_lifts_the_ceiling(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["head_ceiling.py", "--store", str(DEMO_STORE), "--windows", "3", "--steps", "30",
                                      "--heldout-windows", "1", "--consumers", "3", "--variants",
                                      "previous,self,next-token"])
    assert tool.main() == 0
    got = table(capsys.readouterr().out)
    store = load_store(DEMO_STORE, dtype="float32", executor="staged")
    try:
        window = _windows(token_stream(Path(DEMO_STORE), None)[0], 256)[0]
        heads = HeadSet.create(store.manifest, store.config, top_k=4, consumers=[3])
        with mlx_kernel():
            data, blocks = window_targets(store.model, window, [e.layer for e in store.manifest.layers])
            want = recall(heads, data, blocks, store.manifest.num_experts)[3]
    finally:
        store.close()
    assert got[(3, "previous")][0] == 2 and got[(3, "self")][0] == 3
    assert np.isclose(got[(3, "previous")][1], want["next-router"], atol=6e-4)
    assert np.isclose(got[(3, "self")][1], want["repeat"], atol=6e-4)
    assert got[(3, "previous")][2] > got[(3, "previous")][1]  # trained
    assert got[(3, "next-token")][2] > got[(3, "previous")][2] + 0.03


def test_bad_input_gets_one_line(monkeypatch, capsys):
    for args, words in ((["--variants", "previous,oracle"], "--variants previous,oracle: choose from"),
                        (["--consumers", "9"], "--consumers: [9] are not MoE layers"),
                        (["--consumers", "two"], "--consumers two: expected comma-separated layer numbers"),
                        (["--k", "0"], "--k 0: between 1 and the model's 32 experts")):
        monkeypatch.setattr(sys, "argv", ["head_ceiling.py", "--store", str(DEMO_STORE), *args])
        assert tool.main() == 1
        err = capsys.readouterr().err
        assert err.startswith("head_ceiling: ") and words in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(sys, "argv", ["head_ceiling.py", "--store", "/nonexistent/store"])
    assert tool.main() == 1
    assert capsys.readouterr().err.startswith("head_ceiling: ")
