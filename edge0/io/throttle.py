"""A storage throttle for experiments: caps the read bandwidth of all threads together.

Each read reserves its transfer time on a shared virtual clock and sleeps until its slot ends, so
N threads together never exceed the rate. Off unless --io-throttle is given; always reported when on.
"""

from __future__ import annotations

import threading
import time


class Throttle:
    def __init__(self, mb_per_s: float):
        if mb_per_s <= 0:
            raise ValueError("throttle rate must be positive")
        self.rate = mb_per_s * 1e6  # bytes per second
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the modelled device is next idle (perf_counter seconds)

    def pace(self, nbytes: int, started: float) -> None:
        """Called after a read of nbytes that began at `started`: sleep until the throttled device would be done."""
        with self._lock:
            begin = max(started, self._free_at)
            self._free_at = begin + nbytes / self.rate
            done = self._free_at
        delay = done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
