"""--guesses N: prefetch reads ahead only the predictor's N likeliest experts of each predicted set. Under a
throttled disk (every read costs, so prefetch never pauses) it still equals native on real text, reads fewer
bundles ahead than with all K guesses, and each guess is among the K it would have read."""

import mlx.core as mx
import numpy as np
import pytest

from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.pipeline import prefetch

from .test_identity import real_text
from .test_pause import ahead, forced, native_reference

TOKENS = 40
THROTTLE = 200  # MB/s


@pytest.fixture(scope="module")
def text():
    return native_reference(TOKENS)


@pytest.mark.parametrize("predictor", ["heads", "next-router"])
def test_fewer_guesses_read_less_ahead_and_equal_native(text, predictor, monkeypatch):
    ids, want = text
    picked = []  # (all K, the n likeliest) of every guess made with n < K
    real = prefetch._likeliest

    def spy(scores, n):
        got = real(scores, n)
        picked.append((mx.argsort(-scores, axis=-1)[..., :4], got))  # the K highest scores
        return got

    monkeypatch.setattr(prefetch, "_likeliest", spy)
    planned, read_ahead = {}, {}
    for guesses in (None, 1):
        # read_ahead always: the measured gate pauses reading ahead by the steps' timing, and what is planned must
        # follow the predictions alone
        cfg = EngineConfig(routing=RoutingConfig(mode="prefetch", predictor=predictor, guesses=guesses,
                                                 read_ahead="always"), io=IOConfig(throttle_mbps=THROTTLE))
        with open_engine(cfg) as engine:
            sched, sizes = engine.store.runtime.sched, []
            plan = sched.prefetch
            sched.prefetch = lambda layer, cache, ids, **kw: sizes.append(len(ids)) or plan(layer, cache, ids, **kw)
            got = forced(engine, ids)
            planned[guesses], read_ahead[guesses] = sizes, ahead(engine.store.runtime)
        assert np.array_equal(got, want)
    # what is planned follows the predictions alone; what lands ahead also depends on the reads' timing
    assert max(planned[1]) == 1 and max(planned[None]) > 1 and sum(planned[1]) < sum(planned[None])
    assert read_ahead[1] < read_ahead[None]
    assert picked and all(g.shape[-1] == 1 for _, g in picked)
    for every, one in picked:  # the one guess is the likeliest of the K
        e, o = np.array(every), np.array(one)
        assert all(o[i][0] in e[i] for i in np.ndindex(o.shape[:-1]))


@pytest.mark.parametrize("routing", ["prefetch", "predicted"])
def test_a_guess_ranks_the_bank_by_the_scores_it_was_drawn_from(text, routing):
    """A guess's fill (prefetch routing) carries its predictor's scores of every expert for that step, whose K
    highest are the experts it reads, so its fills replace the held experts scored lowest; a routing decided ahead
    (predicted) carries none: its reads are certain, and the bank keeps the least recently used order. Either way
    native's log-probabilities where the routing is native's."""
    ids, want = text
    cfg = EngineConfig(routing=RoutingConfig(mode=routing, predictor="heads", read_ahead="always"),
                       io=IOConfig(executor="staged", throttle_mbps=THROTTLE))
    with open_engine(cfg) as engine:
        sched, plans = engine.store.runtime.sched, []
        plan = sched.prefetch
        sched.prefetch = lambda layer, cache, ids, **kw: plans.append((ids, kw)) or plan(layer, cache, ids, **kw)
        got = forced(engine, ids)
        k = engine.store.manifest.top_k
        experts = engine.store.manifest.num_experts
    if routing == "prefetch":
        assert np.array_equal(got, want)
    assert len(plans) > TOKENS
    for planned, kw in plans:
        if not kw["speculative"]:
            assert kw["rank"] is None
            continue
        rank = kw["rank"]
        assert rank.shape == (experts,)
        assert set(planned.tolist()) == set(np.argsort(-rank)[:k].tolist())
    kinds = {kw["speculative"] for _, kw in plans}
    assert kinds == ({True} if routing == "prefetch" else {True, False})  # predicted: guesses where no head routes


def test_guesses_rank_the_bank_in_bfloat16_compute():
    """--dtype bfloat16: the router's logits are bfloat16, which numpy cannot read; a guess's scores come to the host
    as float32, and the experts guessed are still the K it scores highest."""
    ids = real_text(40)
    cfg = EngineConfig(routing=RoutingConfig(mode="prefetch", predictor="next-router", read_ahead="always"),
                       io=IOConfig(throttle_mbps=THROTTLE), kernel=KernelConfig(dtype="bfloat16"))
    with open_engine(cfg) as engine:
        sched, plans = engine.store.runtime.sched, []
        plan = sched.prefetch
        sched.prefetch = lambda layer, cache, ids, **kw: plans.append((ids, kw)) or plan(layer, cache, ids, **kw)
        forced(engine, ids)
        k = engine.store.manifest.top_k
    assert plans and all(kw["rank"].dtype == np.float32 for _, kw in plans)
    assert all(kw["rank"][p].min() >= np.sort(kw["rank"])[-k] for p, kw in plans)  # the K highest (bf16 ties)
