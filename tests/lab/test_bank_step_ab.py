"""tools/lab/bank_step_ab.py pairs the one-node bank step against the step built call by call in one process, with the
same tokens, and leaves the one-node step in place."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from edge0.compute import kernels
from edge0.pipeline.prefetch import PrefetchExperts

pytestmark = pytest.mark.lab  # a finished study's tool: run with -m lab
LAB = Path(__file__).parents[2] / "tools" / "lab"
spec = importlib.util.spec_from_file_location("bank_step_ab", LAB / "bank_step_ab.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.skipif(not kernels.available(), reason=f"edge0 CPU kernels {kernels.reason()}")
def test_bank_step_ab_prints_both_arms_and_restores_the_one_node_step(monkeypatch, capsys):
    one_node = PrefetchExperts.bank_step
    monkeypatch.setattr(sys, "argv", ["bank_step_ab.py", "--rounds", "2", "--prompt-tokens", "24", "--max-tokens", "6"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    assert re.search(r"decode: one node [\d.]+ tok/s, call by call [\d.]+ tok/s, one node / call by call [\d.]+x "
                     r"\(paired, 2 rounds, 6 tokens, --io pread\)", out), out
    assert PrefetchExperts.bank_step is one_node


def test_bank_step_ab_refuses_a_bad_replay_file_and_zero_rounds(tmp_path, monkeypatch):
    bad = tmp_path / "replay.json"
    bad.write_text('{"prompt": [1, 2]}')
    monkeypatch.setattr(sys, "argv", ["bank_step_ab.py", "--replay", str(bad)])
    with pytest.raises(SystemExit, match=f"--replay {bad}: not a replay file"):
        tool.main()
    monkeypatch.setattr(sys, "argv", ["bank_step_ab.py", "--rounds", "0"])
    with pytest.raises(SystemExit):
        tool.main()
