"""A batch's rows and steps as plain data (decode/batch.py): a sequence (Sequence), a step built ahead of its
evaluation (Built) and planned (StepPlan), a row's forced tokens, and the reads a step is charged."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import mlx.core as mx

from .request import Figures, GenRequest
from .text import Tally


@dataclass
class Sequence:
    """One request in the batch."""

    req: GenRequest
    tally: Tally  # its tokens into its figures and text; when and why it finishes
    sample: Callable[[mx.array], mx.array]  # (1, V) -> (1,): a RowSampler, or generate_steps' caller's sampler
    next_input: int  # the token the next step feeds
    fed: list[int] = field(default_factory=list)  # tokens in its KV cache
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    done: bool = False
    owner: object = None  # whoever asked for it (the server's job)
    built: int = 0  # its steps built so far: the index of a forced token (req.forced)
    greedy: bool = False  # its token is the argmax of the model's log-probabilities (a batch of such takes one)
    logprobs: mx.array | None = None  # (V,) its last taken step's log-probabilities, where the batch keeps them

    @property
    def fig(self) -> Figures:
        return self.tally.fig


class Built(NamedTuple):
    """A step's graph, built and not yet evaluated."""

    tokens: mx.array  # (B,) its tokens
    logprobs: mx.array | None  # (V,) its first row's log-probabilities, where the batch keeps them
    also: mx.array  # evaluated with the tokens: what computes the step (a forced token is a constant)


@dataclass
class StepPlan:
    """One batch step, planned on the host before any graph is built."""

    rows: int  # sequences in the step
    overlap: bool  # build the next step from this one's unevaluated tokens
    built: Built | None  # this step, built ahead by the one before; None: built now


def forced_one(s: Sequence, sampled: mx.array | None) -> mx.array:
    """A row's token (1,): its next forced one (req.forced, benchmarks), a constant, or the sampled one."""
    s.built += 1
    forced = s.req.forced
    if not forced:
        return sampled
    return mx.array(forced[s.built - 1:s.built], dtype=mx.uint32 if sampled is None else sampled.dtype)


def forced_rows(seqs: list[Sequence], sampled: mx.array) -> mx.array:
    """A step's tokens (B,), where rows replay forced tokens: a value already where every row does."""
    if all(s.req.forced for s in seqs):
        for s in seqs:
            s.built += 1
        return mx.array([s.req.forced[s.built - 1] for s in seqs], dtype=sampled.dtype)
    return mx.concatenate([forced_one(s, sampled[i:i + 1]) for i, s in enumerate(seqs)])


def charge(seqs: list[Sequence], before: tuple, after: tuple) -> None:
    """The reads of a step (or a prefill), shared evenly by the sequences it served."""
    share = [(a - b) / len(seqs) for a, b in zip(after, before)]
    for s in seqs:
        s.fig.bytes_read += int(share[0])
        s.fig.cold_bytes += share[1]
        s.fig.reads += int(share[2])
        s.fig.stall_s += share[3]


def counters(store) -> tuple:
    """Cumulative (bytes, cold bytes, reads, stall seconds) of the store's reader and its I/O pool."""
    stats = store.reader.stats
    return stats.bytes, stats.cold_bytes, stats.reads, store.reader.pool.waited_s  # stalls: waits on reads, any routing
