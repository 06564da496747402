"""Every code path of the CPU kernels this build runs (kernels.isas(): AVX-512, AVX2 and plain C++ on an AVX-512
machine) computes each token row as it would alone, so a path only narrower machines take is tested on a wider one:
a prompt continued from a kept prefix has the bits of the whole prompt, and a batch's sequences the tokens they get
alone. The kernels' own checks on each path: tests/compute (the every_isa fixture). $EDGE0_KERNEL_ISA picks a path."""

import numpy as np
import pytest

from edge0.compute import kernels
from edge0.config import EngineConfig, KernelConfig, ServingConfig
from edge0.engine import open_engine
from edge0.errors import Edge0Error
from edge0.decode.request import GenRequest
from tests.compute.kernel_refs import IMPLS, every_isa, needs_ext, restore  # noqa: F401 (fixtures)
from tests.test_batching import PROMPTS, _kv, run_batch

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nprint("


@pytest.fixture
def step_logprobs(monkeypatch):
    """Each generation's log-probabilities, step by step (a list per generation, in order): each step's of its
    sequence alone (a batch of one, decode/batch.py), kept as evaluated with the step's tokens."""
    from edge0.decode import batch

    seen, admit, forward = [], batch.BatchDecoder.admit, batch.forward

    def admitting(self, *args, **kwargs):
        seen.append([])
        return admit(self, *args, **kwargs)

    def recording(*args, **kwargs):
        logprobs, first = forward(*args, **kwargs)
        seen[-1].append(logprobs)
        return logprobs, first

    monkeypatch.setattr(batch.BatchDecoder, "admit", admitting)
    monkeypatch.setattr(batch, "forward", recording)
    return seen


# the default (predicted routing, every expert resident), and the streamed pipeline of issue 58's failing case
CONFIGS = [{}, {"routing.mode": "predicted", "io.executor": "staged", "io.slots": 28}]


@needs_ext
@pytest.mark.parametrize("config", CONFIGS)
def test_a_prompt_continued_from_a_kept_prefix_has_the_bits_of_the_whole_prompt(every_isa, config, step_logprobs):
    """The prompt cache keeps a prompt's first 13 tokens; the whole prompt then prefills 26 rows after them, where a
    fresh engine prefills 38 at once (other row tiles, attention over a cached prefix): the same log-probabilities,
    bit for bit, at every step."""
    assert kernels.isa() == every_isa
    with open_engine(EngineConfig.of({"kernel.name": "edge0", **config})) as engine:
        prompt = engine.encode_text(TEXT)
        assert len(prompt) > 30
        engine.generate(GenRequest(prompt=prompt[:13], max_tokens=1))  # keeps the 13 tokens, all prefilled
        again = engine.generate(GenRequest(prompt=prompt, max_tokens=6))
        assert again.cached_tokens == 13
    with open_engine(EngineConfig.of({"kernel.name": "edge0", "serving.prompt_cache_gib": 0, **config})) as fresh:
        whole = fresh.generate(GenRequest(prompt=prompt, max_tokens=6))
    assert again.tokens == whole.tokens
    assert len(step_logprobs) == 3
    assert all(np.array_equal(a, b) for a, b in zip(step_logprobs[1], step_logprobs[2], strict=True))


@needs_ext
def test_a_batchs_sequences_keep_the_bits_of_each_alone(every_isa):
    """Four sequences joining one per step (rows of 1 to 4 in the products, the heads and attention): each gets its
    tokens alone, and leaves the prompt cache the KV entries it leaves alone, bit for bit."""
    lengths = {p: 5 + i for i, p in enumerate(PROMPTS[:4])}
    with open_engine(EngineConfig(kernel=KernelConfig(name="edge0"), serving=ServingConfig(max_batch=4))) as engine:
        batched = run_batch(engine, PROMPTS[:4], max_batch=4, stagger=True, max_tokens=lengths)
        kept = {tokens: _kv(cache) for tokens, cache in engine.prompt_cache.entries.items()}
    with open_engine(EngineConfig(kernel=KernelConfig(name="edge0"))) as alone:
        solo = {p: alone.generate(GenRequest(prompt=alone.encode_text(p), max_tokens=n)).tokens
                for p, n in lengths.items()}
        own = {tokens: _kv(cache) for tokens, cache in alone.prompt_cache.entries.items()}
    assert {p: f.tokens for p, f in batched.items()} == solo
    assert kept.keys() == own.keys() and len(own) == 4
    assert all(np.array_equal(a, b) for t in own for a, b in zip(kept[t], own[t], strict=True))


@needs_ext
def test_the_environment_picks_a_path_and_names_the_built_ones_when_it_names_another(monkeypatch):
    """$EDGE0_KERNEL_ISA: the path the extension runs from its load on; a name it has no build of is refused with the
    names it has, at every load."""
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setenv("EDGE0_KERNEL_ISA", IMPLS[0])
    assert kernels.load() is not None and kernels.isa() == IMPLS[0]
    assert kernels.load().impl() == IMPLS[0] and kernels.load().dense_impl() == IMPLS[0]
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setenv("EDGE0_KERNEL_ISA", "avx1024")
    for _ in range(2):
        with pytest.raises(Edge0Error, match=f"EDGE0_KERNEL_ISA=avx1024: this build's kernels run {', '.join(IMPLS)}"):
            kernels.load()
    with pytest.raises(Edge0Error, match="kernel path sse: this build's kernels run"):
        monkeypatch.setattr(kernels, "_ext", None)
        monkeypatch.delenv("EDGE0_KERNEL_ISA")
        kernels.set_isa("sse")
