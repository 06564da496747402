"""The graph-building thread's hand-offs to the scheduler: work handed to its event loop (sched/loop.py), the settle
before the scheduler is touched again, and the timing of the scheduler's work on either side (`sched`, `plan`)."""

from __future__ import annotations

import threading
import time
from functools import partial

from ..sched.loop import SchedLoop
from ..sched.trace import now_us


class Handoff:
    """PrefetchRuntime's side of the scheduler's threads (a mixin: it uses the runtime's sched, trace and gate)."""

    sched_s = 0.0  # the scheduler's time on the graph-building thread (its waits for the loop too), stalls and
    # pulls excluded
    sched_cpu_s = 0.0  # CPU time of that thread in the same spans, pulls included (MLX evaluates or spins on this
    # thread while a pull waits), so it can exceed sched_s
    plan_s = 0.0  # the scheduler's planning on its loop (or run by a settle that found it not started)
    plan_cpu_s = 0.0  # of which CPU time
    loop: SchedLoop | None = None  # the scheduler's event loop (None once closed)
    _advanced = False  # the loop has ended the step flushed last (its books kept), next_step only settles
    _ended: int | None = None  # the loop's item that ends the step flushed last: the settle after the step's
    # evaluation waits for it only, the fills posted after it run on (until the next layer settles)
    _nested = 0  # scheduler spans open (`scheduling`): only the outermost is timed
    deferred: list = []  # consumers pulled inside a layer's scheduler work: planned with that layer's plans, after it
    booked: list = []  # plans consumed by Scheduler.take, books of Scheduler.held's lookups and demand reads: to the
    # loop ahead of the next plans posted (at the latest with the step's end)

    def _plan(self, plans: list, traced: bool = True) -> None:
        """On the loop: run the plans (numpy, the pool; no MLX), timed as the planner's
        (plan_ms_per_token); traced: a `plan` span of its own (a layer's plans: the loop's span)."""
        t0, cpu0 = now_us(), time.thread_time()
        try:
            for plan in plans:
                plan()
        finally:
            if self.sched.step >= 1:
                self.plan_s += (now_us() - t0) / 1e6
                self.plan_cpu_s += time.thread_time() - cpu0
            if traced and self.trace is not None and self.trace.on:
                self.trace.span("plan", "plan", t0, now_us(), thread=threading.current_thread().name,
                                step=self.sched.step)

    @staticmethod
    def waiting_plans(consumers: list) -> list:
        """The consumers' waiting fills as plans, taken from them here: another thread plans them, and only the
        graph-building thread touches `waiting`."""
        plans = []
        for c in consumers:
            if c.waiting:
                waiting, c.waiting = c.waiting, []
                plans.append(partial(c.plan_waiting, waiting))
        return plans

    def books(self) -> list:
        """The books of the plans consumed by Scheduler.take (and those already callables: Scheduler.held's lookups,
        demand reads' collections) since the last hand-off, as plans (`booked` emptied): they come before any plan of
        the same bank (its slots released, its recency)."""
        if not self.booked:
            return []
        booked, self.booked = self.booked, []
        return [p if callable(p) else partial(self.sched.consumed, p) for p in booked]

    def plan_later(self, c=None, plan=None, books: bool = False) -> None:
        """Layer c's scheduler work of this step is done (it has read its bank): its waiting fills (or `plan`) and
        those of the consumers pulled meanwhile (`deferred`) are planned on the loop, in one hand-off, while this
        thread builds and waits for MLX; the next touch of the scheduler settles. The books of plans consumed go
        first, and only with plans (they need no hand-off of their own before the step's end), or where `books`."""
        if plan is None and not self.deferred and not (c is not None and c.waiting) and not (books and self.booked):
            return
        with self.scheduling(c.layer if c is not None else -1):
            plans = [plan] if plan is not None else self.waiting_plans([c] if c is not None else [])
            plans += self.waiting_plans(self.deferred)
            self.deferred = []
            plans = self.books() + plans
            if self.loop is None:
                for p in plans:
                    p()
            else:
                self.loop.post("plan", self._plan, plans, False, step=self.sched.step, wake=False)  # woken at the next
                # wait for MLX (`wake`)

    @property
    def loop_idle(self) -> bool:
        return self.loop is None or self.loop.idle

    def wake(self) -> None:
        """This thread is about to wait for MLX: the loop runs what was posted meanwhile."""
        if self.loop is not None:
            self.loop.wake()

    def settle(self) -> None:
        """Make sure the loop's work has run, raising its error: before touching the scheduler. The first settle
        after a flush (the step's evaluation's) waits only for the step's end (`_ended`)."""
        if self.loop is None:
            return
        upto, self._ended = self._ended, None
        if not self.loop.settled(upto):
            with self.scheduling(-1):  # a wait for the scheduler: its time on the graph-building thread
                self.loop.settle(self.sched.step, upto)
        else:
            self.loop.settle(upto=upto)  # (an error of work that ran)

    def span(self, name: str, cat: str, t0: float, **args) -> None:
        if self.trace is not None and self.trace.on:
            self.trace.span(name, cat, t0, now_us(), step=self.sched.step, **args)

    def scheduling(self, layer: int) -> "_Scheduling":
        return _Scheduling(self, layer)

    def _step_end(self, now: float | None) -> None:
        """On the loop, while MLX evaluates the step flushed: end it (its plans not consumed are dropped) and time it
        for the gate (`now`: the graph-building thread's clock at the flush); its last fills are planned after."""
        self.sched.next_step()
        self._watch_reads(now)

    def _end_built(self, plans: list, step: int) -> None:
        """On the loop, where steps overlap: plan what was predicted after the last layer's hand-off and end `step`
        (its plans not consumed are dropped), while the graph-building thread builds the next one."""
        if plans:
            self._plan(plans)
        self.sched.end_step(step)

    def _settle_quietly(self) -> None:
        """Settle, dropping the planner's error: the plans are abandoned next (a failed read emptied its slot); the
        books of plans consumed are kept here (their slots released before the plans are)."""
        self._ended = None  # (all of it)
        try:
            self.settle()
        except Exception:
            pass
        for book in self.books():
            book()


class _Scheduling:
    """Times the scheduler's work on the graph-building thread (a `sched` span), its stalls left out."""

    def __init__(self, rt, layer: int):
        self.rt, self.layer = rt, layer

    def __enter__(self):
        self.rt._nested += 1
        self.t0, self.waits0 = now_us(), self.rt.sched.stats.stall_s + self.rt.pull_s
        self.cpu0 = time.thread_time()

    def __exit__(self, *exc):
        rt = self.rt
        rt._nested -= 1
        if rt._nested:  # inside another span (a settle in a layer's work): timed once, by the outer one
            return
        spent = (now_us() - self.t0) / 1e6 - (rt.sched.stats.stall_s + rt.pull_s - self.waits0)
        if rt.sched.step >= 1:  # decode steps, as --json's figures (step 0 is the prompt's last token)
            rt.sched_s += spent
            rt.sched_cpu_s += time.thread_time() - self.cpu0  # a pull's CPU included (see sched_cpu_s)
        if rt.trace is not None and rt.trace.on:
            rt.trace.span("sched", "sched", self.t0, self.t0 + spent * 1e6, layer=self.layer, step=rt.sched.step)
