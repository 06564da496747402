"""--evict on the demo store with routing forced from a trace: a staged run's slot hits are the replay's
(compute/eviction.py) for the trace's decode rows, under each policy, and lfu hits more than lru on skewed routing."""

import numpy as np
import pytest

from edge0.compute.eviction import replay, trace_hit_rates
from edge0.config import EngineConfig, IOConfig, RoutingConfig, ServingConfig
from edge0.engine import open_engine
from edge0.io.routetrace import RouteTrace
from edge0.model.traced import TracedRouting

PROMPT = [317, 288, 1350, 269, 1245, 488, 10, 80, 302, 275, 306, 299]  # the demo prompt's ids
LAYERS, EXPERTS, K = 6, 32, 4  # the demo store's
TOKENS = 40


def _skewed_trace(rows: int, skew: float = 1.0, seed: int = 5) -> RouteTrace:
    """Each layer's experts drawn by a popularity of 1 / rank ** skew (a different order per layer), 4 distinct a
    row."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, EXPERTS + 1) ** skew
    ids = np.stack([[rng.choice(EXPERTS, K, replace=False, p=p / p.sum()) for _ in range(rows)]
                    for _ in range(LAYERS)])
    perm = np.stack([rng.permutation(EXPERTS) for _ in range(LAYERS)])
    return RouteTrace(np.take_along_axis(perm[:, None, :].repeat(rows, 1), ids, 2).astype(np.int32), None,
                      list(range(LAYERS)), num_experts=EXPERTS)


def test_a_staged_run_hits_what_the_replay_of_its_trace_hits():
    trace = _skewed_trace(len(PROMPT) + TOKENS)
    decode = trace.ids[:, len(PROMPT) - 1:len(PROMPT) + TOKENS - 1]  # rows the banks serve: the prompt's last, each step's
    hits = {}
    for policy in ("lru", "lfu"):
        config = EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="staged", evict=policy),
                              serving=ServingConfig(prompt_cache_gib=0))
        with open_engine(config) as engine:
            TracedRouting(engine.store.model, trace=trace, record=False, what="--routes t")
            stats = engine.store.runtime.stats
            engine.generate(engine.request(PROMPT, max_tokens=TOKENS, ignore_eos=True))
            hits[policy] = stats.hits
            slots = engine.store.runtime.banks[0].slots
            want = [replay(layer, slots, policy, num_keys=EXPERTS) for layer in decode]
            assert (stats.hits, stats.lookups) == (sum(h for h, _ in want), sum(n for _, n in want)), policy
    assert hits["lfu"] > hits["lru"]


def test_a_hot_run_hits_what_the_shared_replay_of_its_trace_hits():
    """--executor hot: one bank of every layer's bundles, looked up layer after layer; lfu decays per layer step and
    keeps the last token's experts of every layer (uniform routing, where that changes the hits)."""
    trace = _skewed_trace(len(PROMPT) + TOKENS, skew=0.0, seed=6)
    decode = trace.ids[:, len(PROMPT) - 1:len(PROMPT) + TOKENS - 1]
    for policy in ("lru", "lfu"):
        config = EngineConfig(routing=RoutingConfig(mode="native"),
                              io=IOConfig(executor="hot", memory_budget_gib=0.012, evict=policy),
                              serving=ServingConfig(prompt_cache_gib=0))
        with open_engine(config) as engine:
            TracedRouting(engine.store.model, trace=trace, record=False, what="--routes t")
            stats = engine.store.runtime.stats
            engine.generate(engine.request(PROMPT, max_tokens=TOKENS, ignore_eos=True))
            slots = engine.store.runtime.banks[0].slots
            assert 2 * K < slots < LAYERS * EXPERTS and engine.store.runtime.prefill is not None, slots  # it chooses
            rate = trace_hit_rates(decode, slots, (policy,), num_keys=EXPERTS, shared=True)[policy]
            assert stats.lookups == decode.size and stats.hits / stats.lookups == pytest.approx(rate, abs=1e-12)
