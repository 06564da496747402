"""Prefill: prompt tokens into the KV cache in chunks of PREFILL_STEP, as mlx-lm's generate_step does (all but the
last prompt token: that one's step yields the first logits), for a sequence alone and a batch's newcomer."""

from __future__ import annotations

import mlx.core as mx

from ..compute.runtime import Hooks

PREFILL_STEP = 2048  # prompt tokens per prefill chunk, as mlx-lm


def prefill(model, tokens: list[int], cache: list, rt: Hooks) -> None:
    """tokens into cache, PREFILL_STEP at a time, each chunk evaluated before the next is built; then end_prefill."""
    y = mx.array(tokens, dtype=mx.uint32)
    while y.size:
        n = min(PREFILL_STEP, y.size)
        model(y[:n][None], cache=cache)
        mx.eval([c.state for c in cache])
        rt.sync()
        y = y[n:]
    rt.end_prefill()
