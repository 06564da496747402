"""Continuous batching: up to max_batch sequences decode together, one model step per token for all of them.

A step, as vLLM v1's: plan (StepPlan, host only) -> execute (build, queue or evaluate) -> update from its output
(tokens to the host, to their sequences' Tally; the finished leave).

A new sequence's prompt is prefilled alone (through the prompt cache) at a step boundary, then its KV
cache joins the batch's (mlx-lm's BatchKVCache, left-padded); a finished or cancelled sequence leaves at
the next boundary without stalling the others. One step feeds each sequence its next input token, so the
routed experts of a step are the union over the batch: each layer's executor reads that union once
(the staged banks hold 2K slots per sequence, up to E). The routing history that prerouter heads read
follows the batch's rows (runtime.keep_rows / join); when sequences join, the step after routes every
consumer layer with its own router.

Where no layer syncs with the host inside a step (every expert resident, or streamed predicted routing where
every layer is routed by its head or holds its experts, and each streamed bank holds two steps' candidates of
every row: `runtime.overlaps_batch`) the batch decodes as one sequence alone does (decode/step.py): step
n+1's graph is built from step n's unevaluated tokens and queued before those reach the host. A sequence that
finishes at step n has had step n+1 computed for nothing; its row of that step leaves with it (its KV cache, kept
for the prompt cache, is trimmed by that token). A newcomer waits for the step built ahead to be taken first
(`settle`).

Everything here runs on the engine's one worker thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, can_trim_prompt_cache, trim_prompt_cache

from ..compute.kernels import host_eval
from .loop import counters
from .prefill import prefill
from .request import Figures, GenRequest
from .sampling import RowSampler
from .step import forward
from .text import Tally, TextOut


@dataclass
class Sequence:
    """One request in the batch."""

    req: GenRequest
    tally: Tally  # its tokens into its figures and text; when and why it finishes
    sample: RowSampler  # (1, V) -> (1,), its own random key
    next_input: int  # the token the next step feeds
    fed: list[int] = field(default_factory=list)  # tokens in its KV cache
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    done: bool = False
    owner: object = None  # whoever asked for it (the server's job)

    @property
    def fig(self) -> Figures:
        return self.tally.fig


@dataclass
class StepPlan:
    """One batch step, planned on the host before any graph is built."""

    rows: int  # sequences in the step
    overlap: bool  # build the next step from this one's unevaluated tokens (runtime.overlaps_batch)
    built: mx.array | None  # (rows,) this step's tokens, built ahead by the step before; None: built now


class BatchDecoder:
    """The running batch of one engine."""

    def __init__(self, engine, max_batch: int):
        self.engine, self.max_batch = engine, max_batch
        self.seqs: list[Sequence] = []
        self.cache: list | None = None  # the batch's KV caches, one per layer
        self.early: list[Sequence] = []  # done at their first token, at admission: reported by the next step
        self.ahead: mx.array | None = None  # (B,) tokens of a step built ahead for self.seqs, not yet on the host

    @property
    def room(self) -> int:
        return self.max_batch - len(self.seqs)

    def admit(self, req: GenRequest, emit: Callable[[str], None], cancelled: Callable[[], bool]) -> Sequence:
        """Prefill req's prompt and take its first step alone (as a generation alone does: its last prompt
        token in, its first token out), then join the batch at this step boundary, routing state and all, so
        it continues as it would alone. A sequence done at its first token (EOS, max_tokens 1) never joins:
        the next step() reports it."""
        engine = self.engine
        engine.check(req)
        self.settle()
        rt = engine.store.runtime
        if not self.seqs:
            rt.begin()  # an idle batch: nothing of earlier generations is carried
        before = rt.snapshot()
        rt.join([])  # the newcomer routes on its own: no history, nothing decided ahead
        before_reads = counters(engine.store)
        seed = req.seed if req.seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
        t0 = time.perf_counter()
        with engine.kernel.active():
            cache, cached = engine.cached_prefix(req)
            text = TextOut(engine.tokenizer.detokenizer, req.prompt[-1], req.stop, emit)
            tally = Tally(req, engine.eos, text, Figures(prompt_tokens=len(req.prompt), cached_tokens=cached), cancelled)
            seq = Sequence(req, tally, RowSampler(req, seed), req.prompt[-1], fed=list(req.prompt[:-1]), started=t0)
            prefill(engine.store.model, req.prompt[cached:-1], cache, rt)
            first = self._first_step(seq, cache)
        _charge([seq], before_reads, counters(engine.store))
        self._take(seq, first, time.perf_counter())
        if seq.done:
            self.early.append(seq)
            rt.join([(before, len(self.seqs))] if self.seqs else [])
            self._finish([seq], None)
            return seq
        rt.join(([(before, len(self.seqs))] if self.seqs else []) + [(rt.snapshot(ahead=1), 1)])
        self._merge(cache)
        self.seqs.append(seq)
        return seq

    def _first_step(self, seq: Sequence, cache: list) -> int:
        """The sequence's last prompt token through the model alone; its first token."""
        logprobs, _ = forward(self.engine.store.model, mx.array([[seq.next_input]], dtype=mx.uint32), cache)
        token = seq.sample(logprobs)
        mx.eval(token)
        self.engine.store.runtime.sync()
        seq.fed.append(seq.next_input)
        return int(token.item())  # SYNC: the first token, once per sequence

    def _merge(self, cache: list) -> None:
        """Join a sequence's KV cache (one row) to the batch's."""
        one = [type(c).merge([c]) if hasattr(type(c), "merge") else c for c in cache]
        if self.cache is None:
            self.cache = one
        else:
            for mine, theirs in zip(self.cache, one):
                mine.extend(theirs)

    def step(self) -> list[Sequence]:
        """One decode step for every sequence; returns the sequences that finished (and left the batch)."""
        early, self.early = self.early, []
        if not self.seqs:
            return early
        plan = self._plan()
        before_reads = counters(self.engine.store)
        with self.engine.kernel.active():
            sampled = self._execute(plan)
        _charge(self.seqs, before_reads, counters(self.engine.store))
        return early + self._take_step(sampled)

    def _plan(self) -> StepPlan:
        """What this step runs (host only): the step built ahead, if any, and whether to build the next one ahead."""
        overlap = self.engine.store.runtime.overlaps_batch(len(self.seqs)) \
            and can_trim_prompt_cache(self.cache)
        built, self.ahead = self.ahead, None
        return StepPlan(len(self.seqs), overlap, built)

    def _execute(self, plan: StepPlan) -> mx.array:
        """The plan's step (built now, or ahead by the step before) and, overlapping, the next one queued from its
        unevaluated tokens before those reach the host; this step's tokens (B,)."""
        rt, sampled = self.engine.store.runtime, plan.built
        if sampled is None:
            sampled = self._build(mx.array([[s.next_input] for s in self.seqs], dtype=mx.uint32))
            if plan.overlap:
                rt.step_built()
                mx.async_eval(sampled)
            else:
                host_eval(sampled)
                rt.sync()
                rt.next_step()
        if plan.overlap:
            self.ahead = self._build(sampled[:, None])
            rt.step_built()  # what it decided ahead is for the step built next; its slots stay fenced
            mx.async_eval(self.ahead)
        return sampled

    def settle(self) -> None:
        """Take the step built ahead, if any (its tokens to the host, finished sequences out), so that the batch
        can change: the next step() reports what finished."""
        if self.ahead is not None:
            sampled, self.ahead = self.ahead, None
            self.early += self._take_step(sampled)

    def _build(self, inputs: mx.array) -> mx.array:
        """The graph of one step for every sequence from inputs (B, 1); its sampled tokens (B,), unevaluated."""
        _share_offsets(self.cache)
        logprobs, _ = forward(self.engine.store.model, inputs, self.cache)  # (B, V)
        if all(s.sample.greedy for s in self.seqs):
            return mx.argmax(logprobs, axis=-1)
        return mx.concatenate([s.sample(logprobs[i:i + 1]) for i, s in enumerate(self.seqs)])  # (B,)

    def _take_step(self, sampled: mx.array) -> list[Sequence]:
        """Update from a step's output: its tokens to the host and to their sequences; the finished ones leave."""
        seqs = self.seqs
        tokens = sampled.tolist()  # SYNC: the batch's tokens to the host, once per step
        now = time.perf_counter()
        for s, t in zip(seqs, tokens):
            s.fed.append(s.next_input)
            self._take(s, t, now)
        finished = [s for s in seqs if s.done]
        if finished:
            self._leave(finished)
        return finished

    def _take(self, s: Sequence, t: int, now: float) -> None:
        """Sequence s sampled token t."""
        if s.first_token is None:
            s.first_token = now
            s.fig.prefill_s = now - s.started  # until the first token, as a generation alone counts it
        s.next_input = t
        reason = s.tally.take(t)
        if reason is not None:
            s.fig.finish_reason, s.done = reason, True

    def _leave(self, finished: list[Sequence]) -> None:
        keep = [i for i, s in enumerate(self.seqs) if not s.done]
        self._finish(finished, self.cache)
        self.seqs = [self.seqs[i] for i in keep]
        if not self.seqs:
            self.cache, self.ahead = None, None
            self.engine.store.runtime.finish()
            return
        for c in self.cache:
            c.filter(mx.array(keep))
        self.engine.store.runtime.keep_rows(keep)
        if self.ahead is not None:
            self.ahead = self.ahead[mx.array(keep)]

    def _finish(self, finished: list[Sequence], cache: list | None) -> None:
        """Their last figures and text; their KV caches into the prompt cache."""
        for s in finished:
            s.tally.close(s.fig.finish_reason)
            s.fig.timed(s.fig.prompt_tokens - s.fig.cached_tokens, s.fig.prefill_s,
                        time.perf_counter() - (s.first_token or time.perf_counter()))
            s.fig.peak_mlx_bytes = mx.get_peak_memory()
            if cache is not None:
                self._keep_cache(s, self.seqs.index(s))

    def _keep_cache(self, s: Sequence, row: int) -> None:
        """Its KV cache, out of the batch's, into the prompt cache (where the cache types allow it)."""
        if self.engine.prompt_cache is None or s.req.forced is not None:
            return
        if all(hasattr(c, "extract") for c in self.cache):
            caches = [c.extract(row) for c in self.cache]
            if self.ahead is not None:  # the step built ahead wrote one more token than s was fed
                trim_prompt_cache(caches, 1)
            self.engine.keep_prefix(s.req, s.fed, caches)

    def abandon(self) -> list[Sequence]:
        """After an error: every sequence leaves (the caller answers them); the runtime is recovered."""
        seqs, self.seqs, self.cache, self.ahead, self.early = self.seqs, [], None, None, []
        self.engine.store.runtime.recover()
        return seqs


def _share_offsets(cache: list) -> None:
    """Every layer's positions array the first batched layer's: equal in value (the same sequences, the same tokens:
    merged, filtered or grown each on its own, they are distinct arrays), one array lets a decode step advance them
    once for all layers (compute/dense.py _advanced)."""
    batched = [c for c in cache if type(c) is BatchKVCache]
    for c in batched[1:]:
        c.offset = batched[0].offset


def _charge(seqs: list[Sequence], before: tuple, after: tuple) -> None:
    """The reads of a step (or a prefill), shared evenly by the sequences it served."""
    share = [(a - b) / len(seqs) for a, b in zip(after, before)]
    for s in seqs:
        s.fig.bytes_read += int(share[0])
        s.fig.cold_bytes += share[1]
        s.fig.reads += int(share[2])
        s.fig.stall_s += share[3]
