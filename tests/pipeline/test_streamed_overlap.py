"""Streamed predicted routing where every layer is routed by its head or holds its experts syncs with the host nowhere
inside a step, so decode builds step n+1's graph while step n evaluates (decode/step.py): the same answers bit for
bit as one step at a time, on real text and under a slow disk; fills still land a step ahead (the fence learns what is
evaluated from the predictions the host takes); an early stop leaves the next generation exact."""

import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from edge0.decode.batch import BatchDecoder
from edge0.compute.banks import Fence
from edge0.config import EngineConfig, IOConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.decode.request import GenRequest
from edge0.pipeline.prefetch_runtime import PrefetchRuntime
from edge0.decode.loop import generate_steps
from edge0.decode.step import overlaps

from .test_identity import real_text
from .test_overlap import Counting

GREEDY = make_sampler(temp=0.0)
HELD = {"routing.mode": "predicted", "io.executor": "staged",
        "io.slots": 20}  # layers 0, 1, 5 hold theirs; heads route 2-4


def decode(engine, ids: list[int], forced: list[int], stop_after: int | None = None):
    """(log-probabilities as numpy, model calls seen at each yield, the scheduler's counters)."""
    model = Counting(engine.store.model)
    lps, calls = [], []
    with engine.kernel.active():
        for _, lp in generate_steps(model, ids, max_tokens=len(forced), sampler=GREEDY, runtime=engine.store.runtime,
                                    forced=forced, cache=make_prompt_cache(engine.store.model)):
            lps.append(np.array(lp))
            calls.append(model.calls)
            if len(lps) == stop_after:
                break
    return np.stack(lps), calls, engine.store.runtime.sched.stats


def one_at_a_time(monkeypatch):
    """Runtimes built from now on decode one step at a time (their gate as before: nothing guessed)."""
    link = PrefetchRuntime.link

    def linked(self, blocks):
        link(self, blocks)
        self.overlaps_steps = False

    monkeypatch.setattr(PrefetchRuntime, "link", linked)


@pytest.mark.parametrize("throttle", [None, 20.0], ids=["page-cache", "slow-disk"])
def test_the_step_ahead_is_built_while_one_evaluates_with_the_same_answers(throttle, monkeypatch):
    ids = real_text(80)
    prompt, forced = ids[:16], ids[16:]
    config = HELD | ({"io.throttle_mbps": throttle} if throttle else {})
    with open_engine(EngineConfig.of(config)) as engine:
        assert overlaps(engine.store.runtime, make_prompt_cache(engine.store.model))
        assert engine.describe()["overlaps_steps"] and engine.describe()["held_layers"] == [0, 1, 5]
        got, calls, stats = decode(engine, prompt, forced)
        got_loads = (stats.loads, stats.demand_loads)
    one_at_a_time(monkeypatch)
    with open_engine(EngineConfig.of(config)) as engine:
        assert not overlaps(engine.store.runtime, make_prompt_cache(engine.store.model))
        want, want_calls, stats = decode(engine, prompt, forced)
        want_loads = (stats.loads, stats.demand_loads)
    assert got.shape == want.shape and np.array_equal(got, want)
    n, first = len(forced), want_calls[0]
    assert want_calls == [first + i for i in range(n)]  # one step at a time
    assert calls == [first + i + 1 for i in range(n - 1)] + [first + n - 1]  # step n + 1 built at token n's yield
    # the fills still go ahead: as many bundles read, no more of them on demand (a fence that never learned the step
    # before was evaluated would leave no slot to fill, and every read would be made on demand)
    assert got_loads[0] > 0 and got_loads == want_loads


def batch_tokens(engine, prompts: list[list[int]], lengths: list[int]):
    """A batch the prompts join one by one (the second after two steps, the third after one more) and leave at their
    lengths: (each one's tokens, whether each step left the next built, bundles read)."""
    batch, rows, out, ahead = BatchDecoder(engine, len(prompts)), {}, {}, []
    joins = {0: 0, 2: 1, 3: 2}  # step -> prompt joining before it
    step = 0
    while step in joins or batch.seqs:
        if step in joins:
            i = joins[step]
            req = GenRequest(prompt=prompts[i], max_tokens=lengths[i], ignore_eos=True)
            rows[id(batch.admit(req, lambda t: None, lambda: False))] = i
        out.update({rows[id(s)]: s.fig.tokens for s in batch.step()})
        ahead.append(batch.ahead is not None)
        step += 1
    return out, ahead, engine.store.runtime.sched.stats.loads


@pytest.mark.parametrize("slots", [28, 20])
def test_a_batch_builds_its_next_step_ahead_where_its_banks_hold_two_steps(slots, monkeypatch):
    """serve --max-batch: sequences join a batch (each join waits for the step built ahead) and leave it at different
    steps, under a slow disk; every token as one step at a time. A batch builds its next step ahead only where each
    streamed bank holds two steps' candidates of every row (28 slots: 24 a routed layer, 3 rows of 4 twice; 20: 8,
    one row): else a fill would find no slot the step in flight leaves it, and the step would read it on demand."""
    ids = real_text(96)
    prompts, lengths = [ids[:16], ids[30:41], ids[60:80]], [14, 9, 11]
    config = HELD | {"io.throttle_mbps": 20.0, "serving.max_batch": 3, "io.slots": slots}
    with open_engine(EngineConfig.of(config)) as engine:
        got, ahead, got_loads = batch_tokens(engine, prompts, lengths)
    one_at_a_time(monkeypatch)
    with open_engine(EngineConfig.of(config)) as engine:
        want, none_ahead, want_loads = batch_tokens(engine, prompts, lengths)
    assert got == want and len({t for toks in want.values() for t in toks}) > 8  # varied answers
    assert not any(none_ahead) and not ahead[-1]  # the last sequence left: nothing built ahead
    assert ahead[:-1] == ([True] * (len(ahead) - 1) if slots == 28 else [True, True] + [False] * (len(ahead) - 3))
    assert 0 < got_loads <= 1.1 * want_loads  # the fills avoid the slots in flight: a few more reads at most


def test_no_overlap_where_a_layer_routes_by_its_own_router():
    """Even banks: layers 0, 1 and 5 route by their own router, a host sync inside the step."""
    with open_engine(EngineConfig.of(HELD | {"io.placement": "even"})) as engine:
        assert not engine.store.runtime.overlaps_steps and not engine.describe()["overlaps_steps"]
    with open_engine(EngineConfig(routing=RoutingConfig(mode="prefetch", predictor="heads"),
                                  io=IOConfig(executor="staged", slots=20))) as engine:
        assert not engine.store.runtime.overlaps_steps  # the model's router decides every layer


def test_an_early_stop_leaves_the_next_generation_exact(monkeypatch):
    ids = real_text(64)
    prompt, forced = ids[:16], ids[16:]
    with open_engine(EngineConfig.of(HELD)) as engine:
        want, _, _ = decode(engine, prompt, forced)
        part, _, _ = decode(engine, prompt, forced, stop_after=7)  # step 8 built, then dropped
        again, _, _ = decode(engine, prompt, forced)
    assert np.array_equal(part, want[:7]) and np.array_equal(again, want)


def test_the_fence_completes_only_epochs_that_ended():
    fence = Fence()
    assert fence.advance() == 0 and fence.advance() == 1 and fence.epoch == 2
    fence.complete(0)
    assert fence.completed == 0
    fence.complete(5)  # never past the epoch being built
    assert fence.completed == 1
    fence.complete(0)  # never backwards
    assert fence.completed == 1
