"""The scheduler: prefetch keeps native outputs, fills run on the pool, plans behave, traces add up."""

import json
import threading

import numpy as np
import pytest

from edge0.cli import main
from edge0.compute.banks import Bank, Fence
from edge0.compute.executors import SlotCache, SlotStats
from edge0.errors import Edge0Error
from edge0.io.manifest import Piece
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
    for flags in (["--predictor", "repeat"], ["--predictor", "next-router", "--io-workers", "1"],
                  ["--predictor", "next-router", "--io-workers", "3", "--cold"]):
        got = run_json(store, "--routing", "prefetch", *flags)
        assert got["tokens"] == want, flags
        assert got["loads"] > 0 and 0 < got["recall"] <= 1


def test_fills_run_on_pool_threads_and_trace_matches_json(models, tmp_path, capsys):
    trace = tmp_path / "run.json"
    result = run_json(models("qwen3_moe"), "--routing", "prefetch", "--cold", trace=trace)
    events = json.loads(trace.read_text())["traceEvents"]
    reads = [e for e in events if e.get("name") == "read"]
    assert reads and all(e["args"]["thread"].startswith("edge0-io") for e in reads)
    computes = [e for e in events if e.get("name", "").startswith("eval L")]
    assert computes and all(e["args"]["thread"] == "main" for e in computes)
    assert main(["trace", "summarize", str(trace), "--json", "--plot", str(tmp_path / "t.png")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["loads"] == result["loads"]
    assert summary["load_bytes"] == result["load_bytes"]
    assert summary["recall"] == pytest.approx(result["recall"])
    assert summary["stall_ms_per_token"] == pytest.approx(result["stall_ms_per_token"], rel=1e-3, abs=1e-3)
    assert summary["cold_fraction"] == pytest.approx(result["load_cold_fraction"], abs=1e-6)
    assert (tmp_path / "t.png").stat().st_size > 10_000


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


class FakeReader:
    """Writes a recognisable pattern per (layer, expert); blocks each read until released."""

    def __init__(self):
        self.piece = Piece(name="w", dtype="U8", shape=[16], offset=0, nbytes=16)
        self.release = threading.Event()
        self.log = []
        self.fail = set()  # experts whose read raises

    def read_bundle(self, layer, expert, buffers):
        self.release.wait()
        if expert in self.fail:
            raise Edge0Error(f"layer {layer}: read of expert {expert} failed")
        buffers[0][:] = bytes([layer * 16 + expert]) * 16
        self.log.append((layer, expert, threading.current_thread().name))
        return 16, 0.0


def fake_setup(slots=2):
    reader = FakeReader()
    fence = Fence()
    caches = [SlotCache(Bank([reader.piece], slots, fence), SlotStats(), 8) for _ in range(2)]
    return reader, fence, caches, Scheduler(reader, workers=1)


def test_prefetch_is_submitted_ahead_and_consumed_only_when_landed():
    reader, fence, caches, sched = fake_setup()
    sched.prefetch(1, caches[1], np.array([2, 3]))  # during step 0, for step 1
    assert sched.pending == 1 and reader.log == []  # submitted, not landed: the reads wait on the pool
    reader.release.set()
    sched.next_step()
    plan = sched.ready(1)  # step 1 consumes it: returns only after the fill landed
    assert plan.future.done() and sorted(e for _, e, _ in reader.log) == [2, 3]
    assert all(name.startswith("edge0-io") for _, _, name in reader.log)
    arr = np.array(caches[1].bank.arrays["w"])
    assert sorted(arr[:, 0].tolist()) == [16 + 2, 16 + 3]
    slots = sched.demand(1, caches[1], np.array([3, 5]))  # one hit, one miss read on demand
    assert sorted(e for _, e, _ in reader.log) == [2, 3, 5]
    assert np.array(caches[1].bank.arrays["w"])[slots[1], 0] == 16 + 5
    sched.count(plan, np.array([3, 5]))
    assert sched.stats.recall == 0.5
    sched.close()


def test_cancel_leaves_no_pending_reads():
    reader, fence, caches, sched = fake_setup()
    sched.prefetch(1, caches[1], np.array([0, 1]))
    sched.prefetch(2, caches[0], np.array([4]))
    assert sched.pending == 2
    reader.release.set()
    sched.cancel()
    assert sched.pending == 0 and sched.plans == {}
    assert len(reader.log) == 3  # every read in flight finished before cancel returned: no late writes
    sched.close()


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
    sched.plans.clear()
    sched.step += 1
    sched.prefetch(1, cache, np.array([3, 4]))  # needs two slots, only one can be written: not planned
    assert (1, 2) not in sched.plans and sorted(cache.bank.holds.tolist()) == [0, 1, 2]
    mx.eval(pending)
    fence.sync()
    sched.prefetch(1, cache, np.array([3, 4]))  # evaluated: every slot is writable again
    sched.cancel()
    assert {3, 4} <= set(cache.bank.holds.tolist())
    sched.close()


def test_a_failed_fill_empties_its_slots_and_reset_starts_over():
    reader, fence, caches, sched = fake_setup(slots=3)
    reader.release.set()
    reader.fail = {5}
    cache = caches[1]
    sched.demand(1, cache, np.array([0, 1]))
    sched.prefetch(1, cache, np.array([1, 5]))  # for step 1: 1 is held, 5 fails on the worker
    sched.next_step()
    with pytest.raises(Edge0Error, match="read of expert 5 failed"):
        sched.ready(1)  # the worker's error, raised where the step consumes the fill
    assert cache.slot_of[5] == -1 and 5 not in cache.bank.holds.tolist() and not cache.filling.any()
    assert cache.bank.holds[cache.slot_of[[0, 1]]].tolist() == [0, 1]  # fully read slots are kept
    sched.prefetch(1, cache, np.array([5]))  # fails again, and nobody consumes it
    sched.reset()  # a new generation
    assert sched.step == 0 and sched.plans == {} and sched.pending == 0 and sched.in_flight == 0
    assert cache.slot_of[5] == -1 and not cache.filling.any()
    reader.fail = set()
    slots = sched.demand(1, cache, np.array([5]))
    assert np.array(cache.bank.arrays["w"])[slots[0], 0] == 16 + 5
    sched.close()
