"""The lab shelf: finished studies live in tools/lab/, each naming the lab log that holds its figures, and their
tests (tests/lab/) are out of the default run but run with -m lab."""

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.lab.conftest import selects_lab

ROOT = Path(__file__).parents[1]


def test_every_study_names_the_lab_log_of_its_figures():
    studies = sorted((ROOT / "tools" / "lab").glob("*.py"))
    assert studies
    for study in studies:
        logs = re.findall(r"docs/lab/[\w-]+\.md", study.read_text())
        assert logs and all((ROOT / log).is_file() for log in logs), study.name


def test_every_lab_test_is_marked_lab():
    for test in (ROOT / "tests" / "lab").glob("test_*.py"):
        assert "\npytestmark = pytest.mark.lab" in test.read_text(), test.name


@pytest.mark.parametrize("expr, selected", [("", True), ("not lab", False), ("lab", True), ("lab or slow", True),
                                            ("not lab and slow", False), ("slow", False)])
def test_a_mark_expression_selects_the_shelf_only_where_it_can_match_lab(expr, selected):
    assert selects_lab(expr) is selected


def test_the_default_run_leaves_the_shelf_out():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    addopts = shlex.split(ini["addopts"])
    assert "-m" in addopts and not selects_lab(addopts[addopts.index("-m") + 1])


def test_minus_m_lab_collects_every_lab_test_file():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--collect-only",
                          "-m", "lab", "tests/lab"], cwd=ROOT, capture_output=True, text=True).stdout
    files = {f"tests/lab/{t.name}" for t in (ROOT / "tests" / "lab").glob("test_*.py")}
    assert files and {line.split("::")[0] for line in out.splitlines() if line.startswith("tests/lab/")} == files


# CSRC's A/B scripts of the C++ switches, reworked with them; every other script takes its medians from the harness
OWN_MEDIANS = {"batch_step.py"}


def test_the_scripts_in_use_take_their_rounds_and_medians_from_the_harness():
    own = {p.name for p in (ROOT / "tools").glob("*.py") if re.search(r"^\s*import statistics", p.read_text(), re.M)}
    assert own <= OWN_MEDIANS, own - OWN_MEDIANS
