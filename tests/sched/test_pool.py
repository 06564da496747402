"""The I/O pool's order: demand reads first, then certain planned reads, then at most SPECULATIVE guesses;
reserved threads take demand reads only; reads for later steps pause while a demand read runs or a step waits,
and the read a step waits for is promoted; a failed read's error reaches the thread that waits for it."""

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
        self.parts: list[int] = []  # experts whose read went past its pause point
        self.lock = threading.Lock()

    def cached(self, layer, expert):
        return False

    def gate(self, expert) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(expert, threading.Event())

    def read_bundle(self, layer, expert, buffers, pause=None, chunk=0):
        with self.lock:
            self.started.append(expert)
        self.gate(expert).wait()
        if pause is not None:  # a second part, after the gate: where the pool may hold it
            pause()
            with self.lock:
                self.parts.append(expert)
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


def test_reads_for_later_steps_pause_while_a_demand_read_runs():
    reader = GatedReader()
    pool = ReadPool(reader, 4)
    guess = pool.submit([ReadTask(0, 10, [], demand=False, speculative=True)])
    assert until(lambda: reader.started == [10])
    demand = pool.submit([ReadTask(0, 30, [], demand=True)])
    assert until(lambda: reader.started == [10, 30])
    reader.gate(10).set()  # the guess's first part is in: its second waits for the demand read
    assert not until(lambda: reader.parts, timeout=0.3)
    reader.gate(30).set()
    pool.finish(demand)
    pool.finish(guess)
    assert reader.parts == [10] and guess[0].record is not None
    pool.close()


def test_the_read_a_step_waits_for_is_promoted():
    """A step waiting on a queued planned read takes it first (a reserved thread reads it); a running one stops
    pausing, while the other planned reads pause until the wait is over."""
    reader = GatedReader()
    pool = ReadPool(reader, 4)  # 2 reserved: 2 threads for planned reads
    tasks = pool.submit([ReadTask(0, e, [], demand=False) for e in (10, 11, 12, 13)])
    assert until(lambda: reader.started == [10, 11])
    waiter = threading.Thread(target=pool.wait, args=([tasks[0], tasks[3]],), kwargs={"layer": 0, "why": "ready"})
    waiter.start()
    assert until(lambda: reader.started == [10, 11, 13])  # promoted past 12, on a reserved thread
    reader.gate(11).set()  # not waited for: pauses while the step waits
    assert not until(lambda: reader.parts, timeout=0.3)
    reader.gate(10).set()
    reader.gate(13).set()
    waiter.join(5)
    assert not waiter.is_alive() and tasks[0].done and tasks[3].done
    reader.gate(12).set()
    pool.finish(tasks)
    assert reader.parts[:2] in ([10, 13], [13, 10]) and sorted(reader.parts) == [10, 11, 12, 13]
    assert pool.stats.demand_loads == 0  # all four were planned
    pool.close()


def test_a_read_taken_back_stops_at_its_next_part():
    reader = GatedReader()
    pool = ReadPool(reader, 4)
    tasks = pool.submit([ReadTask(0, e, [], demand=False) for e in (10, 11, 12)])  # 2 threads: 12 waits
    assert until(lambda: reader.started == [10, 11])
    pool.cancel(tasks[1:])  # 11 runs, 12 never started
    assert tasks[2].done and tasks[2].record is None and tasks[2].error is None
    for e in (10, 11):
        reader.gate(e).set()
    pool.finish(tasks)
    assert reader.parts == [10] and reader.started == [10, 11]  # 11 stopped before its second part
    assert tasks[0].record is not None and tasks[1].record is None and tasks[1].error is None
    assert pool.stats.loads == 1
    pool.close()
