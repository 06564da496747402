"""The decode loop: up to max_batch sequences decode together, one model step per token for all of them. A sequence
alone (decode/loop.py: engine.generate, generate_steps) is a batch of one (`alone`): its own KV cache (mlx-lm's
KVCache), the runtime's routing state as it leaves it, one sequence's overlap rule (runtime.overlaps_steps), and its
caller brackets the generation with the runtime's begin / finish / recover and takes its figures whole.

A step, as vLLM v1's: plan (StepPlan, host only) -> execute (build, queue or evaluate) -> update from its output
(tokens to the host, to their sequences' Tally; the finished leave). What depends only on the rows (a trimmable KV
cache, greedy sampling, forced tokens, the batched caches) is decided when they change (_rows_changed), not at every
step.

A new sequence's prompt is prefilled alone (through the prompt cache) at a step boundary, then its KV
cache joins the batch's (mlx-lm's BatchKVCache, left-padded); a finished or cancelled sequence leaves at
the next boundary without stalling the others. One step feeds each sequence its next input token, so the
routed experts of a step are the union over the batch: each layer's executor reads that union once
(the staged banks hold 2K slots per sequence, up to E). The routing history that prerouter heads read
follows the batch's rows (runtime.keep_rows / join); when sequences join, the step after routes every
consumer layer with its own router.

Where no layer syncs with the host inside a step (every expert resident, or streamed predicted routing where
every layer is routed by its head or holds its experts, and each streamed bank holds two steps' candidates of
every row: `runtime.overlaps_batch`) step n+1's graph is built from step n's unevaluated tokens and queued before
those reach the host (as mlx-lm's generate_step does). A sequence that finishes at step n has had step n+1 computed
for nothing; its row of that step leaves with it (its KV cache, kept for the prompt cache, is trimmed by that
token). No step is built past every row's max_tokens. A newcomer waits for the step built ahead to be taken first
(`settle`).

Everything here runs on the engine's one worker thread (or the caller's, alone).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, can_trim_prompt_cache, trim_prompt_cache

from ..compute.kernels import host_eval
from ..compute.runtime import Hooks
from ..sched.trace import NULL, now_us
from .prefill import prefill
from .request import Figures, GenRequest
from .rows import Built, Sequence, StepPlan, charge, counters, forced_one, forced_rows
from .sampling import Penalties, RowSampler, sampler_for
from .step import forward, overlaps
from .text import Tally, TextOut


class BatchDecoder:
    """The running batch of one engine, or a sequence alone (a batch of one: alone())."""

    def __init__(self, engine, max_batch: int):
        self.engine, self.max_batch, self.alone = engine, max_batch, False
        self.model, self.rt = engine.store.model, engine.store.runtime
        self.seqs: list[Sequence] = []
        self.cache: list | None = None  # the batch's KV caches, one per layer
        self.early: list[Sequence] = []  # done at their first token, at admission: reported by the next step
        self.ahead: Built | None = None  # a step built ahead for self.seqs, its tokens not yet on the host
        self.keep_logprobs = False  # each taken step's (V,) log-probabilities into its Sequence (generate_steps)
        self.stepped = 0  # steps taken since the batch was last idle (the trace's step numbers)
        self._rows_changed()

    @classmethod
    def alone(cls, model, runtime: Hooks, engine=None) -> "BatchDecoder":
        """A batch of one for a sequence alone: model and runtime (engine: for admit, the prompt cache)."""
        self = cls.__new__(cls)
        self.engine, self.max_batch, self.alone, self.model, self.rt = engine, 1, True, model, runtime
        self.seqs, self.cache, self.early, self.ahead, self.keep_logprobs, self.stepped = [], None, [], None, False, 0
        self._rows_changed()
        return self

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
        if req.forced and len(req.forced) < req.max_tokens:
            req = dataclasses.replace(req, max_tokens=len(req.forced))  # a replay ends with its tokens
        self.settle()
        if not self.seqs and not self.alone:
            self.rt.begin()  # an idle batch: nothing of earlier generations is carried
        if self.alone and req.seed is not None:
            mx.random.seed(req.seed)  # as mlx-lm's generate: later unseeded requests draw from there
        before_reads = None if self.alone else counters(engine.store)
        t0 = time.perf_counter()
        with engine.kernel.active():
            cache, cached = engine.cached_prefix(req)
            text = TextOut(engine.tokenizer.detokenizer, req.prompt[-1], req.stop, emit)
            tally = Tally(req, engine.eos, text, Figures(prompt_tokens=len(req.prompt), cached_tokens=cached), cancelled)
            sample, greedy = self._sampler(req)
            seq = Sequence(req, tally, sample, req.prompt[-1], fed=list(req.prompt[:-1]), started=t0, greedy=greedy)
            self.start(seq, req.prompt[cached:], cache)
        if before_reads is not None:
            charge([seq], before_reads, counters(engine.store))
        return seq

    def _sampler(self, req: GenRequest) -> tuple[Callable, bool]:
        """(its sampler, whether its token is the argmax): alone, mlx-lm's on MLX's global random state, as mlx-lm's
        generate; a batch's row, its own key (the request's seed, else drawn from that state)."""
        if self.alone:
            return sampler_for(req), req.temp == 0 and Penalties.of(req) is None
        seed = req.seed if req.seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
        sample = RowSampler(req, seed)
        return sample, sample.greedy

    def start(self, seq: Sequence, prompt: list[int], cache: list) -> Sequence:
        """seq's prompt (all but its last token, seq.next_input) into cache, then its first step; it joins the batch,
        or, done at its first token, the next step() reports it."""
        rt, before = self.rt, None
        if not self.seqs:
            self.stepped = 0
        if not self.alone:
            before = rt.snapshot()
            rt.join([])  # the newcomer routes on its own: no history, nothing decided ahead
        prefill(self.model, prompt[:-1], cache, rt)
        self._take(seq, self._first_step(seq, cache), time.perf_counter())
        rows = [(before, len(self.seqs))] if self.seqs else []
        if seq.done:
            self.early.append(seq)
            self._finish([seq], None)
            if self.alone:
                self._keep(seq, cache)
            else:
                rt.join(rows)
            return seq
        if not self.alone:
            rt.join(rows + [(rt.snapshot(ahead=1), 1)])
        self._merge(cache)
        self.seqs.append(seq)
        self._rows_changed()
        if self.alone and self.overlaps():  # its second step queued before its first token is taken, as every next one
            self.ahead = self._build(mx.array([[seq.next_input]], dtype=mx.uint32))
            rt.step_built()
            mx.async_eval(self.ahead.tokens, self.ahead.also)
        return seq

    def _first_step(self, seq: Sequence, cache: list) -> int:
        """The sequence's last prompt token through the model alone; its first token. Alone, a whole step; a newcomer's
        step is not ended: its routing state joins the batch's (start)."""
        t_step = now_us()
        logprobs, first = forward(self.model, mx.array([[seq.next_input]], dtype=mx.uint32), cache)
        token = forced_one(seq, seq.sample(logprobs))
        also = first if self.keep_logprobs or seq.req.forced else token
        if self.alone:
            self._evaluate(token, also, hold=not overlaps(self.rt, cache), t_step=t_step)
            self.stepped += 1
        else:
            mx.eval(token, also)
            self.rt.sync()
        seq.fed.append(seq.next_input)
        seq.logprobs = first if self.keep_logprobs else None
        return int(token.item())  # SYNC: the first token, once per sequence

    def _merge(self, cache: list) -> None:
        """Join a sequence's KV cache (one row) to the batch's; alone, it is the batch's."""
        if self.alone:
            self.cache = cache
            return
        one = [type(c).merge([c]) if hasattr(type(c), "merge") else c for c in cache]
        if self.cache is None:
            self.cache = one
        else:
            for mine, theirs in zip(self.cache, one):
                mine.extend(theirs)

    def _rows_changed(self) -> None:
        """What depends only on the rows, decided once per change of the batch: whether the KV cache can drop a token
        (a walk over every layer), one argmax for all, whether rows replay forced tokens, the batched caches that
        share one offsets array; and the runtime's trace."""
        seqs, rt = self.seqs, self.rt
        self.trace = rt.trace or NULL
        self.trimmable = bool(seqs) and can_trim_prompt_cache(self.cache)  # walks every layer: not at every step
        self.greedy = all(s.greedy for s in seqs)
        self.forced = any(s.req.forced for s in seqs)
        batched = [c for c in self.cache or () if type(c) is BatchKVCache]
        self.batched = batched if len(batched) > 1 else []

    def overlaps(self) -> bool:
        """Whether the next step may be built before this one's tokens reach the host: no layer syncs with the host
        inside a step (alone: runtime.overlaps_steps, decode/step.py overlaps; a batch: overlaps_batch) and the KV
        cache can drop the token of a step built past the last one taken."""
        rt = self.rt
        return (rt.overlaps_steps if self.alone else rt.overlaps_batch(len(self.seqs))) and self.trimmable

    def step(self) -> list[Sequence]:
        """One decode step for every sequence; returns the sequences that finished (and left the batch)."""
        early, self.early = self.early, []
        if not self.seqs:
            return early
        plan = self._plan()
        t_step = now_us() if self.trace.on else 0
        if self.alone:  # the caller is inside the kernel's context and takes the generation's reads whole
            sampled = self._execute(plan, t_step)
        else:
            before_reads = counters(self.engine.store)
            with self.engine.kernel.active():
                sampled = self._execute(plan, t_step)
            charge(self.seqs, before_reads, counters(self.engine.store))
        finished = self._take_step(sampled)
        if self.trace.on and (plan.overlap or plan.built is not None):  # queued, not timed by _evaluate
            self.trace.span("step", "step", t_step, now_us(), step=self.stepped)
        self.stepped += 1
        return early + finished

    def _plan(self) -> StepPlan:
        """What this step runs (host only): the step built ahead, if any, and whether to build the next one ahead
        (not past every row's last token)."""
        built, self.ahead = self.ahead, None
        overlap = self.overlaps() and any(s.fig.completion_tokens + 1 < s.req.max_tokens for s in self.seqs)
        return StepPlan(len(self.seqs), overlap, built)

    def _evaluate(self, sampled: mx.array, also: mx.array, *, hold: bool = True, t_step: float = 0.0) -> None:
        """A step's tokens evaluated, one step at a time: runtime.flush starts what may overlap the evaluation
        (scheduled routing's last predictions), settled before the fence moves."""
        rt = self.rt
        rt.flush()
        t_eval = now_us()
        host_eval(sampled, also, hold=hold)
        rt.settle()
        rt.sync()
        rt.next_step()
        if self.trace.on:
            self.trace.span("step", "step", t_step, now_us(), step=self.stepped)
            self.trace.span("head+sample", "sample", t_eval, now_us(), step=self.stepped)

    def _execute(self, plan: StepPlan, t_step: float) -> Built:
        """The plan's step (built now, or ahead by the step before) and, overlapping, the next one queued from its
        unevaluated tokens before those reach the host; this step."""
        rt, built = self.rt, plan.built
        if built is None:
            built = self._build(mx.array([[s.next_input] for s in self.seqs], dtype=mx.uint32))
            if plan.overlap:
                rt.step_built()
                mx.async_eval(built.tokens, built.also)
            else:
                self._evaluate(built.tokens, built.also, t_step=t_step)
        if plan.overlap:
            self.ahead = self._build(built.tokens[:, None])
            rt.step_built()  # what it decided ahead is for the step built next; its slots stay fenced
            mx.async_eval(self.ahead.tokens, self.ahead.also)
        return built

    def settle(self) -> None:
        """Take the step built ahead, if any (its tokens to the host, finished sequences out), so that the batch
        can change: the next step() reports what finished."""
        if self.ahead is not None:
            built, self.ahead = self.ahead, None
            self.early += self._take_step(built)

    def _build(self, inputs: mx.array) -> Built:
        """The graph of one step for every sequence from inputs (B, 1). A row replaying forced tokens takes its next
        one, a constant: taking it waits for no step, so a replay queues steps ahead."""
        for c in self.batched[1:]:  # one offsets array for every layer: a step advances it once (compute/dense.py)
            c.offset = self.batched[0].offset
        logprobs, first = forward(self.model, inputs, self.cache)  # (B, V), (V,)
        seqs = self.seqs
        if len(seqs) == 1:  # a greedy row's argmax is not built where a forced token takes its place
            s = seqs[0]
            sampled = forced_one(s, None if self.greedy and self.forced else
                                 mx.argmax(logprobs, axis=-1) if self.greedy else s.sample(logprobs))
        else:
            sampled = mx.argmax(logprobs, axis=-1) if self.greedy else \
                mx.concatenate([s.sample(logprobs[i:i + 1]) for i, s in enumerate(seqs)])  # (B,)
            if self.forced:
                sampled = forced_rows(seqs, sampled)
        also = first if self.keep_logprobs or self.forced else sampled  # a forced step: computed, not argmaxed
        return Built(sampled, first if self.keep_logprobs else None, also)

    def _take_step(self, built: Built) -> list[Sequence]:
        """Update from a step's output: its tokens to the host and to their sequences; the finished ones leave."""
        seqs = self.seqs
        tokens = built.tokens.tolist()  # SYNC: the batch's tokens to the host, once per step
        now = time.perf_counter()
        for s, t in zip(seqs, tokens):
            s.fed.append(s.next_input)
            s.logprobs = built.logprobs
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
            self._rows_changed()
            if not self.alone:  # alone, the caller ends the generation
                self.rt.finish()
            return
        for c in self.cache:
            c.filter(mx.array(keep))
        self.rt.keep_rows(keep)
        if self.ahead is not None:
            self.ahead = Built(self.ahead.tokens[mx.array(keep)], None, self.ahead.also)
        self._rows_changed()

    def _finish(self, finished: list[Sequence], cache: list | None) -> None:
        """Their last figures and text; their KV caches into the prompt cache."""
        for s in finished:
            s.tally.close(s.fig.finish_reason)
            s.fig.timed(s.fig.prompt_tokens - s.fig.cached_tokens, s.fig.prefill_s,
                        time.perf_counter() - (s.first_token or time.perf_counter()))
            s.fig.peak_mlx_bytes = mx.get_peak_memory()
            if self.alone and self.ahead is not None:
                self.drop_ahead()
            if cache is not None:
                self._keep_cache(s, self.seqs.index(s))

    def drop_ahead(self) -> None:
        """Alone: the step built ahead evaluated, its token dropped from the KV cache, which then holds what was fed."""
        mx.eval([c.state for c in self.cache])
        trim_prompt_cache(self.cache, 1)
        self.ahead = None

    def _keep_cache(self, s: Sequence, row: int) -> None:
        """Its KV cache, out of the batch's, into the prompt cache (where the cache types allow it)."""
        if self.engine is None or self.engine.prompt_cache is None or s.req.forced is not None:
            return
        if self.alone:
            self._keep(s, self.cache)
        elif all(hasattr(c, "extract") for c in self.cache):
            caches = [c.extract(row) for c in self.cache]
            if self.ahead is not None:  # the step built ahead wrote one more token than s was fed
                trim_prompt_cache(caches, 1)
            self._keep(s, caches)

    def _keep(self, s: Sequence, caches: list) -> None:
        """Its KV cache, which holds s.fed, into the prompt cache (engine.keep_prefix: not a forced replay's)."""
        if self.engine is not None:
            self.engine.keep_prefix(s.req, s.fed, caches)

    def abandon(self) -> list[Sequence]:
        """After an error: every sequence leaves (the caller answers them); the runtime is recovered."""
        seqs, self.seqs, self.cache, self.ahead, self.early = self.seqs, [], None, None, []
        self._rows_changed()
        self.rt.recover()
        return seqs
