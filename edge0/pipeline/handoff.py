"""The graph-building thread's hand-offs to the scheduler: work handed to its event loop (sched/loop.py) or, with
EDGE0_SCHED=inline, to a planner thread and the graph-building thread itself; the settle before the scheduler is
touched again; and the timing of the scheduler's work on either side (`sched`, `plan`)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from ..sched.loop import SchedLoop
from ..sched.trace import now_us

# The scheduler's event loop plans the step's last fills, each layer's fills once it has read its bank, and keeps the
# step's books; EDGE0_SCHED=inline runs that work as before it (a planner thread, the rest inline), for A/B.
SCHED_LOOP = os.environ.get("EDGE0_SCHED", "loop") != "inline"


class Handoff:
    """PrefetchRuntime's side of the scheduler's threads (a mixin: it uses the runtime's sched, trace and gate)."""

    sched_s = 0.0  # the scheduler's time on the graph-building thread (its waits for the loop too), stalls and
    # pulls excluded
    sched_cpu_s = 0.0  # of which CPU time of that thread (the rest: waiting for a lock, or for a core)
    plan_s = 0.0  # the scheduler's planning on its own thread (the loop's, or the planner's)
    plan_cpu_s = 0.0  # of which CPU time
    _planner: ThreadPoolExecutor | None = None  # inline: the planner thread, started at the first flush that plans
    _planning: Future | None = None  # its work for the step being evaluated, until settled
    loop: SchedLoop | None = None  # the scheduler's event loop (SCHED_LOOP)
    _advanced = False  # the loop has ended the step flushed last (its books kept), next_step only settles

    def _plan(self, consumers: list) -> None:
        """On the planner thread: plan the consumers' waiting fills (numpy, the pool; no MLX)."""
        t0, cpu0 = now_us(), time.thread_time()
        try:
            for c in consumers:
                c.plan_waiting()
        finally:
            if self.sched.step >= 1:
                self.plan_s += (now_us() - t0) / 1e6
                self.plan_cpu_s += time.thread_time() - cpu0
            if self.trace is not None and self.trace.on:
                self.trace.span("plan", "plan", t0, now_us(), thread=threading.current_thread().name,
                                step=self.sched.step)

    def plan_later(self, c, plan=None) -> None:
        """Plan layer c's waiting fills (or call `plan`) on the loop, after c has read its bank this step: the
        graph-building thread goes on building, and the loop plans while it waits for MLX (prefetch routing: the next
        layer's routed ids); the next touch of the scheduler settles (inline: planned here)."""
        with self.scheduling(c.layer):
            if plan is None:
                waiting, c.waiting = c.waiting, []
                plan = partial(c.plan_waiting, waiting)
            if self.loop is None:
                plan()
            else:
                self.loop.post("plan", self._timed_plan, plan, step=self.sched.step)

    def _timed_plan(self, plan) -> None:
        """On the loop: a layer's plans, counted as the planner's time (plan_ms_per_token)."""
        t0, cpu0 = now_us(), time.thread_time()
        try:
            plan()
        finally:
            if self.sched.step >= 1:
                self.plan_s += (now_us() - t0) / 1e6
                self.plan_cpu_s += time.thread_time() - cpu0

    def settle(self) -> None:
        """Wait for the loop's (inline: the planner thread's) work, raising its error: before touching the scheduler."""
        if self.loop is not None:
            if not self.loop.idle:
                with self.scheduling(-1):  # a wait for the scheduler: its time on the graph-building thread
                    self.loop.settle(self.sched.step)
            else:
                self.loop.settle()  # (an error of work that ran)
            return
        planning, self._planning = self._planning, None
        if planning is None:
            return
        with self.scheduling(-1):  # a wait for the scheduler: its time on the graph-building thread
            planning.result()

    def span(self, name: str, cat: str, t0: float, **args) -> None:
        if self.trace is not None and self.trace.on:
            self.trace.span(name, cat, t0, now_us(), step=self.sched.step, **args)

    def scheduling(self, layer: int) -> "_Scheduling":
        return _Scheduling(self, layer)

    def _step_end(self, ready: list, now: float | None) -> None:
        """On the loop, while MLX evaluates the step flushed: plan its last fills, end it (its plans not consumed are
        dropped) and time it for the gate (`now`: the graph-building thread's clock at the flush)."""
        if ready:
            self._plan(ready)
        self.sched.next_step()
        self._watch_reads(now)

    def _settle_quietly(self) -> None:
        """Settle, dropping the planner's error: the plans are abandoned next (a failed read emptied its slot)."""
        try:
            self.settle()
        except Exception:
            pass


class _Scheduling:
    """Times the scheduler's work on the graph-building thread (a `sched` span), its stalls left out."""

    def __init__(self, rt, layer: int):
        self.rt, self.layer = rt, layer

    def __enter__(self):
        self.t0, self.waits0 = now_us(), self.rt.sched.stats.stall_s + self.rt.pull_s
        self.cpu0 = time.thread_time()

    def __exit__(self, *exc):
        rt = self.rt
        spent = (now_us() - self.t0) / 1e6 - (rt.sched.stats.stall_s + rt.pull_s - self.waits0)
        if rt.sched.step >= 1:  # decode steps, as --json's figures (step 0 is the prompt's last token)
            rt.sched_s += spent
            rt.sched_cpu_s += time.thread_time() - self.cpu0  # stalls and pulls wait without using the CPU
        if rt.trace is not None and rt.trace.on:
            rt.trace.span("sched", "sched", self.t0, self.t0 + spent * 1e6, layer=self.layer, step=rt.sched.step)
