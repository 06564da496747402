"""tools/lab/node_cost.py runs against the extension as it is and prints each of its figures."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from edge0.compute import kernels

pytestmark = pytest.mark.lab  # a finished study's tool: run with -m lab
LAB = Path(__file__).parents[2] / "tools" / "lab"
spec = importlib.util.spec_from_file_location("node_cost", LAB / "node_cost.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.skipif(not kernels.available(), reason=f"edge0 CPU kernels {kernels.reason()}")
def test_node_cost_prints_every_figure(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["node_cost.py", "--rounds", "1"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"chain of \d+ nodes: [\d.]+ us a node", out)) == 3
    assert len(re.findall(r"head, (float32|bfloat16) weights, (hot|from L3): [\d.]+ us a node", out)) == 4
    assert len(re.findall(r"plain [\d.]+ us a node, with a rank-16 adapter [\d.]+", out)) == 2
    assert len(re.findall(r"sync, one node's value to the host: (mx.eval|host_eval) [\d.]+ us", out)) == 2
    assert "product " not in out  # the layouts only with --packed


@pytest.mark.skipif(not kernels.available() or kernels.load().impl() != "avx512",
                    reason="the packed layout is the AVX-512 VNNI path's")
def test_node_cost_compares_the_layouts(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["node_cost.py", "--rounds", "1", "--packed"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    found = re.findall(r"product (\d+)x(\d+), (1 row|8 rows): row layout [\d.]+ us, packed [\d.]+ us \([\d.]+x\)", out)
    assert len(found) == 10  # 2048 x 2048 is not packed
    assert "product 2048x2048: no packed layout here" in out


def test_node_cost_refuses_zero_rounds(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["node_cost.py", "--rounds", "0"])
    with pytest.raises(SystemExit):
        tool.main()
    assert "--rounds 0: must be at least 1" in capsys.readouterr().err
