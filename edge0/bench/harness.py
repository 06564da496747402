"""Rounds of measured arms, for `edge0 bench` and the A/B scripts in tools/.

    rows = run_rounds(["before", "after"], 5, lambda arm, r: {"decode_tok_s": measure(arm)}, warmup=1)
    by = group(rows)                                # {"before": [row, ...], "after": [...]}
    medians(by, ["decode_tok_s"])                   # {"before": {"decode_tok_s": m}, ...}
    paired(by, "decode_tok_s", baseline="before")   # {"after": Paired(median=..., low=..., high=..., ...)}

A round runs every arm once, in an order rotated round by round (each arm takes each place in turn), so a host whose
speed drifts moves every arm alike. The paired ratio divides an arm's figure by the baseline arm's in the same round,
then takes the median over rounds: drift between rounds cancels, which a ratio of the two medians can lose.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from ..io.atomic import write_atomic

T = TypeVar("T")


def rotation(arms: Sequence[T], round_: int) -> list[T]:
    """Round `round_`'s order: the arms rotated left by the round's number."""
    k = round_ % len(arms) if arms else 0
    return list(arms[k:]) + list(arms[:k])


def schedule(arms: Sequence[T], rounds: int, within: Sequence = (None,)) -> Iterator[tuple[int, object, T]]:
    """(round, condition, arm) in run order: each round runs every condition (`within`, e.g. cache states) in turn,
    and under each every arm, in the round's rotation."""
    for r in range(rounds):
        order = rotation(arms, r)
        for condition in within:
            for arm in order:
                yield r, condition, arm


def run_rounds(arms: Sequence[str], rounds: int, measure: Callable[[str, int], dict], *, warmup: int = 0,
               on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Rows {"arm", "round", **measure(arm, round)} in run order. `warmup` runs of every arm come first (round -1,
    not returned nor passed to on_row): caches, JIT and page cache settle. on_row sees each row as it is made."""
    for _ in range(warmup):
        for arm in arms:
            measure(arm, -1)
    rows = []
    for r, _, arm in schedule(arms, rounds):
        row = {"arm": arm, "round": r, **measure(arm, r)}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def group(rows: Sequence[dict], key: str = "arm") -> dict[str, list[dict]]:
    """Rows by their `key`, arms in the order first seen."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row[key], []).append(row)
    return out


def median(rows: Sequence[dict], figure: str, missing: float | None = None) -> float | None:
    """The median of `figure` over rows; a row without it (or None) counts as `missing`, or is left out where
    missing is None (None when no row has it)."""
    values = [row.get(figure) for row in rows]
    values = [missing if v is None else v for v in values]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def medians(by_arm: dict[str, Sequence[dict]], figures: Sequence[str], missing: float | None = None) -> dict:
    """{arm: {figure: median}} (see median for rows without a figure)."""
    return {arm: {f: median(rows, f, missing) for f in figures} for arm, rows in by_arm.items()}


@dataclass(frozen=True)
class Paired:
    """An arm's figure over the baseline's in the same round, across rounds."""
    median: float  # the median of the per-round ratios (nan with no round in common)
    low: float  # the smallest ratio of a round
    high: float  # the largest
    faster: int  # rounds with a ratio above 1
    rounds: int  # rounds paired (both arms have the figure, the baseline's is not 0)


def ratios(rows: Sequence[dict], base: Sequence[dict], figure: str) -> list[float]:
    """Per-round ratios of rows' `figure` to the base rows' in the same round (rounds missing on either side, or
    the base's 0, left out), in the rows' order."""
    by_round = {b["round"]: b.get(figure) for b in base}
    return [row[figure] / by_round[row["round"]] for row in rows
            if row.get(figure) is not None and by_round.get(row["round"])]


def paired(by_arm: dict[str, Sequence[dict]], figure: str, baseline: str) -> dict[str, Paired]:
    """Every arm (the baseline too: 1.0) against `baseline`, round by round."""
    out = {}
    for arm, rows in by_arm.items():
        rs = ratios(rows, by_arm.get(baseline, ()), figure)
        nan = float("nan")
        out[arm] = Paired(statistics.median(rs) if rs else nan, min(rs, default=nan), max(rs, default=nan),
                          sum(r > 1 for r in rs), len(rs))
    return out


def write_rows(path: str | Path, rows: Sequence[dict], append: bool = False) -> None:
    """Rows as JSON lines; replaced atomically, or appended (a log that grows run by run)."""
    text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
    if append:
        with open(path, "a") as f:
            f.write(text)
        return
    write_atomic(Path(path), text.encode())
