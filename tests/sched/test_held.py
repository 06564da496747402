"""A layer routed by its own router with the least work on the graph-building thread: Scheduler.held looks its experts
up where the bank holds them all, and its books (`looked_up`) are kept later, on the scheduler's loop, as `ready`,
`count` and `demand_begin` keep them; a demand read's collection likewise (`demand_end`'s books)."""

import time

import numpy as np
import pytest

from edge0.errors import Edge0Error

from tests.sched.test_sched import fake_setup, held
from tests.sched.test_take import books, close


def routed_step(guess=(6, 7), hold=(2, 3)):
    """Layer 1 holds `hold` (landed); a guess of `guess` for step 2 was planned at step 1, its first read running (held
    by the fake reader), the others queued; step 2 now. Returns (reader, cache, sched, guess plan)."""
    reader, fence, caches, sched = fake_setup(slots=6)
    reader.release.set()
    sched.prefetch(1, caches[1], np.array(hold), speculative=False)
    sched.next_step()
    sched.ready(1)
    reader.release.clear()
    plan = sched.prefetch(1, caches[1], np.array(guess), rank=np.arange(8.0))
    for _ in range(1000):  # until the pool's one worker has taken the first read (and waits in it)
        if len(sched.pool._speculative) == len(guess) - 1:
            break
        time.sleep(0.001)
    sched.next_step()
    return reader, caches[1], sched, plan


def landed(reader, sched, cache):
    """Every read landed and collected (as the next plan of the layer would find them)."""
    reader.release.set()
    for p in [*sched.plans.values(), *sched.landing]:
        sched.pool.finish(list(t for t in p.tasks if t is not None))
    sched._harvest(1)
    return books(sched, cache) | {"held": held(cache), "landing": len(sched.landing)}


def test_held_then_looked_up_keeps_the_books_of_ready_count_and_demand_begin():
    ids = np.array([2, 3])
    ref_reader, ref_cache, ref, ref_plan = routed_step()
    plan = ref.ready(1)  # the full way, as before
    ref.count(plan, ids)
    ref_slots, reads = ref.demand_begin(1, ref_cache, ids)
    assert reads is None  # every routed expert held: nothing to read
    reader, cache, sched, guess = routed_step()
    later = []
    slots = sched.held(1, cache, ids, later)
    assert len(later) == 1 and (1, 2) not in sched.plans  # taken out of the plans here, released by its books
    assert (slots == ref_slots).all() and cache.reserved[guess.slots].all()
    queued = [t for t in guess.tasks if t is not None][1:]
    assert queued and not any(t.done for t in queued)  # not taken back yet: that is the books' work
    later[0]()
    assert all(t.done and t.record is None for t in queued)  # taken back: the router chose neither
    assert books(sched, cache) == books(ref, ref_cache)
    assert landed(reader, sched, cache) == landed(ref_reader, ref, ref_cache)
    close(ref)
    close(sched)


def test_held_refuses_a_miss_a_slot_being_filled_and_a_certain_plan_leaving_everything_as_it_was():
    reader, cache, sched, guess = routed_step()
    before = books(sched, cache)
    later = []
    assert sched.held(1, cache, np.array([2, 5]), later) is None  # 5 is not held: read on demand
    assert sched.held(1, cache, np.array([2, 6]), later) is None  # 6 is being read into its slot: waited for
    assert books(sched, cache) == before and sched.plans[(1, 2)] is guess and later == []
    reader.release.set()
    close(sched)
    reader, fence, caches, sched = fake_setup(slots=6)
    reader.release.set()
    plan = sched.prefetch(1, caches[1], np.array([2, 3]), speculative=False)  # a certain plan: `ready` takes it
    sched.next_step()
    sched.pool.finish(list(plan.tasks))
    sched._harvest(1)  # landed and collected: no slot filling
    assert sched.held(1, caches[1], np.array([2, 3]), []) is None and (1, 1) in sched.plans
    close(sched)


def test_a_demand_reads_collection_goes_to_the_books_and_keeps_the_same_books():
    ids = np.array([2, 4, 5])
    ref_reader, ref_cache, ref, _ = routed_step()
    ref_reader.release.set()
    ref.ready(1)
    ref.demand(1, ref_cache, ids)
    reader, cache, sched, _ = routed_step()
    reader.release.set()
    sched.ready(1)
    slots, reads = sched.demand_begin(1, cache, ids)
    later = []
    sched.demand_end(reads, later)
    assert len(later) == 1 and cache.filling[[s for s, _ in reads.fills]].all()  # landed, not yet collected
    assert held(cache)[4] == 16 + 4 and held(cache)[5] == 16 + 5  # the graph may read them now
    later[0]()
    assert books(sched, cache) == books(ref, ref_cache)
    close(ref)
    close(sched)


def test_a_failed_demand_read_is_collected_and_raised_there_not_left_to_the_books():
    reader, cache, sched, _ = routed_step()
    reader.fail = {5}
    reader.release.set()
    sched.ready(1)
    slots, reads = sched.demand_begin(1, cache, np.array([2, 5]))
    later = []
    with pytest.raises(Edge0Error, match="read of expert 5 failed"):
        sched.demand_end(reads, later)
    assert later == [] and cache.slot_of[5] == -1 and not cache.filling[[s for s, _ in reads.fills]].any()
    close(sched)
