"""The scheduler on its event loop (sched/loop.py): work handed over runs on the loop's thread in order, the
graph-building thread waits only to settle, errors reach the settle after them, shutdown cancels the loop's tasks;
the scheduler driven through it plans, fills, takes back, promotes and keeps the write rule, with reads that land
when the test says."""

import asyncio
import threading

import numpy as np
import pytest

from edge0.compute.banks import Bank, Fence
from edge0.compute.executors import SlotCache, SlotStats
from edge0.errors import Edge0Error
from edge0.io.pool import ReadPool
from edge0.sched.loop import SchedLoop
from edge0.sched.scheduler import Scheduler

from tests.sched.test_pool import GatedReader, until
from tests.sched.test_sched import fake_setup, held


async def settled(loop: SchedLoop, timeout: float = 5.0) -> None:
    """The graph-building thread's settle, from the test's own event loop."""
    await asyncio.wait_for(asyncio.to_thread(loop.settle), timeout)


async def test_posted_work_runs_on_the_loop_in_order_and_a_settle_waits_for_it():
    loop = SchedLoop()
    gate, started, ran = threading.Event(), threading.Event(), []
    loop.post("a", lambda: ran.append(("a", threading.current_thread().name)))
    loop.post("b", lambda: (started.set(), gate.wait()))  # a plan still running when the step needs the scheduler
    loop.post("c", lambda: ran.append(("c", threading.current_thread().name)))
    assert started.wait(5)
    waiter = asyncio.ensure_future(settled(loop))
    await asyncio.sleep(0.2)
    assert not waiter.done() and not loop.idle and [w for w, _ in ran] == ["a"]  # the step waits
    gate.set()
    await waiter
    assert ran == [("a", "edge0-sched"), ("c", "edge0-sched")] and loop.idle
    assert loop.wait_s > 0.1 and loop.busy_s > 0.1
    loop.close()


def test_a_settle_runs_the_work_the_loops_thread_has_not_started_instead_of_waiting_for_it():
    loop = SchedLoop()
    held_up = threading.Event()
    loop.loop.call_soon_threadsafe(held_up.wait)  # the loop's thread not scheduled (a busy machine)
    ran = []
    loop.post("plan", lambda: ran.append(("a", threading.current_thread().name)))
    loop.post("plan", lambda: ran.append(("b", threading.current_thread().name)))
    settler = threading.Thread(target=loop.settle, name="graph")
    settler.start()
    settler.join(2.0)  # runs both there, in order: no wait for the loop's thread
    settled_alone = not settler.is_alive()
    held_up.set()
    settler.join()
    assert settled_alone and ran == [("a", "graph"), ("b", "graph")] and loop.ran_here == 2
    loop.post("plan", lambda: ran.append(("c", threading.current_thread().name)))
    loop.settle()
    assert [w for w, _ in ran] == ["a", "b", "c"]  # each item once
    loop.close()


def test_a_settle_up_to_an_item_leaves_the_items_after_it_to_the_loop():
    """The settle after a step's evaluation waits for the step's end only (its pause is read by the next step): the
    fills posted after it run on the loop's thread, not on the graph-building one, and the next settle has them."""
    loop = SchedLoop()
    held_up = threading.Event()
    loop.loop.call_soon_threadsafe(held_up.wait)  # the loop's thread busy: a full settle would run both here
    ran = []
    loop.post("step end", lambda: ran.append(("end", threading.current_thread().name)), wake=False)
    mark = loop.posted
    loop.post("plan", lambda: ran.append(("fills", threading.current_thread().name)))
    settler = threading.Thread(target=loop.settle, kwargs={"upto": mark}, name="graph")
    settler.start()
    settler.join(2.0)
    assert not settler.is_alive() and ran == [("end", "graph")] and loop.settled(mark) and not loop.settled()
    held_up.set()
    assert until(lambda: loop.idle)
    assert ran == [("end", "graph"), ("fills", "edge0-sched")]
    loop.settle()
    loop.close()


def test_work_posted_without_a_wake_up_waits_for_wake_or_a_settle():
    loop = SchedLoop()
    ran = []
    loop.post("plan", lambda: ran.append(threading.current_thread().name), wake=False)  # (a layer's plans)
    threading.Event().wait(0.2)
    assert ran == [] and not loop.idle  # the loop's thread was not woken: the graph thread keeps its core
    loop.wake()  # (about to wait for MLX)
    loop.settle()
    assert len(ran) == 1 and loop.idle
    loop.close()


async def test_an_error_of_posted_work_reaches_the_next_settle_once():
    loop = SchedLoop()

    def fails():
        raise Edge0Error("layer 3: read of expert 7 failed")

    loop.post("plan", fails)
    loop.post("plan", lambda: None)  # later work still runs
    with pytest.raises(Edge0Error, match="expert 7"):
        await settled(loop)
    await settled(loop)  # raised once
    loop.close()


async def test_close_cancels_the_loops_tasks_and_stops_its_thread():
    loop = SchedLoop()
    started = threading.Event()

    async def forever():
        started.set()
        await asyncio.Event().wait()

    fut = loop.submit(forever())
    assert await asyncio.to_thread(started.wait, 5)
    await asyncio.to_thread(loop.close)
    assert fut.cancelled() and not loop._thread.is_alive() and loop.loop.is_closed()
    loop.close()  # twice: nothing left to do


async def test_plan_and_fill_on_the_loop_and_a_step_waits_only_for_a_read_not_landed():
    reader, fence, caches, sched = fake_setup()
    loop = SchedLoop()
    loop.post("plan", sched.prefetch, 1, caches[1], np.array([2, 3]), None, False)
    loop.post("step end", sched.next_step)
    await settled(loop)
    plan = sched.plans[(1, 1)]
    assert sched.step == 1 and caches[1].reserved[plan.slots].all() and reader.log == []  # planned, not landed
    consumer = asyncio.ensure_future(asyncio.to_thread(sched.ready, 1))  # the layer of step 1 needs it
    await asyncio.sleep(0.2)
    assert not consumer.done()  # its reads have not landed: it waits
    reader.release.set()  # the reads land
    assert await asyncio.wait_for(consumer, 5) is plan
    assert held(caches[1]) == {2: 16 + 2, 3: 16 + 3} and not caches[1].reserved.any()
    assert all(name.startswith("edge0-io") for _, _, name in reader.log)
    loop.close()
    sched.close()
    sched.pool.close()


async def test_a_guess_planned_on_the_loop_is_taken_back_where_the_router_did_not_choose_it():
    reader, fence, caches, sched = fake_setup(slots=4, workers=1)
    cache = caches[1]
    loop = SchedLoop()
    loop.post("plan", sched.prefetch, 1, cache, np.array([2, 3, 4]))  # a guess for step 1
    loop.post("step end", sched.next_step)
    await settled(loop)
    assert sched.ready(1) is not None and reader.log == []  # consumed without waiting
    demand = asyncio.ensure_future(asyncio.to_thread(sched.demand, 1, cache, np.array([2, 5])))
    await asyncio.sleep(0.2)
    assert not demand.done()
    reader.release.set()
    slots = await asyncio.wait_for(demand, 5)
    assert sorted(e for _, e, _ in reader.log) == [2, 5]  # 3 and 4 were taken back before they started
    assert held(cache) == {2: 16 + 2, 5: 16 + 5} and slots.tolist() == [cache.slot_of[2], cache.slot_of[5]]
    loop.close()
    sched.close()
    sched.pool.close()


async def test_a_planned_read_the_step_waits_for_is_promoted_past_the_read_ahead():
    reader = GatedReader()
    from edge0.io.manifest import Piece

    fence = Fence()
    cache = SlotCache(Bank([Piece(name="w", dtype="U8", shape=[16], offset=0, nbytes=16)], 4, fence), SlotStats(), 8)
    sched = Scheduler(ReadPool(reader, 2))  # one thread for planned reads, one reserved for demand reads
    loop = SchedLoop()
    loop.post("plan", sched.prefetch, 0, cache, np.array([1, 2]), None, False)
    loop.post("step end", sched.next_step)
    await settled(loop)
    assert until(lambda: reader.started == [1])  # 1 runs on the planned reads' thread, 2 queued behind it
    consumer = asyncio.ensure_future(asyncio.to_thread(sched.ready, 0))
    assert await asyncio.to_thread(until, lambda: reader.started == [1, 2])  # promoted: the reserved thread reads it
    reader.gate(2).set()
    await asyncio.sleep(0.1)
    assert not consumer.done()  # 1 has not landed
    reader.gate(1).set()
    await asyncio.wait_for(consumer, 5)
    loop.close()
    sched.close()
    sched.pool.close()


async def test_a_read_that_fails_on_the_loops_plan_empties_its_slot_and_reaches_the_step():
    reader, fence, caches, sched = fake_setup(slots=3)
    reader.release.set()
    reader.fail = {5}
    cache = caches[1]
    loop = SchedLoop()
    loop.post("plan", sched.prefetch, 1, cache, np.array([1, 5]), None, False)
    loop.post("step end", sched.next_step)
    await settled(loop)
    with pytest.raises(Edge0Error, match="read of expert 5 failed"):
        sched.ready(1)
    assert cache.slot_of[5] == -1 and not cache.filling.any() and not cache.reserved.any()
    assert held(cache) == {1: 16 + 1}
    loop.close()
    sched.close()
    sched.pool.close()


async def test_the_loop_never_plans_a_fill_into_a_slot_a_pending_graph_reads():
    import mlx.core as mx

    reader, fence, caches, sched = fake_setup(slots=3)
    reader.release.set()
    cache = caches[1]
    slots = sched.demand(1, cache, np.array([0, 1]))  # the graph-building thread routes step 0 to 0 and 1 ...
    pending = cache.bank.read(slots)["w"] + 1  # ... and builds its gather, not evaluated yet
    loop = SchedLoop()
    loop.post("plan", sched.prefetch, 1, cache, np.array([2, 3]), None)  # two slots wanted, one writable
    loop.post("plan", sched.prefetch, 1, cache, np.array([2]), 2)
    await settled(loop)
    assert (1, 1) not in sched.plans and sched.stats.dropped == 1  # not planned: nothing pending is evicted
    assert cache.bank.holds[slots].tolist() == [0, 1] and sorted(cache.bank.holds.tolist()) == [0, 1, 2]
    mx.eval(pending)
    fence.sync()  # evaluated: the loop may now write those slots
    loop.post("plan", sched.prefetch, 1, cache, np.array([3, 4]), 3)
    loop.post("cancel", sched.cancel)
    await settled(loop)
    assert {3, 4} <= set(cache.bank.holds.tolist())
    loop.close()
    sched.close()
    sched.pool.close()


def test_the_trace_has_the_loops_lane_and_summarize_reports_its_work_and_the_wait_for_it():
    import time

    from edge0.sched.summarize import summarize
    from edge0.sched.trace import Trace, now_us

    trace = Trace()
    loop = SchedLoop(trace=trace)
    t0 = now_us()
    started = threading.Event()
    loop.post("step end", lambda: (started.set(), time.sleep(0.05)), step=1)  # the loop's work for step 1 ...
    assert started.wait(5)
    loop.settle(1)  # ... which the graph-building thread waits for
    trace.span("step", "step", t0, now_us(), step=1)
    loop.close()
    data = {"traceEvents": trace.events}
    lanes = {e["tid"]: e["args"]["name"] for e in trace.events if e.get("ph") == "M"}
    work = [e for e in trace.events if e.get("cat") == "loop"]
    assert [lanes[e["tid"]] for e in work] == ["edge0-sched"] and work[0]["name"] == "step end"
    s = summarize(data)
    assert s["steps"] == 1 and 50 <= s["loop_ms_per_token"] < 1000
    assert 0 < s["loop_wait_ms_per_token"] <= s["loop_ms_per_token"] + 50  # (+ the waiter's wake-up on a busy machine)


def test_summarize_prints_the_loops_work_and_the_wait_for_it(capsys):
    from edge0.cli.trace import print_summary
    from edge0.sched.summarize import summarize
    from edge0.sched.trace import Trace

    trace = Trace()
    trace.span("step", "step", 0, 10_000, step=1)  # one 10 ms step: 3 ms of the loop's work, 2 ms waited for
    trace.span("step end", "loop", 1_000, 4_000, step=1)
    trace.span("loop wait", "sched", 5_000, 7_000, step=1)
    print_summary(summarize({"traceEvents": trace.events}))
    line = next(l for l in capsys.readouterr().out.splitlines() if "scheduler" in l)
    assert "(of which 2.00 waiting for the loop), 3.00 on the scheduler's loop" in line, line


def test_summarize_splits_a_routed_layers_scheduler_time_by_whether_it_read_on_demand(capsys):
    from edge0.cli.trace import print_summary
    from edge0.sched.summarize import summarize
    from edge0.sched.trace import Trace

    trace = Trace()
    for step, t in ((1, 0), (2, 10_000)):  # two 10 ms steps
        trace.span("step", "step", t, t + 10_000, step=step)
        trace.span("sched", "sched", t + 100, t + 120, layer=0, step=step)  # layer 0: 20 + 10 x step us, nothing read
        trace.span("sched", "sched", t + 500, t + 500 + 10 * step, layer=0, step=step)  # (30, 40 us)
        trace.span("sched", "sched", t + 1_000, t + 1_100 + 100 * step, layer=1, step=step)  # layer 1: 200, 300 us
        trace.span("stall", "stall", t + 1_300, t + 4_000, layer=1, why="demand")  # ... and a demand read
        trace.span("stall", "stall", t + 5_000, t + 6_000, layer=0, why="prefetch")  # (a wait for a plan: no demand)
        trace.span("sched", "sched", t + 9_000, t + 9_050, layer=-1, step=step)  # the step's own: no layer's
    trace.span("sched", "sched", 30_000, 30_500, layer=0, step=3)  # outside every decode step
    s = summarize({"traceEvents": trace.events})
    assert (s["layer_sched_us"], s["layer_sched_min_us"], s["layers_per_step"]) == (35.0, 30.0, 1.0)
    assert (s["demand_layer_sched_us"], s["demand_layer_sched_min_us"], s["demand_layers_per_step"]) == (250.0, 200.0,
                                                                                                        1.0)
    print_summary(s)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("layers"))
    assert ("35.0 us (1.0/step, least 30.0) of it a routed layer without a demand read, 250.0 us (1.0/step, least "
            "200.0) with one; medians") in line, line
    native = Trace()  # no scheduler at any layer (native routing): no such line
    native.span("step", "step", 0, 10_000, step=1)
    print_summary(summarize({"traceEvents": native.events}))
    assert not any(l.strip().startswith("layers") for l in capsys.readouterr().out.splitlines())
