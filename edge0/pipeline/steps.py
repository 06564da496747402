"""The decode loop: prefill the prompt, then one token per step, as mlx-lm's generate_step does it
(prompt[:-1] in chunks, then the last prompt token yields the first logits), so tokens match it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..compute.dense import step_log_softmax
from ..compute.kernels import graph_thread, host_eval
from ..sched.trace import NULL, now_us

PREFILL_STEP = 2048  # prompt tokens per prefill chunk, as mlx-lm


@dataclass
class StepTimes:
    """Wall-clock figures of one generation."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0  # prompt processing until the first logits are evaluated
    decode_s: float = 0.0  # from the first sampled token to the last
    tokens: list[int] = field(default_factory=list)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first token comes out of prefill; decode covers the steps after it
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s else 0.0


def generate_steps(model, prompt: list[int], *, max_tokens: int, sampler: Callable[[mx.array], mx.array],
                   times: StepTimes | None = None, runtime=None, forced: list[int] | None = None,
                   cache: list | None = None) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs) for up to max_tokens steps; the caller stops early on EOS.

    runtime: the store's executor runtime. Each generation begins with runtime.begin() (nothing of the
    previous generation is carried), ends with runtime.finish(), and calls runtime.recover() when it
    raises, so the next one starts clean. Generations on one runtime run one at a time: a step generator
    resumed after another generation began raises. forced: replay these tokens instead of the sampled
    ones, so that benchmark arms do identical work. cache: the model's KV cache to extend (it may already
    hold earlier tokens: then `prompt` is what follows them); default a fresh one.
    """
    with graph_thread():  # off the stream's core, where it keeps one (compute/kernels.py)
        if runtime is None:
            yield from _steps(model, prompt, max_tokens, sampler, times, None, forced, cache)
            return
        gen = runtime.begin()
        try:
            for out in _steps(model, prompt, max_tokens, sampler, times, runtime, forced, cache):
                yield out
                if runtime.generation != gen:
                    raise RuntimeError("another generation began on this runtime while this one was paused")
        except GeneratorExit:  # closed at a yield: every step built so far was evaluated
            raise
        except BaseException:
            if runtime.generation == gen:
                runtime.recover()
            raise
        finally:
            if runtime.generation == gen:
                runtime.finish()


def _steps(model, prompt, max_tokens, sampler, times, runtime, forced, cache) -> Iterator[tuple[int, mx.array]]:
    """The loop of generate_steps."""
    if forced is not None:
        max_tokens = min(max_tokens, len(forced))
    times = times if times is not None else StepTimes()
    times.prompt_tokens = len(prompt)
    cache = cache if cache is not None else make_prompt_cache(model)
    t0 = time.perf_counter()
    sync = runtime.fence.sync if runtime is not None else (lambda: None)
    trace = getattr(runtime, "trace", None) or NULL
    y = _prefill(model, mx.array(prompt, dtype=mx.uint32), cache, sync, runtime)

    def step(tokens: mx.array, n: int) -> tuple[mx.array, mx.array]:
        logprobs, first = step_log_softmax(model(tokens[None], cache=cache))  # (1, V), (V,)
        sampled = sampler(logprobs)
        if forced is not None:
            sampled = mx.array(forced[n: n + 1], dtype=sampled.dtype)
        return sampled, first

    flush = getattr(runtime, "flush", None)  # scheduled routing: the last layers' predictions, planned on the
    settle = getattr(runtime, "settle", lambda: None)  # planner thread as the step evaluates, settled before the fence

    overlapped = overlaps(runtime, cache)

    def evaluate(token, logprobs, n):
        if flush is not None:
            flush()
        t_eval = now_us()
        host_eval(token, logprobs, hold=not overlapped)  # overlapped decode queues its steps with mx.async_eval
        settle()
        sync()
        if runtime is not None:
            runtime.next_step()
        if trace.on:
            trace.span("step", "step", t_step, now_us(), step=n)
            trace.span("head+sample", "sample", t_eval, now_us(), step=n)

    t_step = now_us()
    token, logprobs = step(y, 0)
    evaluate(token, logprobs, 0)
    t1 = time.perf_counter()
    times.prefill_s = t1 - t0
    if overlapped:
        advance = runtime.step_built if runtime is not None else (lambda: None)
        yield from _overlapped(step, advance, token, logprobs, max_tokens, times, t1, cache, trace)
        return
    for n in range(max_tokens):
        t = token.item()  # SYNC: the sampled id goes to the host, once per token
        times.tokens.append(t)
        times.decode_s = time.perf_counter() - t1
        yield t, logprobs
        if n + 1 == max_tokens:
            break
        t_step = now_us()
        token, logprobs = step(token, n + 1)
        evaluate(token, logprobs, n + 1)
    times.decode_s = time.perf_counter() - t1


def _prefill(model, y: mx.array, cache: list, sync, runtime) -> mx.array:
    """Every prompt token but the last into the cache, in chunks of PREFILL_STEP; returns the last."""
    while y.size > 1:
        n = min(PREFILL_STEP, y.size - 1)
        model(y[:n][None], cache=cache)
        mx.eval([c.state for c in cache])
        sync()
        y = y[n:]
    if runtime is not None:
        runtime.end_prefill()
    return y


def overlaps(runtime, cache: list) -> bool:
    """Whether decode may build step n+1's graph before step n is evaluated (as mlx-lm's generate_step does):
    only when no layer syncs with the host inside a step (every expert resident, streamed predicted routing where
    every layer is routed by its head or holds its experts, or no store runtime) and the KV cache can drop the one
    token a step built ahead leaves in it when the caller stops early."""
    return (runtime is None or runtime.overlaps_steps) and can_trim_prompt_cache(cache)


def _overlapped(step, advance, token: mx.array, logprobs: mx.array, max_tokens: int, times: StepTimes, t1: float,
                cache: list, trace) -> Iterator[tuple[int, mx.array]]:
    """Decode with the graph of step n+1 built (from step n's unevaluated token) and queued before step n's
    token goes to the host: Python builds the next step while MLX computes this one. The tokens are the
    same as one step at a time (the same graph, built earlier). A caller that stops after token n leaves step
    n+1 built: its token is trimmed from the KV cache, which then holds exactly what was yielded but the last."""
    ahead = False  # a step was built past the last token yielded
    t_step = now_us()
    try:
        for n in range(max_tokens):
            if n + 1 < max_tokens:
                nxt = step(token, n + 1)
                advance()  # its graph is built: what it decided ahead is for the step built next
                mx.async_eval(*nxt)
                ahead = True
            t = token.item()  # SYNC: the sampled id goes to the host, once per token
            if trace.on:  # a step: from the last token on the host to this one
                trace.span("step", "step", t_step, t_step := now_us(), step=n)
            times.tokens.append(t)
            times.decode_s = time.perf_counter() - t1
            yield t, logprobs
            if n + 1 == max_tokens:
                break
            (token, logprobs), ahead = nxt, False
        times.decode_s = time.perf_counter() - t1
    finally:
        if ahead:
            mx.eval([c.state for c in cache])  # the step built ahead, then its token dropped from the cache
            trim_prompt_cache(cache, 1)
