"""Whether reading ahead pays, by measurement (`--read-ahead measured`, the default).

Reading ahead hides a read behind the step before it, and costs: the predictions' graphs, their pulls and
plans, and every wrong guess read from a disk that the step's own misses then wait behind. Which wins depends
on the disk, the bundles' size and the predictor's recall, and on small bundles read by wrong guesses reading
ahead can lose by far more than it hides. So the runtime measures it: decode steps alternate between the two modes in
windows, and the faster mode holds for a while before the other is measured again (a hold that the
measurement confirms doubles, up to MAX_HOLD steps, and grows 4x where the other mode lost by DECISIVE or
more: a probe of the slower mode then costs a few percent at most). A generation's first steps run paused (what
native routing reads) and reading ahead is probed after them: the first choice takes the faster mode, later ones
keep the held mode unless the probe beats it by MARGIN; a probe losing by DECISIVE after ABORT_AFTER of its steps
ends there. A paused step reads only what it routes (prefetch: its own router's experts, on demand; predicted
routing: its heads still route, and their reads are planned at the step's end).

Outputs do not depend on the mode (prefetch equals native either way; predicted routing routes by its heads
in both), only the time does. The clock is the graph-building thread's, between step boundaries."""

from __future__ import annotations

import statistics
import time
from collections import deque


class ReadAheadGate:
    """Decides, step by step, whether the next decode step reads ahead. `step()` at every step boundary."""

    warm_pause = True  # a warm page cache pauses reading ahead (pipeline/prefetch_runtime.py PAUSE_AFTER)
    mode = "measured"  # the --read-ahead mode it runs, as --json reports it
    why: str | None = None  # why it runs a mode the user did not ask for (--json)

    WINDOW = 8  # steps measured per mode before a choice: the last WINDOW of its stretch
    SETTLE = 2  # a probe's steps before its window: the first step after resuming has nothing read ahead yet,
    # the first paused one still consumes what was planned before it
    HOLD = 32  # steps the faster mode runs before the other is measured again
    MAX_HOLD = 256  # a change of regime (the disk, the text) is seen within this many steps and a probe
    MARGIN = 0.1  # the probe takes over only when its median step is this much shorter than the held mode's: a
    # window of a noisy disk's steps is no proof, and a wrong flip costs a whole hold
    DECISIVE = 0.25  # a choice whose loser's median step is this much longer than the winner's holds longer
    # (a flip: 2 HOLD, not HOLD; a confirmation: 4x the hold before, not 2x), so such a loser is probed less often:
    # on the demo store with every read from the disk, reading ahead by guesses lost by 30-60% at every probe
    FIRST_AHEAD = False  # the first steps' mode: paused (what native routing reads), reading ahead probed after them
    ABORT_AFTER = 3  # a probe whose median step after this many measured steps is DECISIVE longer than the held
    # mode's ends there (on the demo store from the disk each probe of reading ahead cost 10 steps 30-60% slower)

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.ahead = self.FIRST_AHEAD  # the mode of the step being built
        self.times = {True: deque(maxlen=self.WINDOW), False: deque(maxlen=self.WINDOW)}
        self.hold = self.HOLD
        self.probing = False  # the mode now running is measured against the one that held before it
        self.left = self.SETTLE + self.WINDOW  # steps until the phase ends (the first mode's, measured)
        self.last = None  # the clock at the last step boundary (None: none yet in this generation)
        self.rows = 1  # the batch's sequences the windows' steps computed (a generation alone: one)
        self.choices = 0  # choices made
        self.flips = 0  # of which the mode changed
        self.history = deque(maxlen=64)  # the last choices: (median step ahead, paused (ms), reads ahead after)

    def restart(self) -> None:
        """A new generation: the next step boundary starts the clock (the time before it is the prompt's, or
        idle)."""
        self.last = None

    def resize(self, rows: int) -> None:
        """A served batch's sequences joined or left, `rows` now: the step across the change (a newcomer's prompt
        runs there) is not timed. Where the batch's size changed, steps before it speak for another batch: both
        windows start over and a probe under way is given up (the held mode resumes for its hold), so a choice
        compares steps of one size. One client's requests in turn (one row each) keep their windows."""
        self.last = None
        if rows == self.rows:
            return
        self.rows = rows
        for t in self.times.values():
            t.clear()
        if self.probing:
            self.probing = False
            self.ahead, self.left = not self.ahead, self.hold

    def step(self, now: float | None = None) -> bool:
        """A step just ended (in the mode `ahead` says) at the clock's `now` (default: now, read here; the scheduler's
        loop passes the graph-building thread's reading): time it; returns whether the next step reads ahead."""
        now = self.clock() if now is None else now
        if self.last is not None:
            self.times[self.ahead].append(now - self.last)  # the stretch's last WINDOW steps are kept
            self.left -= 1
            if self.probing and self.left == self.WINDOW:
                self.times[self.ahead].clear()  # its settling steps: not measured
        self.last = now
        if self.probing and self._losing():
            self.left = 0
        if self.left > 0:
            return self.ahead
        if not self.probing:  # a hold ended: measure the other mode
            self._switch(not self.ahead, self.SETTLE + self.WINDOW)
            self.probing = True
            return self.ahead
        held = not self.ahead
        self.probing = False
        if len(self.times[held]) < self.WINDOW // 2:  # the batch changed late in the hold: no figure to beat
            self._switch(held, self.hold)
            return self.ahead
        med = {m: statistics.median(t) for m, t in self.times.items()}
        margin = self.MARGIN if self.choices else 0.0  # the first choice: the faster mode, no held one to keep
        faster = self.ahead if med[self.ahead] < (1 - margin) * med[held] else held
        self.history.append((round(1e3 * med[True], 2), round(1e3 * med[False], 2), faster))
        self.choices += 1
        self.flips += faster != held
        slower = med[not faster] / med[faster] if med[faster] > 0 else 1.0
        grow = 4 if slower > 1 + self.DECISIVE else 2
        self.hold = min(grow * self.hold if faster == held else grow // 2 * self.HOLD, self.MAX_HOLD)
        if faster == self.ahead:  # the probe won: it goes on, measured (its window fills again as it holds)
            self.left = self.hold
        else:
            self._switch(faster, self.hold)
        return self.ahead

    def _losing(self) -> bool:
        """Whether the probe under way has lost decisively already (ABORT_AFTER of its steps measured)."""
        probe, held = self.times[self.ahead], self.times[not self.ahead]
        if self.left >= self.WINDOW or len(probe) < self.ABORT_AFTER or len(held) < self.WINDOW // 2:
            return False
        return statistics.median(probe) > (1 + self.DECISIVE) * statistics.median(held)

    def _switch(self, ahead: bool, steps: int) -> None:
        self.ahead, self.left = ahead, steps
        self.times[ahead].clear()  # only this stretch's steps speak for the mode

    def summary(self) -> dict:
        """For --json: the --read-ahead mode run (and why, where the gate is not the one that mode names), whether it
        reads ahead now, the choices made, each mode's median step at the last choice (ms), and the last 64 choices
        (median ahead, median paused, whether it reads ahead after)."""
        ahead_ms, paused_ms, _ = self.history[-1] if self.history else (None, None, None)
        return {"mode": self.mode, **({"why": self.why} if self.why else {}), "ahead": self.ahead,
                "choices": self.choices, "flips": self.flips,
                "ahead_step_ms": ahead_ms, "paused_step_ms": paused_ms, "history": list(self.history)}


class NoReadAhead(ReadAheadGate):
    """`--read-ahead never`: every decode step paused (prefetch reads on demand, as native; predicted routing's
    heads still route, their reads planned at the step's end): for a disk known to lose by reading ahead, and
    `edge0 bench`'s `ARM+never` arms. Nothing is timed or chosen; its summary is the gate's, with no choices."""

    mode = "never"

    def __init__(self, why: str | None = None):
        super().__init__()
        self.ahead, self.why = False, why

    def step(self, now: float | None = None) -> bool:
        return False


class CertainReads(ReadAheadGate):
    """The measured gate of a runtime that guesses nothing: predicted routing where every layer is routed by its head
    or holds its experts (pipeline/prefetch_runtime.py held_layers). Each read ahead is one its step makes anyway, so reading
    ahead adds no read, and pausing would only start the reads later (at the step's end instead of the next layer):
    while reads come from the disk every step reads ahead, with nothing to measure (measuring would only pause reads
    the step needs). A warm page cache pauses it (one pull a step instead of one a layer) only for bundles under
    WARM_PAUSE_BYTES: a bigger one's copy from the page cache is worth hiding."""

    WARM_PAUSE_BYTES = 1 << 20
    FIRST_AHEAD = True
    why = "every layer is routed by its head or holds its experts: each read ahead is one its step makes anyway"

    def __init__(self, bundle_bytes: int = 0):
        super().__init__()
        self.warm_pause = bundle_bytes < self.WARM_PAUSE_BYTES

    def step(self, now: float | None = None) -> bool:
        return True


def read_ahead_gate(mode: str, *, full: bool = False):
    """The gate of `--read-ahead MODE`: measured, never, or None (always: nothing pauses). full: every streamed bank
    holds every expert, so nothing is left to read ahead once they have filled: measured is never there."""
    if mode == "measured" and full:
        return NoReadAhead("every streamed bank holds every expert: nothing is left to read ahead")
    return {"measured": ReadAheadGate, "never": NoReadAhead}.get(mode, lambda: None)()
