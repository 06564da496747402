"""The one generation loop, shared by `edge0 run`, `edge0 serve` and `edge0 chat`: sampling, the streaming
detokenizer, EOS, stop strings, cancellation and the figures of one generation.

The token loop itself (prefill, one step per token, the runtime's hooks) is pipeline/steps.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx


@dataclass
class GenRequest:
    """One generation, already tokenized; `Engine.check` validates it against the model."""

    prompt: list[int]  # prompt token ids
    max_tokens: int  # most tokens to generate
    temp: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: continue the random state
    stop: list[str] = field(default_factory=list)  # generation ends when the text holds one (trimmed)
    ignore_eos: bool = False  # keep generating past end-of-sequence
    forced: list[int] | None = None  # replay these tokens instead of sampling (benchmarks)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from a token among the last PENALTY_TOKENS
    frequency_penalty: float = 0.0  # OpenAI's: subtracted for each time a token is among them
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> added to its log-probability


PENALTY_TOKENS = 20  # the tokens the penalties look back over, the prompt's included (mlx-lm's default window)


class Penalties:
    """A request's logit bias and presence and frequency penalties, applied to a step's log-probabilities before
    sampling as mlx-lm's logits processors apply them (mlx_lm.sample_utils; the penalties over the last
    PENALTY_TOKENS tokens), then renormalized; the log-probabilities a caller reports stay the model's. All three
    add to log-probabilities, so applying them there or to the logits samples alike. The tokens are an array the
    graph extends, so that a step can be built before the token before it is on the host (overlapped decode)."""

    def __init__(self, req: GenRequest):
        from mlx_lm.sample_utils import make_logits_processors

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

    def sampler(self, sample: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        """sample, on penalized log-probabilities, its tokens taken."""
        return lambda logprobs: self.took(sample(self(logprobs)))


@dataclass
class Figures:
    """What one generation produced and cost: `edge0 run --json`, the server's `usage` and `x_edge0`, chat's /stats."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, served from the prompt cache (not prefilled)
    completion_tokens: int = 0  # tokens generated (a stop string's tokens included, EOS not)
    tokens: list[int] = field(default_factory=list)  # the generated ids (EOS not)
    text: str = ""  # the generated text (a stop string and what follows cut)
    finish_reason: str = "length"  # "stop" (EOS or a stop string), "length", "cancelled"
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    prefill_s: float = 0.0  # prompt processing until the first token
    decode_s: float = 0.0  # first token to last
    bytes_read: int = 0  # expert bytes read from the store
    cold_bytes: float = 0.0  # of those, not in the page cache before the read
    reads: int = 0
    stall_s: float = 0.0  # decode steps' compute waiting on prefetch reads (scheduled routing), as decode_s
    prefill_stall_s: float = 0.0  # the same during the prompt and its first token (banks start empty)
    peak_mlx_bytes: int = 0  # MLX's peak allocation when the generation ended: since it began (alone), or since
    # the process or the last generation alone began (batched: a batch does not reset the peak)

    @property
    def cold_fraction(self) -> float:
        return self.cold_bytes / self.bytes_read if self.bytes_read else 0.0

    def x_edge0(self) -> dict:
        return {"decode_tok_s": round(self.decode_tok_s, 3), "prefill_tok_s": round(self.prefill_tok_s, 3),
                "bytes_read": self.bytes_read, "reads": self.reads, "cold_fraction": round(self.cold_fraction, 4),
                "stall_ms": round(1e3 * self.stall_s, 3), "prefill_ms": round(1e3 * self.prefill_s, 3),
                "decode_ms": round(1e3 * self.decode_s, 3)}

    def line(self) -> str:
        return (f"prompt {self.prompt_tokens} tok at {self.prefill_tok_s:.1f} tok/s, {self.completion_tokens} tok at "
                f"{self.decode_tok_s:.2f} tok/s, read {self.bytes_read / 2**20:.1f} MiB in {self.reads} reads "
                f"({100 * self.cold_fraction:.0f}% cold), stall {1e3 * self.stall_s:.1f} ms, {self.finish_reason}")


def generate(engine, req: GenRequest, emit: Callable[[str], None], cancelled: Callable[[], bool]) -> Figures:
    """Generate on the calling thread, calling emit(text) with each new piece of text; stop at EOS, a stop
    string, max_tokens, or when cancelled() turns true (checked once per token). The step generator's
    close (in its finally) leaves no read in flight, so the next generation starts clean."""
    from mlx_lm.sample_utils import make_sampler

    from .pipeline.steps import StepTimes, generate_steps

    engine.check(req)
    store = engine.store
    cache, cached = engine.cached_prefix(req)
    before = _counters(store)
    if req.seed is not None:
        mx.random.seed(req.seed)
    mx.reset_peak_memory()
    sampler = make_sampler(temp=req.temp, top_p=req.top_p if 0 < req.top_p < 1 else 0.0, top_k=req.top_k)
    penalties = Penalties.of(req)
    sampler = penalties.sampler(sampler) if penalties is not None else sampler
    times = StepTimes()
    text = TextOut(engine.tokenizer.detokenizer, req.prompt[-1], req.stop, emit)
    fig = Figures(prompt_tokens=len(req.prompt), cached_tokens=cached)
    steps = generate_steps(store.model, req.prompt[cached:], max_tokens=req.max_tokens, sampler=sampler,
                           times=times, runtime=store.runtime, forced=req.forced or None, cache=cache)
    first = None  # counters when the first token came out: decode figures start there
    yielded: list[int] = []  # every token out, EOS included: all but the last are in the KV cache
    try:
        for t, _ in steps:
            first = first or _counters(store)
            yielded.append(t)
            if t in engine.eos and not req.ignore_eos:
                times.tokens.pop()
                fig.finish_reason = "stop"
                break
            fig.completion_tokens += 1
            if text.add(t):
                fig.finish_reason = "stop"
                break
            if cancelled():
                fig.finish_reason = "cancelled"
                break
    finally:
        steps.close()  # runs runtime.finish(): no read left in flight
    engine.keep_prefix(req, req.prompt + yielded[:-1], cache)
    fig.finish_reason = "stop" if text.finish() else fig.finish_reason
    fig.tokens, fig.text = list(times.tokens), text.text
    fig.prefill_s, fig.decode_s = times.prefill_s, times.decode_s
    fig.prefill_tok_s, fig.decode_tok_s = times.prefill_tok_s, times.decode_tok_s
    after = _counters(store)
    fig.bytes_read, fig.cold_bytes, fig.reads, _ = (a - b for a, b in zip(after, before))
    first = first or after
    fig.prefill_stall_s, fig.stall_s = first[3] - before[3], after[3] - first[3]
    fig.peak_mlx_bytes = mx.get_peak_memory()
    return fig


class TextOut:
    """Tokens to emitted text: the streaming detokenizer, then the stop strings."""

    def __init__(self, detok, last_prompt_token: int, stop: list[str], emit: Callable[[str], None]):
        self.detok, self.emit = detok, emit
        detok.reset()
        detok.add_token(last_prompt_token)  # spacing context for the first token (a streaming detokenizer
        _ = detok.last_segment  # trims the leading space of its first token); consumed: not part of the answer
        self.stops = StopFilter(stop)
        self.pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _out(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            self.emit(piece)

    def add(self, token: int) -> bool:
        """Emit what token completes; True when a stop string appeared."""
        self.detok.add_token(token)
        piece, hit = self.stops.feed(self.detok.last_segment)
        self._out(piece)
        return hit

    def finish(self) -> bool:
        """Emit what the detokenizer and the stop filter held back; True when that held a stop string."""
        if self.stops.done:
            return False
        self.detok.finalize()
        piece, hit = self.stops.feed(self.detok.last_segment, final=True)
        self._out(piece)
        return hit


def _counters(store) -> tuple:
    """Cumulative (bytes, cold bytes, reads, stall seconds) of the store's reader and its I/O pool."""
    stats = store.reader.stats
    return stats.bytes, stats.cold_bytes, stats.reads, store.reader.pool.waited_s  # stalls: waits on reads, any routing


class StopFilter:
    """Holds back text that may be the start of a stop string; reports a stop string once it appears.

    feed(piece) -> (text safe to emit, hit). On a hit the text is cut before the stop string.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # generated text not emitted yet
        self.done = False

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, bool]:
        if self.done:
            return "", True
        text = self.held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.done, self.held = True, ""
            return text[:cut], True
        keep = 0 if final else max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                                    if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False
