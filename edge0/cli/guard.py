"""`guarded` gives every command the same exit codes and one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from ..errors import Edge0Error


def guarded(fn: Callable[[], int]) -> int:
    """Run a command: an Edge0Error (or a full or read-only disk) is one line on stderr and exit 2; Ctrl-C is exit
    130, no traceback."""
    try:
        return fn()
    except Edge0Error as e:
        print(f"edge0: error: {said(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edge0: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a full or read-only disk met outside the writers that say so themselves
        line = _disk_error(e)
        if line is None:
            raise
        print(f"edge0: error: {line}", file=sys.stderr)
        return 2


def said(e: Edge0Error) -> str:
    """An error's line as the command line says it: an EngineConfig setting by its flag."""
    from ..errors import SettingError

    if isinstance(e, SettingError):
        from .flags import SETTING_FLAGS

        return e.say(SETTING_FLAGS)
    return str(e)


def _disk_error(e: OSError) -> str | None:
    """One line for an OSError of the disk itself, naming its file; None for any other (a bug: its traceback)."""
    import errno

    from ..io.atomic import no_space

    if e.filename is None:
        return None
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return str(no_space(Path(e.filename)))
    if e.errno == errno.EROFS:
        return f"{e.filename}: cannot be written ({e.strerror})"
    if e.errno in (errno.EACCES, errno.EPERM):  # a read or a write: said as it is
        return f"{e.filename}: {e.strerror}"
    return None
