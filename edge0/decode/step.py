"""A decode step's pieces: its head (forward: the model's log-probabilities of one new token per row), the rule of when
a sequence alone may build step n+1 before step n is evaluated (overlaps), and a generation's wall-clock figures
(StepTimes). The loop that runs the steps is decode/batch.py's, for a batch and a sequence alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache

from ..compute.dense import step_log_softmax
from ..compute.runtime import Hooks
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
