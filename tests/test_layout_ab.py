"""tools/layout_ab.py alternates the kernels' weight layouts in one process, with the same tokens."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from edge0.compute import kernels

spec = importlib.util.spec_from_file_location("layout_ab", Path(__file__).parents[1] / "tools" / "layout_ab.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.skipif(not kernels.available(), reason=f"edge0 CPU kernels {kernels.reason()}")
def test_layout_ab_prints_both_layouts_and_leaves_them_packed(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["layout_ab.py", "--rounds", "1", "--prompt-tokens", "24", "--max-tokens", "4"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    for what in ("prefill", "decode"):
        assert re.search(rf"{what}: packed [\d.]+ tok/s, row [\d.]+ tok/s, packed / row [\d.]+x", out), out
    assert kernels.load().packed_on()


@pytest.mark.skipif(not kernels.available(), reason=f"edge0 CPU kernels {kernels.reason()}")
def test_layout_ab_bank_copies_compares_staged_banks_with_and_without_their_copy(monkeypatch, capsys):
    from edge0.compute import runtime
    from edge0.compute.banks import Bank

    threshold, made, init = runtime.PACK_BANK_BYTES, set(), Bank.__init__

    def recorded(self, *a, pack_group_size=None, **kw):
        made.add(pack_group_size)  # decode banks: the group size with a copy, None without
        init(self, *a, pack_group_size=pack_group_size, **kw)

    monkeypatch.setattr(Bank, "__init__", recorded)
    monkeypatch.setattr(sys, "argv", ["layout_ab.py", "--rounds", "1", "--prompt-tokens", "24", "--max-tokens", "4",
                                      "--executor", "staged", "--bank-copies"])
    assert tool.main() == 0
    assert None in made and len(made) == 2  # one arm's banks kept a copy, the other's none
    out = capsys.readouterr().out
    assert re.search(r"decode: packed [\d.]+ tok/s, row [\d.]+ tok/s, packed / row [\d.]+x", out), out
    assert runtime.PACK_BANK_BYTES == threshold  # restored


def test_layout_ab_refuses_zero_rounds_and_bank_copies_without_banks(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["layout_ab.py", "--rounds", "0"])
    with pytest.raises(SystemExit):
        tool.main()
    monkeypatch.setattr(sys, "argv", ["layout_ab.py", "--bank-copies"])
    with pytest.raises(SystemExit):
        tool.main()
    assert "--bank-copies compares staged slot banks: give --executor staged" in capsys.readouterr().err
