"""A streamed layer's decode step decided a step ahead, as one node over its slot bank (pipeline/prefetch.py
bank_step, model/blocks.py add_norm: Edge0MoeBlock with a table of each candidate's slot): taken at every consumer
layer's decode step, and the answers of the same step built call by call, bit for bit, whether the candidates were
read a step ahead, are read on demand under a slow disk, or outnumber the bank (the exact way)."""

import numpy as np
import pytest

from edge0.compute import kernels
from edge0.compute.executors import SlotCache
from edge0.config import EngineConfig
from edge0.engine import open_engine
from edge0.model.demo import DEMO_STORE
from edge0.pipeline.prefetch import PrefetchExperts

from .test_identity import real_text

pytestmark = pytest.mark.skipif(kernels.load() is None, reason=f"edge0 CPU kernels {kernels.reason()}")


def _logprobs(ids: list[int], fused: bool, monkeypatch, config: dict) -> tuple[np.ndarray, dict]:
    """Forced log-probabilities along ids with the one-node bank step or without it, and how often it ran. config:
    settings by path, and "demand": no fill planned a step ahead counts as holding the candidates, so every step
    reads them on demand."""
    config = dict(config)
    demand = config.pop("demand", False)
    ran = {"fused": 0, "apart": 0}
    if demand:
        monkeypatch.setattr(SlotCache, "holding", lambda self, ids, slots: False)
    bank_step = PrefetchExperts.bank_step

    def counted(self):
        got = bank_step(self) if fused else None
        ran["fused" if got is not None else "apart"] += 1
        return got

    monkeypatch.setattr(PrefetchExperts, "bank_step", counted)
    with open_engine(EngineConfig.of({"model": str(DEMO_STORE), "kernel.name": "edge0", "routing.mode": "predicted",
                                      "io.executor": "staged", "serving.prompt_cache_gib": 0, **config})) as engine:
        out = np.array(engine.forced_logprobs(ids))
        consumers = sum(e.planned_by is not None for e in engine.store.runtime.executors.values())
    monkeypatch.undo()
    return out, ran, consumers


@pytest.mark.parametrize("config", [{}, {"routing.lora": "none", "routing.candidates": 8}, {"io.throttle_mbps": 20.0},
                                    {"demand": True}],
                         ids=["default", "no-adapter-2K-candidates", "slow-disk", "read-on-demand"])
def test_a_decided_streamed_step_is_one_node_with_the_bits_of_the_step_built_call_by_call(config, monkeypatch):
    ids = real_text()
    got, ran, consumers = _logprobs(ids, True, monkeypatch, config)
    want, _, _ = _logprobs(ids, False, monkeypatch, config)
    steps = len(ids) - 2  # the first token is the prompt; every step after the first is decided a step ahead
    assert consumers >= 3 and ran["fused"] >= consumers * (steps - 1) and ran["apart"] == 0
    assert got.shape == want.shape and np.array_equal(got, want)


def test_candidates_outnumbering_the_bank_go_the_exact_way_with_the_same_answers(monkeypatch):
    """8 candidates, 4 slots: nothing fits, every consumer step is read the exact way (bank_step declines after
    beginning the step; __call__ goes on from there), and the answers are the step built call by call."""
    ids = real_text()[:40]
    got, ran, _ = _logprobs(ids, True, monkeypatch, {"routing.candidates": 8, "io.slots": 4, "routing.lora": "none"})
    want, _, _ = _logprobs(ids, False, monkeypatch, {"routing.candidates": 8, "io.slots": 4, "routing.lora": "none"})
    assert ran["fused"] == 0 and ran["apart"] > 0
    assert np.array_equal(got, want)
