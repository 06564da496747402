"""--placement under streamed predicted routing: the layers no head routes hold every expert within the memory the
even banks would take, route by their own router with no read and no host sync, and answer bit for bit as the
even placement does."""

import numpy as np
import pytest

from edge0.compute import kernels
from edge0.compute.runtime import streamed_slots
from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.errors import Edge0Error
from edge0.decode.request import GenRequest
from edge0.pipeline.gate import CertainReads, ReadAheadGate
from edge0.pipeline.prefetch import PrefetchExperts

from .test_identity import real_text
from .test_pause import private_config

ON_HOST = PrefetchExperts._on_host  # the routed ids to the host: a layer's sync inside a step
ROUTED = {2, 3, 4}  # the demo's heads route layers 2-4; layers 0, 1 and 5 route by their own router


def _run(ids, monkeypatch, config: dict) -> tuple[np.ndarray, dict, set, set]:
    """Forced log-probabilities, describe(), and the layers that synced with the host / read on demand."""
    synced, demanded = set(), set()

    def record_sync(self, inds):
        synced.add(self.layer)
        return ON_HOST(self, inds)

    monkeypatch.setattr(PrefetchExperts, "_on_host", record_sync)
    with open_engine(EngineConfig.of({"routing.mode": "predicted", "io.executor": "staged"} | config)) as engine:
        sched = engine.store.runtime.sched
        begin = sched.demand_begin

        def record_demand(layer, cache, ids):
            demanded.add(layer)
            return begin(layer, cache, ids)

        sched.demand_begin = record_demand
        lp = np.array(engine.forced_logprobs(ids))
        return lp, engine.describe() | {"bytes": engine.store.runtime.resident_expert_bytes}, synced, demanded


@pytest.mark.parametrize("slots,streamed", [(20, 8), (32, 32)], ids=["shared", "every-expert-everywhere"])
def test_held_layers_answer_as_the_even_banks_with_no_read_or_sync_inside_a_step(monkeypatch, slots, streamed):
    """20 slots a layer: layers 0, 1, 5 hold their 32 experts, layers 2-4 share the rest (8 slots each), the same
    bytes as 20 everywhere. 32: every bank could hold every expert, and still layers 0, 1, 5 would route through the
    host at every step; held, they do not. The same log-probabilities bit for bit on real text; the held layers never
    wait for the host or the disk, where with even banks they do both (while they read ahead: the read-ahead gate's
    first steps do here, as they did before its default became paused first steps; a paused layer routes as the
    staged executor)."""
    monkeypatch.setattr(ReadAheadGate, "FIRST_AHEAD", True)
    ids = real_text()
    held, d_held, synced_held, demanded_held = _run(ids, monkeypatch, {"io.slots": slots})
    even, d_even, synced_even, demanded_even = _run(ids, monkeypatch, {"io.slots": slots, "io.placement": "even"})
    assert d_held["held_layers"] == [0, 1, 5] and d_held["slots"] == streamed
    assert d_even["held_layers"] is None and d_even["slots"] == slots
    assert d_held["bytes"] == d_even["bytes"]  # the same memory, placed otherwise
    assert held.shape == even.shape and np.array_equal(held, even)
    assert {0, 1, 5} <= synced_even and {0, 1, 5} <= demanded_even
    assert not synced_held & {0, 1, 5} and not demanded_held & {0, 1, 5}
    assert demanded_held <= ROUTED


@pytest.mark.parametrize("slots", [20, 32])
def test_a_prompt_reads_no_held_layer(monkeypatch, slots):
    """A prompt reads each streamed layer whole, the next one's read starting as the one before computes; layers 0, 1
    and 5 hold every expert and are read by none (layer 5 was once read after layer 4, a whole layer for nothing, the
    prompt then waiting for it)."""
    from edge0.compute.executors import WholeLayer

    started = []
    start = WholeLayer._start

    def record(self, layer, in_use=None):
        started.append(layer)
        return start(self, layer, in_use)

    monkeypatch.setattr(WholeLayer, "_start", record)
    with open_engine(EngineConfig(routing=RoutingConfig(mode="predicted"),
                                  io=IOConfig(executor="staged", slots=slots))) as engine:
        assert engine.describe()["held_layers"] == [0, 1, 5]
        engine.generate(GenRequest(prompt=real_text()[:48], max_tokens=2))
    assert started == [2, 3, 4]


@pytest.mark.parametrize("config", [{"io.slots": 16}, {"io.slots": 20, "routing.candidates": 8},
                                    {"io.slots": 20, "routing.mode": "prefetch", "routing.predictor": "next-router"}],
                         ids=["too-few-slots-left", "too-few-for-2M", "no-heads"])
def test_no_layer_is_held_where_the_rest_would_be_starved_or_no_head_tells_the_layers_apart(config):
    """16 slots a layer leave none to the routed layers once three hold 32; 20 leave 8, under twice 8 candidates;
    prefetch by the next layer's router has no heads to tell which layers read ahead well."""
    c = {"routing.mode": "predicted", "io.executor": "staged"} | config
    with open_engine(EngineConfig.of(c)) as engine:
        assert engine.describe()["held_layers"] is None
        assert engine.describe()["slots"] == config["io.slots"]


def test_prefetch_by_heads_holds_the_layers_of_weak_heads_and_stays_token_identical_to_native(monkeypatch):
    """Under prefetch routing every layer's router decides; the heads that would not route (none for layers 0, 1, 5 on
    the demo) name the layers to hold: the log-probabilities stay native's bit for bit, the held layers never sync
    (the others do while they read ahead: the read-ahead gate's first steps do here, as they did before its default
    became paused first steps; a paused layer routes as the staged executor)."""
    monkeypatch.setattr(ReadAheadGate, "FIRST_AHEAD", True)
    ids = real_text()
    lp, described, synced, demanded = _run(ids, monkeypatch, {"io.slots": 20, "routing.mode": "prefetch",
                                                              "routing.predictor": "heads"})
    assert described["held_layers"] == [0, 1, 5]
    assert not synced & {0, 1, 5} and not demanded & {0, 1, 5} and synced == ROUTED
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native", lora="none"),
                                  io=IOConfig(executor="resident"))) as engine:
        native = np.array(engine.forced_logprobs(ids))
    assert np.array_equal(lp, native)


@pytest.mark.parametrize("placement", ["auto", "even"])
def test_with_nothing_guessed_every_step_reads_ahead_from_the_disk(placement):
    """Held layers leave predicted routing nothing to guess: each read ahead is one the step makes, so the measured
    gate does not pause (pausing would only start the reads at the step's end); with even banks layers 0, 1 and 5 are
    guessed ahead and the gate measures a paused window."""
    with open_engine(private_config({"routing.mode": "predicted", "io.executor": "staged", "io.slots": 20,
                                     "io.placement": placement, "io.mode": "direct", "io.cold": True})) as engine:
        # (cold: evicts the pages of a copy no other test reads)
        rt = engine.store.runtime
        engine.forced_logprobs(real_text()[:48])
        assert isinstance(rt.gate, CertainReads) == (placement == "auto")
        assert (rt.paused_steps == 0) == (placement == "auto") and rt.flushed_steps >= 40


def test_streamed_slots_share_what_the_held_layers_leave():
    assert streamed_slots(20, 6, 3, 32) == 8
    assert streamed_slots(24, 6, 2, 32) == 20
    assert streamed_slots(32, 6, 3, 32) == 32  # every expert everywhere: nothing changes
    assert streamed_slots(30, 4, 1, 32) == 29
    assert streamed_slots(8, 6, 6, 32) == 0


def test_a_bad_placement_is_refused_by_name(capsys):
    """Not a placement (the library names the setting), or one given where nothing is placed (native routing): one
    line naming the flag."""
    from edge0.cli import main

    with pytest.raises(Edge0Error, match="placement uneven: choose auto, even"):
        EngineConfig(io=IOConfig(placement="uneven")).check()
    assert main(["run", "--routing", "native", "--placement", "even", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--placement even: only used with --routing prefetch or predicted" in err and "Traceback" not in err


@pytest.mark.skipif(not kernels.available(), reason=f"edge0 CPU kernels {kernels.reason()}")
def test_held_layers_queue_their_block_node_as_it_is_built(monkeypatch):
    """A held layer's block node (the edge0 kernel's) is queued as it is built, as a streamed layer's is: the stream
    starts a step's first layers while the graph-building thread builds the next (they waited for the first streamed
    layer's queue)."""
    import edge0.model.blocks as blocks

    queued, last, real = [], {}, blocks.queue
    monkeypatch.setattr(blocks, "queue", lambda *a: queued.append(last.get("layer")) or real(*a))
    with open_engine(EngineConfig(routing=RoutingConfig(mode="predicted"), io=IOConfig(executor="staged", slots=20),
                                  kernel=KernelConfig(name="edge0"))) as engine:
        assert engine.describe()["held_layers"] == [0, 1, 5]
        for layer, ex in engine.store.runtime.executors.items():
            def routed(x, inds, layer=layer, orig=ex.routed):  # a block's routed ids, just before its queue
                last["layer"] = layer
                return orig(x, inds)
            ex.routed = routed
        engine.forced_logprobs(real_text(32))
    assert {0, 1, 5} <= set(queued)
