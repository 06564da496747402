"""The commands' entry points; each builds its configs from flags (edge0/flags.py) and never imports
another command. `guarded` gives every command the same exit codes and one-line errors."""

from __future__ import annotations

import sys
from typing import Callable

from ..errors import Edge0Error


def guarded(fn: Callable[[], int]) -> int:
    """Run a command: an Edge0Error is one line on stderr and exit 2; Ctrl-C is exit 130, no traceback."""
    try:
        return fn()
    except Edge0Error as e:
        print(f"edge0: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edge0: interrupted", file=sys.stderr)
        return 130
