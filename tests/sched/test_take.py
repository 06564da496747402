"""Scheduler.take: a routing decided a step ahead consumed on the graph-building thread with only the wait for its
reads; its books (`consumed`) kept later, on the scheduler's loop, as `ready`, `count` and the bank's `holding` keep
them."""

import threading

import numpy as np
import pytest

from edge0.errors import Edge0Error

from tests.sched.test_sched import fake_setup, held


def planned(slots=4, ids=(2, 3), fail=()):
    """A certain plan for step 1 of layer 1 (ids), landed (step 1 now); the setup and the plan's ids array."""
    reader, fence, caches, sched = fake_setup(slots=slots)
    reader.fail = set(fail)
    reader.release.set()
    ids = np.array(ids)
    sched.prefetch(1, caches[1], ids, speculative=False)
    sched.next_step()
    return reader, caches[1], sched, ids


def books(sched, cache) -> dict:
    return {"loads": sched.stats.loads, "predicted": sched.stats.predicted, "routed": sched.stats.routed,
            "lookups": cache.stats.lookups, "hits": cache.stats.hits, "used": cache.used.tolist(),
            "reserved": cache.reserved.tolist(), "filling": cache.filling.tolist(), "in_flight": sched.in_flight,
            "holds": cache.bank.holds.tolist()}


def close(sched):
    sched.close()
    sched.pool.close()


def test_take_then_consumed_keeps_the_books_ready_count_and_holding_keep():
    _, ref_cache, ref, ref_ids = planned()
    plan = ref.ready(1)  # the full way, as before
    ref.count(plan, ref_ids)
    assert ref_cache.holding(ref_ids, plan.slots)
    _, cache, sched, ids = planned()
    got = sched.take(1, ids)
    assert got is not None and (got.slots == plan.slots).all() and (1, 1) not in sched.plans
    assert held(cache) == {2: 16 + 2, 3: 16 + 3}  # landed: the graph may read its slots now
    assert cache.reserved[got.slots].all()  # released only by its books, on the loop
    sched.consumed(got)
    assert books(sched, cache) == books(ref, ref_cache)
    close(ref)
    close(sched)


def test_a_taken_plan_keeps_its_slots_from_other_plans_until_its_books():
    import mlx.core as mx

    reader, cache, sched, ids = planned(slots=4)
    fence = cache.bank.fence
    got = sched.take(1, ids)
    sched.prefetch(1, cache, np.array([5, 6, 7]), step=2)  # two free slots, three misses: dropped
    assert (1, 2) not in sched.plans and sched.stats.dropped == 1
    pending = cache.bank.read(got.slots)["w"] + 1  # the layer's graph on them, not evaluated yet
    sched.consumed(got)
    assert sched.prefetch(1, cache, np.array([5, 6, 7]), step=2) is None  # released, but that graph reads them
    mx.eval(pending)
    fence.sync()
    assert sched.prefetch(1, cache, np.array([5, 6, 7]), step=2) is not None  # evaluated: free again
    close(sched)


def test_take_refuses_what_it_cannot_vouch_for_and_ready_raises_a_failed_read():
    _, cache, sched, ids = planned(fail=(3,))
    assert sched.take(1, np.array([2, 3])) is None  # other ids (a routing not decided ahead)
    assert sched.take(1, ids) is None  # a read failed: the full way raises it
    with pytest.raises(Edge0Error, match="read of expert 3 failed"):
        sched.ready(1)
    assert cache.slot_of[3] == -1 and not cache.reserved.any() and not cache.filling.any()
    close(sched)
    _, cache, sched, ids = planned(fail=(3,))
    sched.pool.finish([t for t in sched.plans[(1, 1)].tasks])  # landed (failed)
    with pytest.raises(Edge0Error, match="read of expert 3 failed"):
        sched.prefetch(1, cache, np.array([6]), step=2)  # collects the layer's landed reads first: 3's slot emptied
    assert sched.take(1, ids) is None  # not the plan's slots any more
    close(sched)
    reader, fence, caches, sched = fake_setup(slots=4)
    reader.release.set()
    guess = np.array([1, 2])
    sched.prefetch(0, caches[0], guess)  # a guess: the router may not follow it
    sched.next_step()
    assert sched.take(0, guess) is None and (0, 1) in sched.plans
    close(sched)


def test_take_waits_for_a_read_in_flight_as_a_stall():
    reader, fence, caches, sched = fake_setup(slots=4)
    ids = np.array([4])
    sched.prefetch(1, caches[1], ids, speculative=False)
    sched.next_step()
    got = {}
    t = threading.Thread(target=lambda: got.update(plan=sched.take(1, ids)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and reader.log == []
    reader.release.set()
    t.join()
    assert got["plan"] is not None and held(caches[1]) == {4: 16 + 4} and sched.stats.stall_s > 0.2
    sched.consumed(got["plan"])
    assert sched.in_flight == 0 and not caches[1].filling.any()
    close(sched)


class Unwalkable(list):
    """A plan's tasks that may not be walked (take's landed fast path reads its group's count instead)."""

    def __iter__(self):
        raise AssertionError("walked the plan's tasks")


def test_a_landed_plan_is_taken_from_its_groups_count_without_a_wait_or_a_walk():
    reader, cache, sched, ids = planned(ids=(2, 3, 4))
    plan = sched.plans[(1, 1)]
    sched.pool.finish(list(plan.tasks))  # landed
    assert plan.group.left == 0 and not plan.group.failed
    plan.tasks = Unwalkable(plan.tasks)
    sched.pool.wait = lambda *a, **k: pytest.fail("waited for reads that had landed")
    assert sched.take(1, ids) is plan
    plan.tasks = list.copy(plan.tasks)
    sched.consumed(plan)
    assert held(cache) == {2: 18, 3: 19, 4: 20} and sched.in_flight == 0
    close(sched)


def test_a_groups_count_says_a_read_failed_or_was_taken_back():
    _, cache, sched, ids = planned(fail=(3,))
    plan = sched.plans[(1, 1)]
    sched.pool.finish(list(plan.tasks))
    assert plan.group.left == 0 and plan.group.failed  # read of 3 failed
    assert sched.take(1, ids) is None
    close(sched)
    reader, fence, caches, sched = fake_setup(slots=4)  # reads held: the second one is still queued
    plan = sched.prefetch(1, caches[1], np.array([5, 6]), speculative=False)
    sched.pool.cancel(plan.tasks)  # (one worker: at most one read started)
    reader.release.set()
    sched.pool.finish(list(plan.tasks))
    assert plan.group.left == 0 and plan.group.failed  # taken back: its slot holds nothing
    close(sched)


@pytest.mark.parametrize("how", ["take", "ready"])
def test_a_ctrl_c_while_waiting_for_a_plans_reads_goes_on_up(how):
    """KeyboardInterrupt in the pool's wait is neither swallowed nor turned into a refusal: it reaches the caller."""
    reader, fence, caches, sched = fake_setup(slots=4)
    ids = np.array([4])
    sched.prefetch(1, caches[1], ids, speculative=False)  # its read held: the step must wait for it
    sched.next_step()

    def interrupted(*a, **k):
        reader.release.set()  # (the read lands: a swallowed interrupt would let the step go on)
        raise KeyboardInterrupt

    sched.pool.wait = interrupted
    with pytest.raises(KeyboardInterrupt):
        sched.take(1, ids) if how == "take" else sched.ready(1)
    close(sched)
