"""The defaults the documents give for the command's flags are the ones the parser has (README said `--io-workers`
defaulted to 2 while the code and --help said 8)."""

import argparse
import re
from pathlib import Path

from edge0.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
# `--flag` or `--flag METAVAR`, then within a few words "default N" (not "default 0.92x", nor another flag's)
SAID = re.compile(r"`(--[a-z0-9-]+)(?: [A-Z]+)?`[^`\n]{0,40}?\bdefault:? (-?\d+(?:\.\d+)?)(?![\d.]*[%x])\b")


def _defaults() -> dict[str, set]:
    """Every option of every subcommand -> its numeric defaults (a flag can be several commands')."""
    out: dict[str, set] = {}

    def walk(parser):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    walk(sub)
            elif isinstance(a.default, (int, float)) and not isinstance(a.default, bool):
                for o in a.option_strings:
                    out.setdefault(o, set()).add(float(a.default))

    walk(build_parser())
    return out


def test_documented_defaults_are_the_parsers():
    defaults, checked, wrong = _defaults(), [], []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in SAID.finditer(doc.read_text()):
            flag, said = m.group(1), float(m.group(2))
            if flag not in defaults:  # a tool's flag, or one whose default is worked out at run time
                continue
            checked.append(flag)
            if said not in defaults[flag]:
                wrong.append(f"{doc.name}: {m.group(0)!r} but the parser's default is {sorted(defaults[flag])}")
    assert checked and wrong == []
