"""A sequence alone, a batch of one (decode/batch.py BatchDecoder.alone), on the calling thread: one generation for
`edge0 run`, `edge0 serve` (--max-batch 1) and `edge0 chat` (generate: sampling, text, finish and figures), and the
steps of a model with a caller's sampler, each step's log-probabilities yielded, for scoring, replays and tests
(generate_steps). Both bracket the generation with the runtime's hooks (begin, finish, recover when it raised)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..compute.kernels import graph_thread
from ..compute.runtime import Hooks
from .batch import BatchDecoder
from .rows import Sequence, counters
from .request import Figures, GenRequest
from .sampling import Sampler
from .step import StepTimes
from .text import Tally


@contextmanager
def _generation(rt: Hooks):
    """One generation on rt: begun (nothing of the previous one is carried), finished, recovered first when it raised
    (not when its step generator was closed: every step built so far was evaluated), so the next one starts clean.
    Yields its number: a generation that finds another begun since must not touch the runtime."""
    with graph_thread():  # off the stream's core, where it keeps one (compute/kernels.py)
        gen = rt.begin()
        try:
            yield gen
        except GeneratorExit:
            raise
        except BaseException:
            if rt.generation == gen:
                rt.recover()
            raise
        finally:
            if rt.generation == gen:
                rt.finish()


def generate_steps(model, prompt: list[int], *, max_tokens: int, sampler: Sampler, times: StepTimes | None = None,
                   runtime: Hooks | None = None, forced: list[int] | None = None,
                   cache: list | None = None) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs (V,)) for up to max_tokens steps; the caller stops early on EOS (the KV cache then holds
    what was yielded but the last).

    runtime: the store's executor runtime (None: a model without one). Generations on one runtime run one at a
    time: a step generator resumed after another generation began raises. forced: replay these tokens instead of
    the sampled ones, so that benchmark arms do identical work. cache: the model's KV cache to extend (it may
    already hold earlier tokens: then `prompt` is what follows them); default a fresh one.
    """
    rt = runtime if runtime is not None else Hooks()
    times = times if times is not None else StepTimes()
    max_tokens = min(max_tokens, len(forced)) if forced is not None else max_tokens
    if max_tokens <= 0:
        return
    req = GenRequest(prompt=list(prompt), max_tokens=max_tokens, ignore_eos=True, forced=forced or None)
    batch = BatchDecoder.alone(model, rt)
    batch.keep_logprobs = True
    with _generation(rt) as gen:
        try:
            t0 = time.perf_counter()
            times.prompt_tokens = len(prompt)
            seq = Sequence(req, Tally(req, set(), _Silent(), Figures(), lambda: False), sampler, prompt[-1], started=t0)
            batch.start(seq, prompt, cache if cache is not None else make_prompt_cache(model))
            t1 = time.perf_counter()
            times.prefill_s = t1 - t0
            while True:
                times.tokens.append(seq.next_input)
                times.decode_s = time.perf_counter() - t1
                yield seq.next_input, seq.logprobs
                if rt.generation != gen:
                    raise RuntimeError("another generation began on this runtime while this one was paused")
                if seq.done:
                    break
                batch.step()
        finally:
            if batch.ahead is not None:  # closed after a token with the next step built: its token leaves the cache
                batch.drop_ahead()


class _Silent:
    """generate_steps' text: none (its caller decodes what it wants)."""

    text = ""

    def add(self, token: int) -> bool:
        return False

    def finish(self) -> bool:
        return False


def generate(engine, req: GenRequest, emit: Callable[[str], None], cancelled: Callable[[], bool]) -> Figures:
    """Generate on the calling thread, calling emit(text) with each new piece of text; stop at EOS, a stop
    string, max_tokens, or when cancelled() turns true (checked once per token)."""
    engine.check(req)  # a refused request touches no runtime state
    store = engine.store
    mx.reset_peak_memory()
    before = counters(store)
    batch = BatchDecoder.alone(store.model, store.runtime, engine)
    with _generation(store.runtime):
        seq = batch.admit(req, emit, cancelled)
        first = counters(store)  # when the first token came out: decode figures start there
        while not seq.done:
            batch.step()
    fig, after = seq.fig, counters(store)
    fig.bytes_read, fig.cold_bytes, fig.reads, _ = (a - b for a, b in zip(after, before))
    fig.prefill_stall_s, fig.stall_s = first[3] - before[3], after[3] - first[3]
    return fig
