"""The generation engine behind `edge0 serve` and `edge0 chat`: one loaded store, one generation at a time.

Chat prompts use the model's chat template (mlx-lm's tokenizer wrapper); a tokenizer without one gets
    "system: ...\n\nuser: ...\n\nassistant:" (one "role: content" paragraph per message).

Every call here does MLX work and blocks: the server runs them all on one worker thread, the chat on
its own thread. Figures are per generation (differences of the store's cumulative counters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..errors import Edge0Error
from ..model.arch import vocab_size
from ..sched.generate import StepTimes, generate_steps

# Chat prompt for a tokenizer without a chat template: one "role: content" paragraph per message,
# then "assistant:" for the answer to follow.
FALLBACK_TEMPLATE = "{role}: {content}\n\n"
FALLBACK_PROMPT = "assistant:"


@dataclass
class GenRequest:
    """What one generation needs, already tokenized and validated."""

    prompt: list[int]  # prompt token ids
    max_tokens: int  # most tokens to generate
    temp: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: continue the engine's random state
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends when the text holds one (trimmed)
    ignore_eos: bool = False  # keep generating past end-of-sequence


@dataclass
class Figures:
    """What one generation cost; the server's `usage` and `x_edge0`, the chat's /stats."""

    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated (a stop string's tokens included, EOS not)
    finish_reason: str = "length"  # "stop" (EOS or a stop string), "length", "cancelled"
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    prefill_s: float = 0.0  # prompt processing until the first token
    decode_s: float = 0.0  # first token to last
    bytes_read: int = 0  # expert bytes read from the store
    cold_bytes: float = 0.0  # of those, not in the page cache before the read
    reads: int = 0
    stall_s: float = 0.0  # compute waiting on prefetch reads (--routing prefetch)

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


class Engine:
    """A loaded store and its sampling; `generate` runs one generation on the calling thread."""

    def __init__(self, store, *, model_id: str | None = None):
        self.store = store
        self.model_id = model_id or store.path.name
        tok = store.tokenizer
        self.eos = set(tok.eos_token_ids)
        cfg = store.config
        self.context = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
        self.vocab = vocab_size(cfg)  # valid ids: [0, vocab)

    @classmethod
    def open(cls, args) -> "Engine":
        """Load the store named by the flags shared with `edge0 run`, checked and built the same way."""
        from ..run import open_store

        return cls(open_store(args), model_id=getattr(args, "model_id", None))

    def close(self, end_thread: bool = False) -> None:
        """Close the store. end_thread: also clear the calling thread's MLX streams, as a thread that used MLX
        must before the process exits (or it may abort at exit); only when the process ends next, since it
        broke MLX on other threads of a process that goes on (the in-process test server)."""
        self.store.close()
        if end_thread:
            mx.clear_streams()

    # -- prompts (no MLX: safe on any thread) ----------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        return self.store.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The tokenizer's chat template, or FALLBACK_TEMPLATE where the model has none."""
        tok = self.store.tokenizer
        if getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template(messages, add_generation_prompt=True))
        text = "".join(FALLBACK_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages)
        return tok.encode(text + FALLBACK_PROMPT)

    def check_length(self, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise Edge0Error("the prompt encodes to no tokens")
        if self.context and len(prompt) + max_tokens > self.context:
            raise Edge0Error(f"the prompt's {len(prompt)} tokens + max_tokens {max_tokens} exceed the model's "
                             f"context of {self.context} tokens")

    # -- generation (MLX: one thread) ------------------------------------------------------------

    def generate(self, req: GenRequest, emit: Callable[[str], None], cancelled: Callable[[], bool]) -> Figures:
        """Generate, calling emit(text) with each new piece of text; stop at EOS, a stop string, max_tokens,
        or when cancelled() turns true (checked once per token). Closing the step generator cancels pending
        prefetch reads, so the next generation starts with consistent banks."""
        from mlx_lm.sample_utils import make_sampler

        store, tok = self.store, self.store.tokenizer
        stats = store.reader.stats
        sched = getattr(store.runtime, "sched", None)
        before = (stats.bytes, stats.cold_bytes, stats.reads, sched.stats.stall_s if sched else 0.0)
        if req.seed is not None:
            mx.random.seed(req.seed)
        sampler = make_sampler(temp=req.temp, top_p=req.top_p if 0 < req.top_p < 1 else 0.0, top_k=req.top_k)
        times = StepTimes()
        detok = tok.detokenizer
        detok.reset()
        detok.add_token(req.prompt[-1])  # spacing context for the first token, as `edge0 run` does
        _ = detok.last_segment  # consumed: not part of the answer
        stops = StopFilter(req.stop)
        fig = Figures(prompt_tokens=len(req.prompt))
        steps = generate_steps(store.model, req.prompt, max_tokens=req.max_tokens, sampler=sampler, times=times,
                               runtime=store.runtime)
        try:
            for t, _ in steps:
                if t in self.eos and not req.ignore_eos:
                    times.tokens.pop()
                    fig.finish_reason = "stop"
                    break
                fig.completion_tokens += 1
                detok.add_token(t)
                piece, hit = stops.feed(detok.last_segment)
                if piece:
                    emit(piece)
                if hit:
                    fig.finish_reason = "stop"
                    break
                if cancelled():
                    fig.finish_reason = "cancelled"
                    break
        finally:
            steps.close()  # runs runtime.finish(): no read left in flight
        if not stops.done:
            detok.finalize()
            piece, hit = stops.feed(detok.last_segment, final=True)
            if piece:
                emit(piece)
            if hit:
                fig.finish_reason = "stop"
        fig.prefill_s, fig.decode_s = times.prefill_s, times.decode_s
        fig.prefill_tok_s, fig.decode_tok_s = times.prefill_tok_s, times.decode_tok_s
        fig.bytes_read = stats.bytes - before[0]
        fig.cold_bytes = stats.cold_bytes - before[1]
        fig.reads = stats.reads - before[2]
        fig.stall_s = (sched.stats.stall_s if sched else 0.0) - before[3]
        return fig


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
