"""tools/lab/prefetch_model.py plays a store's replay over its banks and a modelled disk: native reads on demand, perfect
guesses leave nothing to read on demand and beat it, same-token pre-gating reads most misses a layer early, and bad
input gets one line."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from edge0.model.demo import DEMO_STORE

from tests.pipeline.test_identity import real_text

pytestmark = pytest.mark.lab  # a finished study's tool: run with -m lab
LAB = Path(__file__).parents[2] / "tools" / "lab"
spec = importlib.util.spec_from_file_location("prefetch_model", LAB / "prefetch_model.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def rows(out: str) -> dict:
    """{(slots, policy): (step ms, x native, on demand, ahead)} of the printed table."""
    got = {}
    for line in out.splitlines():
        m = re.match(r"\| (\d+) \| ([^|]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", line)
        if m:
            got[(int(m[1]), m[2].strip())] = tuple(float(m[i]) for i in range(3, 7))
    return got


def test_the_model_reads_native_on_demand_and_perfect_guesses_ahead(tmp_path, monkeypatch, capsys):
    ids = real_text(80)
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"prompt": ids[:16], "tokens": ids[16:]}))
    monkeypatch.setattr(sys, "argv", ["prefetch_model.py", "--store", str(DEMO_STORE), "--replay", str(replay),
                                      "--slots", "8,32", "--recall", "1.0", "--confident", "0.05,1",
                                      "--pregate", "4"])
    assert tool.main() == 0
    got = rows(capsys.readouterr().out)
    native, perfect = got[(8, "native")], got[(8, "recall 1.00, lru")]
    assert native[1] == 1.0 and native[2] > 1 and native[3] == 0  # misses read on demand, nothing ahead
    assert perfect[2] < 0.1 * native[2] and perfect[3] > 0  # read ahead instead
    assert perfect[0] < native[0]  # and the step is shorter
    assert got[(8, "head top 4, score")][3] > 0
    some, none = got[(8, "head top 4, p >= 0.05, score")], got[(8, "head top 4, p >= 1, score")]
    assert 0 < some[3] < got[(8, "head top 4, score")][3]  # only the guesses the head is surer of are read
    assert none[3] == 0 and none[:3] == native[:3]  # no guess is that sure: native's reads and step
    assert got[(32, "native")][2] < native[2]  # a bank of every expert reads each once
    pregate = got[(8, "pregate 4")]  # the next layer's router at the same token: most misses read a layer early
    assert pregate[3] > 0 and pregate[2] < 0.6 * native[2]
    assert got[(8, "head top 4, score + pregate 4")][2] < got[(8, "head top 4, score")][2]


@pytest.mark.parametrize("replay", ["none.json", "short.json", "bad.json"])
def test_the_model_refuses_a_bad_replay_in_one_line(replay, tmp_path, monkeypatch, capsys):
    (tmp_path / "short.json").write_text('{"prompt": [1, 2], "tokens": [3]}')
    (tmp_path / "bad.json").write_text('{"prompt": "def f():"}')
    monkeypatch.setattr(sys, "argv", ["prefetch_model.py", "--store", str(DEMO_STORE), "--replay",
                                      str(tmp_path / replay)])
    assert tool.main() == 1
    err = capsys.readouterr().err
    assert err.startswith("prefetch_model: ") and replay in err and len(err.strip().splitlines()) == 1


def test_the_model_refuses_layers_without_a_head_and_bad_numbers(tmp_path, monkeypatch, capsys):
    ids = real_text(40)
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"prompt": ids[:16], "tokens": ids[16:]}))
    monkeypatch.setattr(sys, "argv", ["prefetch_model.py", "--store", str(DEMO_STORE), "--replay", str(replay),
                                      "--layers", "9"])
    assert tool.main() == 1
    assert "--layers: [9] consume no head" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["prefetch_model.py", "--store", str(DEMO_STORE), "--replay", str(replay),
                                      "--slots", "0"])
    with pytest.raises(SystemExit):
        tool.main()
    assert "--slots: '0': expected numbers above 0" in capsys.readouterr().err
