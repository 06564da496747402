"""The checks of the commands' numeric flags and of text a user gave (the engine's and sampling's are
EngineConfig's and Sampling's): each refuses a bad value with one line naming the flag, before anything loads.
The flags themselves are defined in edge0/cli/."""

from __future__ import annotations

import math

from . import _float, _int
from ..errors import Edge0Error

SEED_MAX = 2**64 - 1  # MLX's and numpy's generators take an unsigned 64-bit seed


def not_utf8(text: str) -> int | None:
    """The byte offset of the first undecodable byte of text a user gave (an argument, a line of standard input, a file
    decoded with surrogateescape: Python keeps such bytes as lone surrogates; a JSON string's lone \\ud800 is one too;
    the tokenizer raises on them), or None where it is UTF-8 text."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return len(text[:e.start].encode("utf-8"))  # what comes before the first one is text


def whole(flag: str, value, lo: int, hi: int | None = None, hi_name: str = "") -> None:
    """An integer flag in [lo, hi] (hi None: no upper bound); None passes (the flag was not given)."""
    _int(flag, value, lo, hi, hi_name)


def positive(flag: str, value) -> None:
    """A float flag that must be a finite number above 0 (a learning rate, a temperature, a size)."""
    _float(flag, value, 0.0, math.inf, "", lo_open=True)


def non_negative(flag: str, value) -> None:
    """A float flag that must be a finite number of at least 0 (a budget in GiB)."""
    _float(flag, value, 0.0, math.inf, "", lo_open=False)


def fraction(flag: str, value) -> None:
    """A float flag in [0, 1] (a recall, a share)."""
    _float(flag, value, 0.0, 1.0, "", lo_open=False)


def check_seed(value, flag: str = "--seed") -> None:
    whole(flag, value, 0, SEED_MAX)


def routed_k(k: int | None, experts: int | None = None) -> None:
    """--k: at least 1, and at most the model's experts where they are known (a store's manifest)."""
    whole("--k", k, 1)
    if k is not None and experts is not None and k > experts:
        raise Edge0Error(f"--k {k}: must be between 1 and the model's {experts} experts")


def refuse_together(first: str, second: str, why: str) -> None:
    """Refuse two flags given together where one would be ignored: one line naming both."""
    raise Edge0Error(f"{first} and {second}: {why}")

