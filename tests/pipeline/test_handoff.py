"""The graph-building thread's scheduler time (`sched_ms_per_token`): a span inside another (a settle inside a
layer's scheduler work) is timed once."""

import time
from types import SimpleNamespace

from edge0.pipeline.handoff import Handoff
from edge0.sched.trace import Trace


class Runtime(Handoff):
    def __init__(self):
        self.sched = SimpleNamespace(step=1, stats=SimpleNamespace(stall_s=0.0))
        self.pull_s = 0.0
        self.trace = Trace()


def test_a_span_inside_another_is_timed_once():
    rt = Runtime()
    t0 = time.perf_counter()
    with rt.scheduling(2):
        with rt.scheduling(-1):  # as Handoff.settle inside a layer's `_slots`
            time.sleep(0.05)
    wall = time.perf_counter() - t0
    assert 0.05 <= rt.sched_s <= wall  # not twice the sleep
    spans = [e for e in rt.trace.events if e.get("name") == "sched"]
    assert len(spans) == 1 and spans[0]["args"]["layer"] == 2


def test_books_ride_with_the_next_plans_never_alone():
    """A consumed plan's books need no hand-off of their own (a post that a settle would then run on the graph-building
    thread): they go with the next plans, ahead of them, or where asked (the step's end)."""
    from edge0.sched.loop import SchedLoop

    rt = Runtime()
    ran = []
    rt.sched.consumed = lambda p: ran.append(("books", p))
    rt.loop = SchedLoop()
    try:
        rt.booked = ["plan A"]
        rt.plan_later()  # nothing to plan: nothing posted
        assert rt.loop.idle and rt.booked == ["plan A"] and ran == []
        rt.plan_later(plan=lambda: ran.append(("plan", "B")))
        rt.settle()
        assert ran == [("books", "plan A"), ("plan", "B")] and rt.booked == []
        rt.booked = ["plan C"]
        rt.plan_later(books=True)
        rt.settle()
        assert ran[-1] == ("books", "plan C")
    finally:
        rt.loop.close()
