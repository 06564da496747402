"""Edge0's log: structlog key-value events on stderr, one line each; human-readable by default
(`edge0: event key=value ...`), one JSON object per line after `configure(json=True)` (`--log-json`),
so a server's log can be parsed. Progress bars stay on tqdm; a command's own output stays on stdout.

    from edge0.log import log
    log.info("request done", status=200, tokens=12)
"""

from __future__ import annotations

import json as _json
import sys
import time
import traceback

import structlog

from .errors import Edge0Error


def _human(_, level: str, event: dict) -> str:
    msg = event.pop("event", "")
    event.pop("timestamp", None)
    extra = " ".join(f"{k}={v}" for k, v in event.items())
    prefix = "edge0: " if level in ("info", "debug") else f"edge0: {level}: "
    return prefix + msg + (f" ({extra})" if extra else "")


def _json_line(_, level: str, event: dict) -> str:
    event = {"ts": round(time.time(), 3), "level": level, **event}
    return _json.dumps(event, default=str)


class _Stderr:
    """A logger that writes each rendered line to the stderr of the moment (tests capture it)."""

    def msg(self, line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    info = debug = warning = error = exception = critical = msg


def configure(*, json: bool = False) -> None:
    """Human-readable lines (default) or JSON lines (json=True), both on stderr."""
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, _json_line if json else _human],
                        logger_factory=lambda *a: _Stderr(), cache_logger_on_first_use=False)


configure()
log = structlog.get_logger()


def log_failure(what: str, e: BaseException) -> None:
    """An operation failed: an Edge0Error (a failed read, a bad file: its message names what and where) as its one
    line; anything else, a fault of Edge0's own, with its traceback."""
    if isinstance(e, Edge0Error):
        log.error(what, error=" ".join(str(e).split()))
    else:
        log.error(what, error=repr(e), traceback="".join(traceback.format_exception(e)))
