"""The scheduler's event loop: one asyncio loop (uvloop where installed) on a thread of its own, for the runtime's
lifetime.

The graph-building thread hands work to it (`post`: one thread-safe hand-off, no wait) and waits on it only where it
is about to touch what the loop owns (`settle`: the readiness primitive, a counter check when the loop is done
already). Work posted runs in order, one item at a time, so the scheduler's state has one owner at any moment: the
loop between a post and the settle after it, the graph-building thread otherwise. A settle that finds work the loop
has not started (its thread not scheduled yet: on a busy machine a wake-up takes milliseconds) runs it itself rather
than wait for the thread; it waits only for an item already running. A posted item's error is kept and raised by the
next settle (a failed read reaches the step that needs it). `close` cancels what is still scheduled on the loop and
stops its thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from .trace import NULL, now_us


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed, else asyncio's default loop (the scheduler's, the server's)."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class SchedLoop:
    """An event loop thread that runs posted work in order; `settle` waits until it has all run."""

    def __init__(self, *, trace=NULL, name: str = "edge0-sched"):
        self.trace = trace
        self.name = name
        self.loop = new_loop()
        self._posted = 0  # items handed over (only the graph-building thread posts)
        self._done = 0  # of which run
        self._queue: deque = deque()  # items posted and not started
        self._running = threading.Lock()  # held while items run (on the loop, or by a settle): one at a time, in order
        self._error: BaseException | None = None
        self.busy_s = 0.0  # time running posted work (wherever it ran)
        self.wait_s = 0.0  # the graph-building thread's time in settles that found work left (`settle`)
        self.ran_here = 0  # items a settle ran itself (the loop's thread had not started them)
        self._woken = False  # a drain is scheduled on the loop
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def post(self, what: str, fn, *args, step: int = -1, wake: bool = True) -> None:
        """Run fn(*args) on the loop, after everything posted before it; returns at once. wake=False: the loop
        starts it at the next `wake` (where the caller is about to wait: a wake-up may cost it its core)."""
        self._posted += 1
        self._queue.append((what, fn, args, step))
        if wake:
            self.wake()

    def wake(self) -> None:
        """Have the loop run what is posted (one wake-up for all of it)."""
        if self._queue and not self._woken:
            self._woken = True
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self, upto: int | None = None) -> int:
        """Run the items not started, in order (up to the `upto`-th posted); returns how many ran here. Items left
        are run by the loop's drain that the wake-up before them scheduled."""
        self._woken = False
        n = 0
        with self._running:
            while self._queue and (upto is None or self._done < upto):
                self._do(*self._queue.popleft())
                n += 1
        return n

    def _do(self, what: str, fn, args: tuple, step: int) -> None:
        t0 = now_us()
        try:
            fn(*args)
        except BaseException as e:  # raised on the graph-building thread by its next settle
            self._error = self._error or e
        finally:
            t1 = now_us()
            self.busy_s += (t1 - t0) / 1e6
            self._done += 1
            if self.trace.on:
                self.trace.span(what, "loop", t0, t1, thread=threading.current_thread().name, step=step)

    @property
    def idle(self) -> bool:
        """Whether everything posted has run (no wait needed)."""
        return self._done == self._posted

    @property
    def posted(self) -> int:
        """Items posted so far (a mark for `settle`'s upto)."""
        return self._posted

    def settled(self, upto: int | None = None) -> bool:
        """Whether everything posted (up to the `upto`-th item) has run."""
        return self._done >= (self._posted if upto is None else upto)

    def settle(self, step: int = -1, upto: int | None = None) -> None:
        """Make sure everything posted has run (up to the `upto`-th item posted, where given: the rest runs on,
        on the loop), waiting for an item running on the loop, running those it has not started; then raise the
        first error of that work (once)."""
        if self._done < (self._posted if upto is None else upto):
            t0 = now_us()
            self.ran_here += self._drain(upto)
            t1 = now_us()
            self.wait_s += (t1 - t0) / 1e6
            if self.trace.on:
                self.trace.span("loop wait", "stall", t0, t1, step=step)
        error, self._error = self._error, None
        if error is not None:
            raise error

    def submit(self, coro) -> "asyncio.Future":
        """Schedule a coroutine on the loop (reads it awaits, a dump it writes); a concurrent Future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel every task still scheduled on the loop, stop it and join its thread. Work posted and not run yet
        runs first (it leaves the scheduler consistent)."""
        if not self._thread.is_alive():
            return
        done = threading.Event()

        def stop() -> None:
            self._drain()  # (posted without a wake-up)
            tasks = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if not tasks:
                self.loop.stop()
                done.set()
                return
            gathered = asyncio.gather(*tasks, return_exceptions=True)
            gathered.add_done_callback(lambda _: (self.loop.stop(), done.set()))

        self.loop.call_soon_threadsafe(stop)
        done.wait()
        self._thread.join()
        self.loop.close()
