"""Decode with every expert resident builds step n+1's graph before step n's token reaches the host (no layer
syncs inside a step), with the same tokens and log-probabilities as the exact executor, and a caller that stops
early leaves the KV cache holding exactly what it was given; `--executor auto` picks resident where every
expert fits."""

import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from edge0.compute import kernels
from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.decode.loop import generate_steps

GREEDY = make_sampler(temp=0.0)
PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint("
STEPS = 16
KERNELS = ["mlx"] + (["edge0"] if kernels.available() else [])


class Counting:
    """The model, counting its calls (one per decode step after the prompt's)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.model(*a, **k)


def run(engine, ids, steps=STEPS, stop_after=None, cache=None):
    """(tokens, log-probabilities as numpy, model calls seen at each yield, the KV cache)."""
    model = Counting(engine.store.model)
    cache = cache if cache is not None else make_prompt_cache(engine.store.model)
    tokens, logprobs, calls = [], [], []
    with engine.kernel.active():
        for t, lp in generate_steps(model, ids, max_tokens=steps, sampler=GREEDY, runtime=engine.store.runtime,
                                    cache=cache):
            tokens.append(t)
            logprobs.append(np.array(lp))
            calls.append(model.calls)
            if len(tokens) == stop_after:
                break
    return tokens, logprobs, calls, cache


@pytest.mark.parametrize("kernel", KERNELS)
def test_resident_decode_builds_the_next_step_ahead_and_equals_exact(kernel):
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="exact"),
                                  kernel=KernelConfig(name=kernel))) as engine:
        ids = engine.encode_text(PROMPT)
        want, want_lp, want_calls, _ = run(engine, ids)
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="resident"),
                                  kernel=KernelConfig(name=kernel))) as engine:
        got, got_lp, calls, _ = run(engine, ids)
    assert got == want
    for a, b in zip(got_lp, want_lp):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    prompt_calls = want_calls[0] - 1  # the prompt's chunks, then one call per decode step
    assert want_calls == [prompt_calls + n + 1 for n in range(STEPS)]  # exact: one step at a time
    # resident: at token n's yield, step n + 1 is built already (none past the last)
    assert calls == [prompt_calls + n + 2 for n in range(STEPS - 1)] + [prompt_calls + STEPS]


def test_an_early_stop_leaves_the_cache_holding_what_was_yielded_but_the_last():
    """The step built ahead of the last yielded token is dropped from the cache: the generation continues from
    the cache and the last token as the uninterrupted one does (a chat's next turn, the prompt cache)."""
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="resident"))) as engine:
        ids = engine.encode_text(PROMPT)
        full, full_lp, _, _ = run(engine, ids)
        first, _, _, cache = run(engine, ids, stop_after=5)
        assert first == full[:5]
        assert cache[0].offset == len(ids) + 4
        rest, rest_lp, _, cache = run(engine, first[-1:], steps=STEPS - 5, cache=cache)
    assert rest == full[5:]
    np.testing.assert_allclose(rest_lp[-1], full_lp[-1], rtol=0, atol=1e-5)
    assert cache[0].offset == len(ids) + STEPS - 1


def test_a_raising_step_built_ahead_leaves_the_next_generation_exact():
    calls = 0

    def raising(logprobs):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("sampler call 4")
        return GREEDY(logprobs)

    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="resident"))) as engine:
        ids = engine.encode_text(PROMPT)
        want, _, _, _ = run(engine, ids)
        with engine.kernel.active(), pytest.raises(RuntimeError, match="sampler call 4"):
            for _ in generate_steps(engine.store.model, ids, max_tokens=STEPS, sampler=raising,
                                    runtime=engine.store.runtime):
                pass
        assert run(engine, ids)[0] == want


def test_auto_picks_resident_where_every_expert_fits():
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"))) as engine:  # the demo store: 12 MiB of experts
        assert engine.store.runtime.executor == "resident"
        held = engine.store.runtime.resident_expert_bytes
        assert held >= engine.store.manifest.expert_bytes  # every bundle (bf16 scales widened on MLX's kernels)
    budget = held / 2 / 2**30
    for config in (EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(memory_budget_gib=budget)),
                   # the experts do not fit the budget
                   EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(slots=8))):  # slots are staged banks
        with open_engine(config) as engine:
            assert engine.store.runtime.executor == "staged", config
