"""Predicted routing over resident experts (pipeline/resident.py): the heads decide inside the graph, nothing
syncs inside a step, and the answers are the streamed pipeline's bit for bit, on real text and in batches."""

import mlx.core as mx
import numpy as np
import pytest

from edge0.config import EngineConfig, IOConfig
from edge0.engine import open_engine
from edge0.model.arch import read_config
from edge0.model.demo import DEMO_STORE
from edge0.model.heads import Head, HeadSet
from edge0.io.manifest import read_manifest
from edge0.pipeline.resident import PredictedResidentRuntime
from edge0.decode.step import overlaps

from .test_identity import real_text


def logprobs(ids: list[int], config: dict) -> np.ndarray:
    with open_engine(EngineConfig.of(config)) as engine:
        return np.array(engine.forced_logprobs(ids))


@pytest.mark.parametrize("lora,candidates", [(None, 8), ("none", 8), ("none", 4)],
                         ids=["adapter", "no-adapter", "no-adapter-K-candidates"])
def test_resident_predicted_equals_streamed_predicted_on_real_text(lora, candidates):
    """The same candidates (the streamed default K, the resident default 2K): the same answers, bit for bit;
    the streamed executor takes the chosen K's slots in the graph."""
    ids = real_text()
    extra = {"routing.candidates": candidates} if lora is None else {"routing.lora": lora,
                                                                     "routing.candidates": candidates}
    streamed = logprobs(ids, {"routing.mode": "predicted", "io.executor": "staged", **extra})
    resident = logprobs(ids, {"routing.mode": "predicted", "io.executor": "resident", **extra})
    assert resident.shape == streamed.shape and np.array_equal(resident, streamed)
    native = logprobs(ids, {"routing.mode": "native", "io.executor": "resident",
                            "routing.lora": "none"}) if lora == "none" else None
    if native is not None:  # the heads do route: not the model's own router
        assert not np.array_equal(resident, native)


def test_a_head_owned_by_a_later_layer_routes_the_next_step(tmp_path):
    """A head for layer 0 owned by the last layer (decided after layer 0 ran this step, for the next one), beside
    the demo's heads owned by the layer before their consumer: both orders as the streamed pipeline routes."""
    manifest, config = read_manifest(DEMO_STORE), read_config(DEMO_STORE)
    heads = HeadSet.load(DEMO_STORE / "heads-k4.safetensors", manifest, config)
    last, dim = manifest.layers[-1].layer, config["hidden_size"]
    heads.heads[0] = Head(dim, manifest.num_experts, manifest.num_experts, heads.hidden)  # untrained: next-router
    heads.owners[0] = last
    mx.eval(heads.module().parameters())
    path = tmp_path / "heads-late.safetensors"
    heads.save(path)
    ids = real_text()
    streamed = logprobs(ids, {"routing.mode": "predicted", "io.executor": "staged", "routing.heads": str(path),
                              "routing.candidates": 8})
    resident = logprobs(ids, {"routing.mode": "predicted", "io.executor": "resident", "routing.heads": str(path),
                              "routing.candidates": 8})
    assert np.array_equal(resident, streamed)
    default = logprobs(ids, {"routing.mode": "predicted", "io.executor": "resident"})
    assert not np.array_equal(resident, default)  # layer 0 is routed by the new head


def test_auto_routes_predicted_over_resident_experts_where_they_fit():
    """The built-in model's default: predicted routing, every expert in memory, decode steps overlapped; a budget
    too small for them, or --slots, keeps the streamed pipeline."""
    with open_engine(EngineConfig()) as engine:
        rt = engine.store.runtime
        assert engine.config.routing.mode == "predicted" and isinstance(rt, PredictedResidentRuntime)
        assert engine.describe()["executor"] == "resident" and overlaps(rt, [])
        assert {ex.layer for ex in rt.executors.values() if ex.heads}  # the heads have owners
    for config in (EngineConfig(io=IOConfig(memory_budget_gib=0.005)), EngineConfig(io=IOConfig(slots=8))):
        with open_engine(config) as engine:
            assert engine.config.routing.mode == "predicted" and engine.store.runtime.executor == "staged"
