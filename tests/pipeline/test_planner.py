"""The scheduler's event loop: a step's last predictions are planned there while MLX evaluates the step
(PrefetchRuntime.flush / settle), and on the loop each layer's fills once it has read its bank. Moving that work off
the graph-building thread must change nothing but where it runs: the same log-probabilities, bit for bit, and the
same reads, as when every plan is made on the graph-building thread (the loop's thread never woken: each settle runs
the work posted); and an error raised while planning reaches the caller, after which the engine still
generates correctly."""

import threading

import numpy as np
import pytest

from edge0.engine import open_engine
from edge0.sched.loop import SchedLoop
from edge0.sched.scheduler import Scheduler

from .test_pause import forced, pinned_store, private_config
from .test_identity import real_text

TOKENS = 40


def run(monkeypatch, ids, *, inline: bool, **config):
    """Forced decoding of ids under the demo's default routing (predicted: it ships heads), streamed; returns the
    log-probabilities, the scheduler's counters and the names of the threads that planned fills."""
    threads = []
    prefetch = Scheduler.prefetch

    def recorded(self, *a, **k):
        threads.append(threading.current_thread().name)
        return prefetch(self, *a, **k)

    monkeypatch.setattr(Scheduler, "prefetch", recorded)
    if inline:  # the loop's thread is never woken: each settle runs what was posted, on this thread
        monkeypatch.setattr(SchedLoop, "wake", lambda self: None)
    # no read from the disk in either run
    with pinned_store(), open_engine(private_config({"io.executor": "staged", **config})) as engine:
        rt = engine.store.runtime
        assert rt.predicted_routing
        got = forced(engine, ids)
        st = rt.sched.stats
        counters = (st.loads, st.demand_loads, st.predicted, st.routed, rt.sched.pool.stats.loads)
    monkeypatch.undo()
    return got, counters, threads


def test_planner_thread_changes_nothing_but_the_thread(monkeypatch):
    ids = real_text(TOKENS)
    want, want_counters, here = run(monkeypatch, ids, inline=True)
    got, counters, there = run(monkeypatch, ids, inline=False)
    assert np.array_equal(got, want)
    assert counters == want_counters
    assert set(here) == {"MainThread"}
    assert any(name.startswith("edge0-sched") for name in there)  # the step's last plans left the main thread
    assert len(there) == len(here)


def test_planning_error_reaches_the_caller_and_the_engine_recovers(monkeypatch):
    ids = real_text(TOKENS)
    with pinned_store(), open_engine(private_config({"io.executor": "staged"})) as engine:
        want = forced(engine, ids)
        prefetch, failed = Scheduler.prefetch, []

        def failing(self, *a, **k):
            if threading.current_thread() is not threading.main_thread() and not failed:
                failed.append(self.step)
                raise OSError("injected: the planner's read failed")
            return prefetch(self, *a, **k)

        monkeypatch.setattr(Scheduler, "prefetch", failing)
        with pytest.raises(OSError, match="injected"):
            forced(engine, ids)
        assert failed
        monkeypatch.undo()
        rt = engine.store.runtime
        assert rt.loop.idle  # settled: nothing of the failed generation runs on
        again = forced(engine, ids)
    assert np.array_equal(again, want)
