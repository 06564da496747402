"""The decode step of a sequence alone: one token in, its log-probabilities and sampled token out, one step at a time
or overlapped (step n+1's graph built from step n's unevaluated token, as mlx-lm's generate_step does).

Each step: build (forward + sample) -> runtime.flush -> evaluate -> settle -> sync -> next_step; the token goes to
the host once per step. A batch's step (decode/batch.py) builds with the same forward()."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from ..compute.dense import step_log_softmax
from ..compute.kernels import host_eval
from ..compute.runtime import Hooks
from ..sched.trace import NULL, now_us
from .request import rate


@dataclass
class StepTimes:
    """Wall-clock figures of one generation."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0  # prompt processing until the first logits are evaluated
    decode_s: float = 0.0  # from the first sampled token to the last
    tokens: list[int] = field(default_factory=list)

    @property
    def prefill_tok_s(self) -> float:
        return rate(self.prompt_tokens, self.prefill_s)

    @property
    def decode_tok_s(self) -> float:
        return rate(len(self.tokens) - 1, self.decode_s)  # the first token comes out of prefill


def forward(model, inputs: mx.array, cache: list) -> tuple[mx.array, mx.array]:
    """(B, 1) input tokens through the model: the step's log-probabilities (B, V) and its first row's (V,)."""
    return step_log_softmax(model(inputs, cache=cache))


def overlaps(runtime: Hooks, cache: list) -> bool:
    """Whether decode may build step n+1's graph before step n is evaluated (as mlx-lm's generate_step does):
    only when no layer syncs with the host inside a step (every expert resident, streamed predicted routing where
    every layer is routed by its head or holds its experts, or no store runtime) and the KV cache can drop the one
    token a step built ahead leaves in it when the caller stops early."""
    return runtime.overlaps_steps and can_trim_prompt_cache(cache)


def decode(model, y: mx.array, cache: list, sampler: Callable, rt: Hooks, max_tokens: int, times: StepTimes,
           t0: float, forced: list[int] | None) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs) from the last prompt token y (1,) on, the prompt before it in the cache."""
    trace = rt.trace or NULL

    def step(tokens: mx.array, n: int) -> tuple[mx.array, mx.array]:
        logprobs, first = forward(model, tokens[None], cache)  # (1, V), (V,)
        sampled = sampler(logprobs)
        if forced is not None:
            sampled = mx.array(forced[n: n + 1], dtype=sampled.dtype)
        return sampled, first

    overlapped = overlaps(rt, cache)

    def evaluate(token, logprobs, n):
        rt.flush()  # scheduled routing: the last layers' predictions, planned on the planner thread as the step
        t_eval = now_us()  # evaluates, settled before the fence
        host_eval(token, logprobs, hold=not overlapped)  # overlapped decode queues its steps with mx.async_eval
        rt.settle()
        rt.sync()
        rt.next_step()
        if trace.on:
            trace.span("step", "step", t_step, now_us(), step=n)
            trace.span("head+sample", "sample", t_eval, now_us(), step=n)

    t_step = now_us()
    token, logprobs = step(y, 0)
    evaluate(token, logprobs, 0)
    t1 = time.perf_counter()
    times.prefill_s = t1 - t0
    if overlapped:
        yield from _overlapped(step, rt.step_built, token, logprobs, max_tokens, times, t1, cache, trace)
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
