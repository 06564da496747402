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
