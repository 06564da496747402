"""The scheduler: prefetch keeps native outputs, fills run on the pool, plans behave, traces add up."""

import json
import threading
import time

import numpy as np
import pytest

from edge0.cli import main
from edge0.compute.banks import Bank, Fence
from edge0.compute.executors import SlotCache, SlotStats
from edge0.errors import Edge0Error
from edge0.io.manifest import Piece
from edge0.io.pool import ReadPool
from edge0.sched.scheduler import Scheduler

from tests import helpers
from tests.conftest import ARCHS

PROMPT = "import os\nimport sys\n" * 6


def run_json(store, *flags, trace=None):
    return helpers.run_json("--model", str(store), "--max-tokens", "24", "--ignore-eos", "--prompt", PROMPT, *flags,
                            *(["--trace", str(trace)] if trace else []))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefetch_gives_native_tokens(models, arch):
    store = models(arch)
    want = run_json(store, "--routing", "native", "--executor", "staged")["tokens"]
    # --read-ahead always: every step reads ahead (the measured gate's first steps are paused: a short run would read
    # nothing ahead; a prompt read from the page cache would pause them too, test_pause.py)
    for flags in (["--predictor", "repeat"], ["--predictor", "next-router", "--io-workers", "1"],
                  ["--predictor", "next-router", "--io-workers", "3", "--io-throttle", "5"]):
        flags = [*flags, "--read-ahead", "always"]
        got = run_json(store, "--routing", "prefetch", *flags)
        assert got["tokens"] == want, flags
        assert got["loads"] > 0 and 0 < got["recall"] <= 1


def read_spans(trace) -> list[dict]:
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "read"]


def test_fills_run_on_pool_threads_and_trace_matches_json(models, tmp_path, capsys):
    warm = tmp_path / "warm.json"
    run_json(models("qwen3_moe"), "--routing", "prefetch", trace=warm)
    reads = [e for e in read_spans(warm) if not e["args"]["whole_layer"]]
    assert reads and all(e["args"]["cold"] == 0 and e["args"]["thread"] == "main" for e in reads)  # cached: on the spot
    trace = tmp_path / "run.json"
    result = run_json(models("qwen3_moe"), "--routing", "prefetch", "--io", "direct", trace=trace)
    ahead = [e for e in read_spans(trace) if not e["args"]["demand"]]
    assert ahead and all(e["args"]["cold"] == 1 and e["args"]["thread"].startswith("edge0-io") for e in ahead)
    events = json.loads(trace.read_text())["traceEvents"]
    computes = [e for e in events if e.get("name", "").startswith("eval L")]
    assert computes and all(e["args"]["thread"] == "main" for e in computes)
    assert main(["trace", "summarize", str(trace), "--json", "--plot", str(tmp_path / "t.png")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["loads"] == result["loads"]
    assert summary["load_bytes"] == result["load_bytes"]
    assert summary["recall"] == pytest.approx(result["recall"])
    assert summary["stall_ms_per_token"] == pytest.approx(result["stall_ms_per_token"], rel=1e-3, abs=1e-3)
    assert summary["cold_fraction"] == pytest.approx(result["load_cold_fraction"], abs=1e-6)
    prompt_ms = 1e3 * result["prompt_tokens"] / result["prefill_tok_s"]
    assert 0 < summary["prompt_last_step_ms"] < prompt_ms  # inside the prompt's time
    assert summary["prompt_last_step_ms"] > summary["step_ms"] / 20  # a whole step, not a span inside one
    assert (tmp_path / "t.png").stat().st_size > 10_000
    assert main(["trace", "summarize", str(trace), "--json", "--windows", "3"]) == 0  # per 3 decode steps
    rows = json.loads(capsys.readouterr().out)["windows"]
    assert [w["first_step"] for w in rows] == list(range(1, summary["steps"] + 1, 3))
    assert sum(w["steps"] for w in rows) == summary["steps"]
    loads = summary["loads_per_step"] * summary["steps"]
    assert sum(w["loads_per_step"] * w["steps"] for w in rows) == pytest.approx(loads)
    assert sum(w["stall_ms_per_step"] * w["steps"] for w in rows) == pytest.approx(
        summary["stall_ms_per_token"] * summary["steps"], rel=1e-6)
    assert all(w["min_step_ms"] <= w["step_ms"] <= w["max_step_ms"] for w in rows)
    assert main(["trace", "summarize", str(trace), "--windows", "2"]) == 0
    assert "| 1-2 |" in capsys.readouterr().out


def test_bad_trace_files(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["trace", "summarize", str(bad)]) == 2
    assert "invalid JSON" in capsys.readouterr().err
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"traceEvents": []}))
    assert main(["trace", "summarize", str(foreign)]) == 2
    assert "not an Edge0 trace" in capsys.readouterr().err
    assert main(["trace", "summarize", str(tmp_path / "none.json")]) == 2
    assert "no such trace file" in capsys.readouterr().err
    bad.write_text("[" * 100000 + "]" * 100000)
    assert main(["trace", "summarize", str(bad)]) == 2
    assert "JSON nested too deep" in capsys.readouterr().err
    assert main(["trace", "summarize", str(bad), "--windows", "0"]) == 2
    assert "--windows 0: must be at least 1" in capsys.readouterr().err
    from edge0.sched.trace import FORMAT

    def trace_of(*events):
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"traceEvents": list(events), "otherData": {"format": FORMAT}}))
        return str(path)

    bare = {"ph": "X", "name": "step", "ts": 0, "dur": 5000}  # args are optional in the format: a decode step
    assert main(["trace", "summarize", trace_of(bare, {**bare, "ts": 9000}), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["steps"] == 2 and got["prompt_last_step_ms"] is None
    assert main(["trace", "summarize", trace_of({**bare, "args": [1]})]) == 2
    assert "args is not an object" in capsys.readouterr().err
    sched = {"ph": "X", "name": "sched", "cat": "sched", "ts": 100, "dur": 20}  # a layer's scheduler work in step 1
    for args, key in (({"layer": "x", "step": 1}, "layer"), ({"layer": 2, "step": "1"}, "step")):
        assert main(["trace", "summarize", trace_of({**bare, "args": {"step": 1}}, {**sched, "args": args})]) == 2
        assert f"args.{key} is not an integer" in capsys.readouterr().err


class FakeReader:
    """Writes a recognisable pattern per (layer, expert); blocks each read until released."""

    def __init__(self):
        self.piece = Piece(name="w", dtype="U8", shape=[16], offset=0, nbytes=16)
        self.release = threading.Event()
        self.log = []
        self.fail = set()  # experts whose read raises

    class manifest:
        bundle_bytes = 16

    def cached(self, layer, expert):
        return False  # every read a cold one: prefetches go to the pool's threads

    def read_bundle(self, layer, expert, buffers, cached=False):
        self.release.wait()
        if expert in self.fail:
            raise Edge0Error(f"layer {layer}: read of expert {expert} failed")
        buffers[0][:] = bytes([layer * 16 + expert]) * 16
        self.log.append((layer, expert, threading.current_thread().name))
        return 16, 0.0


def fake_setup(slots=2, workers=1):
    reader = FakeReader()
    fence = Fence()
    caches = [SlotCache(Bank([reader.piece], slots, fence), SlotStats(), 8) for _ in range(2)]
    return reader, fence, caches, Scheduler(ReadPool(reader, workers))


def held(cache) -> dict[int, int]:
    """expert -> the first byte its slot holds."""
    arr = np.array(cache.bank.arrays["w"])
    return {int(e): int(arr[s, 0]) for s, e in enumerate(cache.bank.holds) if e >= 0}


def test_prefetch_is_submitted_ahead_and_consumed_only_when_landed():
    reader, fence, caches, sched = fake_setup()
    sched.prefetch(1, caches[1], np.array([2, 3]), speculative=False)  # during step 0, for step 1: certain
    assert sched.pending == 1 and reader.log == []  # submitted, not landed: the reads wait on the pool
    reader.release.set()
    sched.next_step()
    plan = sched.ready(1)  # step 1 consumes it: returns only after the fill landed
    assert plan.tasks == [] and sorted(e for _, e, _ in reader.log) == [2, 3]  # collected
    assert all(name.startswith("edge0-io") for _, _, name in reader.log)
    assert held(caches[1]) == {2: 16 + 2, 3: 16 + 3}
    slots = sched.demand(1, caches[1], np.array([3, 5]))  # one hit, one miss read on demand
    assert sorted(e for _, e, _ in reader.log) == [2, 3, 5]
    assert np.array(caches[1].bank.arrays["w"])[slots[1], 0] == 16 + 5
    sched.count(plan, np.array([3, 5]))
    assert sched.stats.recall == 0.5
    assert sched.pool.stats.loads == 3 and sched.pool.stats.demand_loads == 1
    sched.close()
    sched.pool.close()


def test_ready_waits_for_a_read_in_flight():
    """ready() returns only once the planned bytes are in the slot: the read is held until released."""
    reader, fence, caches, sched = fake_setup()
    sched.prefetch(1, caches[1], np.array([4]), speculative=False)
    sched.next_step()
    got = {}
    t = threading.Thread(target=lambda: got.update(plan=sched.ready(1)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and reader.log == []  # still waiting: the read has not happened
    reader.release.set()
    t.join()
    assert held(caches[1]) == {4: 16 + 4} and sched.stats.stall_s > 0.2
    sched.close()
    sched.pool.close()


def test_a_guess_is_waited_for_only_where_the_router_chose_it():
    """A speculative plan is consumed without waiting; the layer then waits for the read of the guessed expert it
    routed to, and the guesses it did not route to that have not started are never read."""
    reader, fence, caches, sched = fake_setup(slots=4, workers=1)
    cache = caches[1]
    sched.prefetch(1, cache, np.array([2, 3, 4]))  # a guess (the default), for step 1
    sched.next_step()
    plan = sched.ready(1)
    assert plan is not None and sched.pending == 1 and reader.log == []  # consumed; nothing has landed
    got = {}
    t = threading.Thread(target=lambda: got.update(slots=sched.demand(1, cache, np.array([2, 5]))))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # waiting for the read of 2, the guess it routed to
    reader.release.set()
    t.join()
    assert sorted(e for _, e, _ in reader.log) == [2, 5]  # 3 and 4 were taken back before they started
    assert held(cache) == {2: 16 + 2, 5: 16 + 5} and got["slots"].tolist() == [cache.slot_of[2], cache.slot_of[5]]
    assert sched.pending == 0 and sched.in_flight == 0 and not cache.filling.any()
    sched.close()
    sched.pool.close()


def test_a_slot_being_filled_is_never_given_to_another_read_and_its_expert_is_waited_for():
    """While a prefetch into a slot is in flight, a demand read takes another slot, and a demand for the
    expert in flight waits for that read (it does not read it again, nor gather before it landed)."""
    reader, fence, caches, sched = fake_setup(slots=2, workers=2)
    cache = caches[0]
    sched.prefetch(0, cache, np.array([6]))  # for step 1; its read blocks
    filling = int(cache.slot_of[6])
    assert cache.filling[filling] and cache.reserved[filling]
    slots = None
    got = {}
    t = threading.Thread(target=lambda: got.update(slots=sched.demand(0, cache, np.array([1]))))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # its read is blocked too, on another slot
    reader.release.set()
    t.join()
    slots = got["slots"]
    deadline = time.monotonic() + 10  # the prefetch of 6 lands on its worker, maybe after the demand returned
    while held(cache) != {6: 6, 1: 1} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slots[0] != filling and held(cache) == {6: 6, 1: 1}
    sched.next_step()
    reader.release.clear()
    assert sched.demand(0, cache, np.array([6])).tolist() == [filling]  # landed before: a hit, no read
    assert sorted(e for _, e, _ in reader.log) == [1, 6]
    sched.close()
    sched.pool.close()


def test_cancel_leaves_no_pending_reads():
    reader, fence, caches, sched = fake_setup()
    sched.prefetch(1, caches[1], np.array([0, 1]))
    sched.prefetch(2, caches[0], np.array([4]))
    assert sched.pending == 2
    reader.release.set()
    sched.cancel()
    assert sched.pending == 0 and sched.plans == {} and sched.in_flight == 0
    assert len(reader.log) == 3  # every read in flight finished before cancel returned: no late writes
    assert not caches[0].reserved.any() and not caches[1].reserved.any()
    sched.close()
    sched.pool.close()


def test_prefetch_never_fills_a_slot_a_pending_graph_reads():
    import mlx.core as mx

    reader, fence, caches, sched = fake_setup(slots=3)
    reader.release.set()
    cache = caches[1]
    slots = sched.demand(1, cache, np.array([0, 1]))  # step 0 routes to 0 and 1 ...
    pending = cache.bank.read(slots)["w"] + 1  # ... and builds its gather (not evaluated yet)
    sched.prefetch(1, cache, np.array([1, 2]))  # for step 1: 1 is held; 2 may only go to the third slot
    sched.cancel()
    assert cache.bank.holds[slots].tolist() == [0, 1] and sorted(cache.bank.holds.tolist()) == [0, 1, 2]
    sched.step += 1
    sched.prefetch(1, cache, np.array([3, 4]))  # needs two slots, only one can be written: not planned
    assert (1, 2) not in sched.plans and sorted(cache.bank.holds.tolist()) == [0, 1, 2]
    assert sched.stats.dropped == 1
    mx.eval(pending)
    fence.sync()
    sched.prefetch(1, cache, np.array([3, 4]))  # evaluated: every slot is writable again
    sched.cancel()
    assert {3, 4} <= set(cache.bank.holds.tolist())
    sched.close()
    sched.pool.close()


def test_a_plan_for_the_next_step_keeps_the_slots_this_step_will_read():
    """Predicted routing plans step s+1 before layer L has read its step-s slots: those are reserved."""
    reader, fence, caches, sched = fake_setup(slots=4)
    reader.release.set()
    cache = caches[0]
    sched.prefetch(0, cache, np.array([0, 1]), step=1)  # planned at step 0 for step 1
    sched.next_step()
    now = set(cache.slot_of[[0, 1]].tolist())
    sched.prefetch(0, cache, np.array([2, 3]))  # for step 2, before step 1's layer 0 consumed its plan
    assert sorted(cache.bank.holds.tolist()) == [0, 1, 2, 3] and set(cache.slot_of[[0, 1]].tolist()) == now
    assert sched.prefetch(0, cache, np.array([4, 5]), step=3) is None  # no free slot: dropped, nothing evicted
    plan = sched.ready(0)
    deadline = time.monotonic() + 10  # the fills land on their workers
    while held(cache) != {0: 0, 1: 1, 2: 2, 3: 3} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert plan.step == 1 and held(cache) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert cache.reserved[cache.slot_of[[2, 3]]].all() and not cache.reserved[cache.slot_of[[0, 1]]].any()
    sched.close()
    sched.pool.close()


def test_a_failed_fill_empties_its_slots_and_reset_starts_over():
    reader, fence, caches, sched = fake_setup(slots=3)
    reader.release.set()
    reader.fail = {5}
    cache = caches[1]
    sched.demand(1, cache, np.array([0, 1]))
    sched.prefetch(1, cache, np.array([1, 5]), speculative=False)  # for step 1: 1 is held, 5 fails
    sched.next_step()
    with pytest.raises(Edge0Error, match="read of expert 5 failed"):
        sched.ready(1)  # the worker's error, raised where the step consumes the fill
    assert cache.slot_of[5] == -1 and 5 not in cache.bank.holds.tolist() and not cache.filling.any()
    assert cache.bank.holds[cache.slot_of[[0, 1]]].tolist() == [0, 1]  # fully read slots are kept
    sched.prefetch(1, cache, np.array([5]))  # fails again, and nobody consumes it
    sched.reset()  # a new generation
    assert sched.step == 0 and sched.plans == {} and sched.pending == 0 and sched.in_flight == 0
    assert cache.slot_of[5] == -1 and not cache.filling.any() and not cache.reserved.any()
    reader.fail = set()
    slots = sched.demand(1, cache, np.array([5]))
    assert np.array(cache.bank.arrays["w"])[slots[0], 0] == 16 + 5
    sched.close()
    sched.pool.close()
