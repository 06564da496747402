"""The I/O pool's order: demand reads first, then certain planned reads, then at most SPECULATIVE guesses;
reserved threads take demand reads only; a queued read a step waits for is promoted; reads not started can be
taken back; a failed read's error reaches the thread that waits for it."""

import threading

import pytest

from edge0.errors import Edge0Error
from edge0.io.pool import SPECULATIVE, ReadPool, ReadTask


class GatedReader:
    """Each read blocks until its expert's gate opens; records the order reads start in."""

    class manifest:
        bundle_bytes = 1 << 30  # never read on the caller's thread

    def __init__(self):
        self.gates: dict[int, threading.Event] = {}
        self.started: list[int] = []
        self.lock = threading.Lock()

    def cached(self, layer, expert):
        return False

    def gate(self, expert) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(expert, threading.Event())

    def read_bundle(self, layer, expert, buffers, cached=False):
        with self.lock:
            self.started.append(expert)
        self.gate(expert).wait()
        if expert < 0:
            raise Edge0Error(f"read of expert {expert} failed")
        return 1, 1.0


def until(cond, timeout=5.0):
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        done.wait(0.01)
    return cond()


def test_certain_reads_go_before_guesses_and_guesses_are_capped():
    reader = GatedReader()
    pool = ReadPool(reader, 6)  # 2 reserved for demand: 4 for planned reads
    guesses = pool.submit([ReadTask(0, 10 + i, [], demand=False, speculative=True) for i in range(4)])
    assert until(lambda: len(reader.started) == SPECULATIVE)  # the cap, although 4 threads are free for them
    certain = pool.submit([ReadTask(0, 20 + i, [], demand=False) for i in range(2)])
    assert until(lambda: set(reader.started[SPECULATIVE:]) == {20, 21})  # not the waiting guesses
    demand = pool.submit([ReadTask(0, 30 + i, [], demand=True) for i in range(2)])
    assert until(lambda: {30, 31} <= set(reader.started))  # on the reserved threads: all others are busy
    assert len(reader.started) == SPECULATIVE + 4
    for e in (10, 11, 30, 31, 20, 21):
        reader.gate(e).set()
    pool.finish(certain + demand)
    assert until(lambda: set(reader.started) == {10, 11, 12, 13, 20, 21, 30, 31})  # the other guesses, later
    reader.gate(12).set()
    reader.gate(13).set()
    pool.finish(guesses)
    assert pool.stats.loads == 8 and pool.stats.demand_loads == 2
    pool.close()


def test_a_failed_read_is_raised_where_it_is_waited_for():
    reader = GatedReader()
    pool = ReadPool(reader, 2)
    tasks = pool.submit([ReadTask(0, e, [], demand=True) for e in (-1, 5)])
    reader.gate(-1).set()
    reader.gate(5).set()
    with pytest.raises(Edge0Error, match="read of expert -1 failed"):
        pool.wait(tasks, layer=0, why="demand")
    assert all(t.done for t in tasks) and tasks[1].record is not None  # the other one finished first
    pool.close()


def test_the_read_a_step_waits_for_is_promoted_and_reads_not_started_can_be_taken_back():
    reader = GatedReader()
    pool = ReadPool(reader, 4)  # 2 reserved: 2 threads for planned reads
    tasks = pool.submit([ReadTask(0, e, [], demand=False) for e in (10, 11, 12, 13, 14)])
    assert until(lambda: reader.started == [10, 11])
    waiter = threading.Thread(target=pool.wait, args=([tasks[3]],), kwargs={"layer": 0, "why": "ready"})
    waiter.start()
    assert until(lambda: reader.started == [10, 11, 13])  # promoted past 12, on a reserved thread
    pool.cancel(tasks[1:3] + tasks[4:])  # 11 runs: left alone; 12 and 14 never start
    assert tasks[2].done and tasks[2].record is None and tasks[2].error is None and tasks[4].done
    for e in (10, 11, 13):
        reader.gate(e).set()
    waiter.join(5)
    assert not waiter.is_alive() and tasks[3].done
    pool.finish(tasks)
    assert reader.started == [10, 11, 13] and all(tasks[i].record is not None for i in (0, 1, 3))
    assert pool.stats.loads == 3 and pool.stats.demand_loads == 0  # all were planned reads
    pool.close()


def test_a_demand_read_goes_before_planned_reads_queued_earlier():
    """Every thread busy, planned reads queued, then a demand read: the first thread to come free takes the demand
    read, a planned-read thread included (the pool's first rule; the order reads start in is the reference)."""
    reader = GatedReader()
    pool = ReadPool(reader, 4)  # 2 reserved for demand reads: 2 for planned reads
    running = pool.submit([ReadTask(0, e, [], demand=False) for e in (10, 11)])
    running += pool.submit([ReadTask(0, e, [], demand=True) for e in (30, 31)])
    assert until(lambda: sorted(reader.started) == [10, 11, 30, 31])  # every thread busy
    planned = pool.submit([ReadTask(0, e, [], demand=False) for e in (12, 13)])
    demand = pool.submit([ReadTask(0, 32, [], demand=True)])
    reader.gate(10).set()  # a planned-read thread comes free first
    assert until(lambda: len(reader.started) == 5)
    assert reader.started[4] == 32, reader.started
    for e in (11, 12, 13, 30, 31, 32):
        reader.gate(e).set()
    pool.finish(running + planned + demand)
    assert sorted(reader.started[5:]) == [12, 13]
    pool.close()
