"""Per-step timelines as Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

Tracing is a hook object: `NULL` does nothing and callers test `trace.on` before building arguments,
so a run without --trace pays one attribute check per event site.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from ..io.atomic import write_atomic

FORMAT = "edge0-trace-1"


def now_us() -> float:
    return time.perf_counter() * 1e6


class Trace:
    """Collects events in memory; `save` writes them atomically."""

    on = True

    def __init__(self, meta: dict | None = None):
        self.events: list[dict] = []
        self.meta = dict(meta or {})
        self._lock = threading.Lock()  # worker threads record their reads
        self._tids: dict[str, int] = {}
        self.t0 = now_us()

    def _tid(self, thread: str | None = None) -> int:
        """A lane per thread, by name: spans a worker reports are drawn on the worker's lane."""
        if thread is None:
            current = threading.current_thread()
            thread = "main" if current is threading.main_thread() else current.name
        if thread not in self._tids:
            self._tids[thread] = len(self._tids)
            self.events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": self._tids[thread],
                                "args": {"name": thread}})
        return self._tids[thread]

    def span(self, name: str, cat: str, start_us: float, end_us: float, *, thread: str | None = None, **args) -> None:
        with self._lock:
            self.events.append({"name": name, "cat": cat, "ph": "X", "ts": start_us - self.t0,
                                "dur": max(end_us - start_us, 0.0), "pid": 0, "tid": self._tid(thread),
                                "args": {**args, "thread": thread or "main"}})

    def instant(self, name: str, cat: str, **args) -> None:
        with self._lock:
            self.events.append({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": now_us() - self.t0, "pid": 0,
                                "tid": self._tid(), "args": args})

    def save(self, path: str | os.PathLike, summary: dict | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"traceEvents": self.events, "displayTimeUnit": "ms",
                "otherData": {"format": FORMAT, **self.meta, "summary": summary or {}}}
        write_atomic(path, json.dumps(data).encode())


class _Null:
    on = False

    def span(self, *a, **k) -> None:
        pass

    def instant(self, *a, **k) -> None:
        pass


NULL = _Null()
