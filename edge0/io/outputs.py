"""Where a command may write: never into what it reads, and over an existing output only of its own kind.

    refuse_inputs(out, {"STORE": store})           # OUT is no input, lies in none and (when replaced) holds none
    check_dir_out(out, force, STORE_KIND)          # a non-empty OUT: an earlier store only, and only with --force
    check_file_out(out, force, GGUF_KIND)          # an existing OUT: an earlier GGUF only, and only with --force

Paths are compared resolved (symlinks followed), so no link leads a write into an input. An output's kind is
told by what its writer always leaves in it: a marker file in a directory, the first bytes of a file.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import Edge0Error
from .manifest import MANIFEST


@dataclass(frozen=True)
class Kind:
    """What an output is, and how an earlier one is recognised."""

    name: str  # "an Edge0 store", said in refusals
    sign: str  # a directory's marker file, or what a file's check looks for (said in refusals)
    test: Callable[[Path], bool] | None = None  # a file's check; None for a directory (its marker file)


def starts_with(*magic: bytes) -> Callable[[Path], bool]:
    def test(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                head = f.read(max(map(len, magic)))
        except OSError:
            return False
        return head.startswith(magic)

    return test


def safetensors_format(path: Path) -> str | None:
    """The `format` of a safetensors file's metadata (edge0-heads-1, edge0-lora-1, mlx), None if unreadable."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 1 << 24)))
        return header.get("__metadata__", {}).get("format")
    except (OSError, ValueError, struct.error, AttributeError):
        return None


STORE_KIND = Kind("an Edge0 store", MANIFEST)
MADE_MODEL_KIND = Kind("a make-model checkpoint", "edge0-make-model.json")
GGUF_KIND = Kind("a GGUF file", "GGUF magic", starts_with(b"GGUF"))


def refuse_inputs(out: str | os.PathLike, inputs: dict, what: str = "OUT", *, replaces: bool = True) -> None:
    """`out` must not be an input, nor lie inside an input directory; nor hold an input when `replaces` (a
    directory written whole and swapped in). inputs: {flag: path or None}."""
    o = Path(out).resolve()
    for label, given in inputs.items():
        if given is None:
            continue
        i = Path(given).resolve()
        if o == i:
            raise Edge0Error(f"{out}: {what} must differ from {label} {given}; nothing a command reads is written")
        if o.is_relative_to(i):
            raise Edge0Error(f"{out}: {what} is inside {label} {given}; write outside it")
        if replaces and i.is_relative_to(o):
            raise Edge0Error(f"{out}: {label} {given} is inside {what}; choose another {what}")


def check_dir_out(out: str | os.PathLike, force: bool, kind: Kind, what: str = "OUT") -> None:
    """A directory output may be absent or empty; a non-empty one is replaced only with --force and only when
    it is an earlier output of the same kind (it holds the kind's marker)."""
    out = Path(out)
    if not os.path.lexists(out) or (out.is_dir() and not any(out.iterdir())):
        return
    if not out.is_dir():
        raise Edge0Error(f"{out}: exists and is not a directory; {what} is a directory to write, nothing else is "
                         f"replaced")
    if not (out / kind.sign).is_file():
        raise Edge0Error(f"{out}: exists, is not empty and is not {kind.name} (no {kind.sign}); only {kind.name} is "
                         f"replaced, with --force: choose another {what}")
    if not force:
        raise Edge0Error(f"{out}: exists and is not empty; pass --force to replace it")


def check_file_out(out: str | os.PathLike, force: bool | None, kind: Kind, what: str = "OUT") -> None:
    """A file output may be absent; an existing one is replaced only when it is an earlier output of the same
    kind, and only with --force (None: a command without the flag, that replaces its own outputs)."""
    out = Path(out)
    if out.is_dir():
        raise Edge0Error(f"{out}: is a directory; name the file to write")
    if not os.path.lexists(out):
        return
    if not kind.test(out):
        flag = "" if force is None else ", with --force"
        raise Edge0Error(f"{out}: exists and is not {kind.name} (no {kind.sign}); only {kind.name} is replaced"
                         f"{flag}: choose another {what}")
    if force is None:
        return
    if not force:
        raise Edge0Error(f"{out}: exists; pass --force to replace it")


def check_own_dir(path: str | os.PathLike, own: str, what: str, flag: str = "--out") -> None:
    """A directory a command writes files into (a run directory, a checkpoint, a cache) is absent or holds only
    names that command writes (the regular expression `own`): it never writes among a user's files."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise Edge0Error(f"{path}: exists and is not a directory ({what}); move it away or choose another {flag}")
    stray = sorted(n for n in os.listdir(path) if not re.fullmatch(own, n) and not n.startswith(".edge0-"))
    if stray:
        more = f" and {len(stray) - 1} more" if len(stray) > 1 else ""
        raise Edge0Error(f"{path}: holds {stray[0]}{more}, which {what} does not write; move it away or choose "
                         f"another {flag}")


def check_trained_out(out: Path, report: Path, resume: bool, fmt: str, inputs: dict, sides: dict) -> None:
    """A training output (heads, an adapter) lies in no input (a store it is written into is not one of them: its
    files are refused below); with --resume an existing OUT must be an earlier output of the same format, and
    OUT.json may exist only beside it. sides: {directory kept beside OUT: (its names' pattern, what it is)}."""
    for path in (out, report, *sides):
        refuse_inputs(path, inputs, "--out", replaces=False)
    if resume and os.path.lexists(out) and safetensors_format(out) != fmt:
        raise Edge0Error(f"{out}: exists and is not an {fmt} file; --resume continues only this command's own "
                         f"output: choose another --out")
    if resume and os.path.lexists(report) and not os.path.lexists(out):
        raise Edge0Error(f"{report}: exists beside no {out.name}, so it is no report of an earlier run; move it away "
                         f"or choose another --out")
    for path, (own, what) in sides.items():
        check_own_dir(path, own, what)
