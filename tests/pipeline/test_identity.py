"""Prefetch is native routing, read earlier: the same log-probabilities bit for bit under every executor and
predictor, on real text (routing varies token to token) and under a slow disk (reads are still in flight
when the step that needs them runs). Predicted routing reads nothing on demand at its consumer layers."""

import json

import numpy as np
import pytest

from edge0.config import EngineConfig, IOConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.model.demo import DEMO_STORE
from edge0.sched.trace import Trace
from edge0.train.corpus import token_stream

THROTTLE = 20  # MB/s: a demo bundle (54 KiB) takes about 2.8 ms, a step's compute well under that
TOKENS = 40


def real_text(n: int = TOKENS + 16, at: int = 5000) -> list[int]:
    """Held-out standard-library source in the demo tokenizer: varied tokens, so routing varies."""
    stream, _ = token_stream(DEMO_STORE, None)
    ids = stream[at: at + n].tolist()
    assert len(set(ids[16:])) > n // 3  # not a degenerate loop
    return ids


def logprobs(ids: list[int], config: dict) -> np.ndarray:
    with open_engine(EngineConfig.of(config)) as engine:
        return np.array(engine.forced_logprobs(ids))


@pytest.fixture(scope="module")
def native():
    ids = real_text()
    return ids, logprobs(ids, {"routing.mode": "native", "io.executor": "staged"})


@pytest.mark.parametrize("config", [
    {"routing.mode": "prefetch", "routing.predictor": "next-router"},
    {"routing.mode": "prefetch", "routing.predictor": "repeat"},
    {"routing.mode": "prefetch", "routing.predictor": "heads", "io.workers": 1},
    {"routing.mode": "prefetch", "routing.predictor": "heads", "io.workers": 3},
    # the others read ahead while the gate measures it faster (and switch mid-run); this one at every step
    {"routing.mode": "prefetch", "routing.predictor": "heads", "routing.read_ahead": "always"},
    {"routing.mode": "native", "io.executor": "hot"},
    {"routing.mode": "native", "io.executor": "exact"},
], ids=lambda c: "-".join(str(v) for v in c.values()))
def test_prefetch_equals_native_on_real_text_under_a_slow_disk(native, config):
    ids, want = native
    got = logprobs(ids, {"io.throttle_mbps": THROTTLE, **config})
    assert got.shape == want.shape and np.array_equal(got, want)


def test_predicted_routing_reads_nothing_on_demand_at_consumer_layers(tmp_path):
    """From step 2 on (step 0 routes natively, step 1 is the first predicted), every consumer layer's
    experts were read during the step before: no demand read at those layers unless a plan was dropped."""
    ids = real_text()
    trace = Trace()
    with open_engine(EngineConfig(routing=RoutingConfig(mode="predicted"),
                                  io=IOConfig(executor="staged", throttle_mbps=THROTTLE)), trace=trace) as engine:
        engine.forced_logprobs(ids)
        consumers = set(engine.store.runtime.heads.owners)
        dropped = engine.store.runtime.sched.stats.dropped
    trace.save(tmp_path / "t.json")
    reads = [e["args"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("name") == "read"]
    late = [r for r in reads if r["step"] >= 2]
    assert late and dropped == 0
    assert [r for r in late if r["layer"] in consumers and r["demand"]] == []
    assert any(not r["demand"] for r in late if r["layer"] in consumers)  # they were read ahead
