"""tools/batch_step.py --ahead alternates a batch decoding ahead and one step at a time, in one process."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from edge0.decode.batch import BatchDecoder

spec = importlib.util.spec_from_file_location("batch_step", Path(__file__).parents[1] / "tools" / "batch_step.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def test_batch_step_ahead_times_both_ways_of_a_streamed_batch(monkeypatch, capsys):
    modes = []
    step = BatchDecoder.step

    def recorded(self):
        modes.append(self.ahead is not None)  # decoding ahead: the step before built this one
        return step(self)

    monkeypatch.setattr(BatchDecoder, "step", recorded)
    monkeypatch.setattr(sys, "argv", ["batch_step.py", "--batch", "2", "--steps", "3", "--rounds", "2",
                                      "--prompt-tokens", "16", "--ahead", "on,off", "--routing", "predicted",
                                      "--executor", "staged", "--slots", "28"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    assert re.search(r"on [\d.]+ ms, off [\d.]+ ms a step \(off / on: [\d.]+x of the medians, [\d.]+x paired\)",
                     out), out
    timed = modes[1:]  # after the step before the graph is counted: on (3 steps), off (3), then off, on
    on, off = [False, True, True], [False] * 3
    assert timed == on + off + off + on, modes


def test_batch_step_ahead_takes_on_and_off(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["batch_step.py", "--ahead", "on,yes"])
    with pytest.raises(SystemExit, match="--ahead on,yes: expected on,off"):
        tool.main()
