"""Sampling a step's tokens from its log-probabilities: mlx-lm's samplers and logits processors (mlx_lm.sample_utils),
with a request's logit bias and presence and frequency penalties.

A sequence alone samples with mlx-lm's make_sampler on MLX's global random state (reseeded by a request's seed), as
mlx-lm's generate does; a batch's row samples with a random key of its own, so that rows do not draw from each other.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors, make_sampler

from .request import GenRequest

PENALTY_TOKENS = 20  # the tokens the penalties look back over, the prompt's included (mlx-lm's default window)

Sampler = Callable[[mx.array], mx.array]  # (B, V) log-probabilities -> (B,) tokens


class Penalties:
    """A request's logit bias and presence and frequency penalties, applied to a step's log-probabilities before
    sampling as mlx-lm's logits processors apply them (the penalties over the last PENALTY_TOKENS tokens), then
    renormalized; the log-probabilities a caller reports stay the model's. All three add to log-probabilities, so
    applying them there or to the logits samples alike. The tokens are an array the graph extends, so that a step
    can be built before the token before it is on the host (overlapped decode)."""

    def __init__(self, req: GenRequest):
        self.processors = make_logits_processors(
            logit_bias=req.logit_bias or None,
            presence_penalty=req.presence_penalty or None, presence_context_size=PENALTY_TOKENS,
            frequency_penalty=req.frequency_penalty or None, frequency_context_size=PENALTY_TOKENS)
        self.tokens = mx.array(req.prompt[-PENALTY_TOKENS:], dtype=mx.uint32)

    @classmethod
    def of(cls, req: GenRequest) -> "Penalties | None":
        """The request's penalties; None when it has none (sampling then costs nothing more)."""
        return cls(req) if req.presence_penalty or req.frequency_penalty or req.logit_bias else None

    def __call__(self, logprobs: mx.array) -> mx.array:
        """(1, V) log-probabilities biased, penalized and renormalized."""
        for processor in self.processors:
            logprobs = processor(self.tokens, logprobs)
        return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)

    def took(self, token: mx.array) -> mx.array:
        """token (1,) was sampled: it joins the tokens looked back over; returned."""
        self.tokens = mx.concatenate([self.tokens, token.astype(mx.uint32).reshape(-1)])[-PENALTY_TOKENS:]
        return token

    def sampler(self, sample: Sampler) -> Sampler:
        """sample, on penalized log-probabilities, its tokens taken."""
        return lambda logprobs: self.took(sample(self(logprobs)))


def sampler_for(req: GenRequest) -> Sampler:
    """A sequence alone: mlx-lm's sampler for the request's temperature, top-p and top-k, its penalties first."""
    sample = make_sampler(temp=req.temp, top_p=req.top_p if 0 < req.top_p < 1 else 0.0, top_k=req.top_k)
    penalties = Penalties.of(req)
    return penalties.sampler(sample) if penalties is not None else sample


class RowSampler:
    """A batch's row: greedy at temperature 0, else top-k / top-p filtered categorical with its own key; the request's
    bias and penalties first."""

    def __init__(self, req: GenRequest, seed: int):
        self.req, self.key, self.penalties = req, mx.random.key(seed), Penalties.of(req)

    @property
    def greedy(self) -> bool:
        """Its token is the argmax of the model's log-probabilities (a batch of such rows takes one argmax)."""
        return self.req.temp == 0 and self.penalties is None

    def __call__(self, logprobs: mx.array) -> mx.array:
        """(1, V) -> (1,)."""
        if self.penalties is None:
            return self._sample(logprobs)
        return self.penalties.took(self._sample(self.penalties(logprobs)))

    def _sample(self, logprobs: mx.array) -> mx.array:
        r = self.req
        if r.temp == 0:
            return mx.argmax(logprobs, axis=-1)
        if r.top_k:
            logprobs = apply_top_k(logprobs, r.top_k)
        if 0 < r.top_p < 1:
            logprobs = apply_top_p(logprobs, r.top_p)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1 / r.temp), key=sub)
