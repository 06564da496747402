"""One generation on the calling thread, shared by `edge0 run`, `edge0 serve` (one sequence at a time) and `edge0
chat`: the runtime's generation around the steps (generate_steps), then sampling, text, finish and figures
(generate). A batch's sequences (decode/batch.py) use the same prefill, samplers, Tally and figures."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..compute.kernels import graph_thread
from ..compute.runtime import Hooks
from .prefill import prefill
from .request import Figures, GenRequest
from .sampling import Sampler, sampler_for
from .step import StepTimes, decode
from .text import Tally, TextOut


def generate_steps(model, prompt: list[int], *, max_tokens: int, sampler: Sampler, times: StepTimes | None = None,
                   runtime: Hooks | None = None, forced: list[int] | None = None,
                   cache: list | None = None) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs) for up to max_tokens steps; the caller stops early on EOS.

    runtime: the store's executor runtime (None: a model without one). Each generation begins with runtime.begin()
    (nothing of the previous generation is carried), ends with runtime.finish(), and calls runtime.recover() when
    it raises, so the next one starts clean. Generations on one runtime run one at a time: a step generator
    resumed after another generation began raises. forced: replay these tokens instead of the sampled
    ones, so that benchmark arms do identical work. cache: the model's KV cache to extend (it may already
    hold earlier tokens: then `prompt` is what follows them); default a fresh one.
    """
    rt = runtime if runtime is not None else Hooks()
    with graph_thread():  # off the stream's core, where it keeps one (compute/kernels.py)
        gen = rt.begin()
        try:
            for out in _steps(model, prompt, max_tokens, sampler, times, rt, forced, cache):
                yield out
                if rt.generation != gen:
                    raise RuntimeError("another generation began on this runtime while this one was paused")
        except GeneratorExit:  # closed at a yield: every step built so far was evaluated
            raise
        except BaseException:
            if rt.generation == gen:
                rt.recover()
            raise
        finally:
            if rt.generation == gen:
                rt.finish()


def _steps(model, prompt, max_tokens, sampler, times, rt: Hooks, forced, cache) -> Iterator[tuple[int, mx.array]]:
    """Prefill all but the last prompt token, then decode from it."""
    if forced is not None:
        max_tokens = min(max_tokens, len(forced))
    times = times if times is not None else StepTimes()
    times.prompt_tokens = len(prompt)
    cache = cache if cache is not None else make_prompt_cache(model)
    t0 = time.perf_counter()
    prefill(model, prompt[:-1], cache, rt)
    y = mx.array(prompt[-1:], dtype=mx.uint32)
    yield from decode(model, y, cache, sampler, rt, max_tokens, times, t0, forced)


def generate(engine, req: GenRequest, emit: Callable[[str], None], cancelled: Callable[[], bool]) -> Figures:
    """Generate on the calling thread, calling emit(text) with each new piece of text; stop at EOS, a stop
    string, max_tokens, or when cancelled() turns true (checked once per token). The step generator's
    close (in its finally) leaves no read in flight, so the next generation starts clean."""
    engine.check(req)
    store = engine.store
    cache, cached = engine.cached_prefix(req)
    before = counters(store)
    if req.seed is not None:
        mx.random.seed(req.seed)
    mx.reset_peak_memory()
    times = StepTimes()
    fig = Figures(prompt_tokens=len(req.prompt), cached_tokens=cached)
    tally = Tally(req, engine.eos, TextOut(engine.tokenizer.detokenizer, req.prompt[-1], req.stop, emit), fig,
                  cancelled)
    steps = generate_steps(store.model, req.prompt[cached:], max_tokens=req.max_tokens, sampler=sampler_for(req),
                           times=times, runtime=store.runtime, forced=req.forced or None, cache=cache)
    first = None  # counters when the first token came out: decode figures start there
    yielded: list[int] = []  # every token out, EOS included: all but the last are in the KV cache
    reason = fig.finish_reason
    try:
        for t, _ in steps:
            first = first or counters(store)
            yielded.append(t)
            if done := tally.take(t):
                reason = done
                break
    finally:
        steps.close()  # runs runtime.finish(): no read left in flight
    engine.keep_prefix(req, req.prompt + yielded[:-1], cache)
    tally.close(reason)
    fig.timed(times.prompt_tokens, times.prefill_s, times.decode_s)
    after = counters(store)
    fig.bytes_read, fig.cold_bytes, fig.reads, _ = (a - b for a, b in zip(after, before))
    first = first or after
    fig.prefill_stall_s, fig.stall_s = first[3] - before[3], after[3] - first[3]
    fig.peak_mlx_bytes = mx.get_peak_memory()
    return fig


def counters(store) -> tuple:
    """Cumulative (bytes, cold bytes, reads, stall seconds) of the store's reader and its I/O pool."""
    stats = store.reader.stats
    return stats.bytes, stats.cold_bytes, stats.reads, store.reader.pool.waited_s  # stalls: waits on reads, any routing
