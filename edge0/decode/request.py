"""What a generation is asked (GenRequest) and what it produced and cost (Figures), plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"  # finish reasons: EOS or a stop string, max_tokens, the caller


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


@dataclass
class Figures:
    """What one generation produced and cost: `edge0 run --json`, the server's `usage` and `x_edge0`, chat's /stats."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, served from the prompt cache (not prefilled)
    completion_tokens: int = 0  # tokens generated (a stop string's tokens included, EOS not)
    tokens: list[int] = field(default_factory=list)  # the generated ids (EOS not)
    text: str = ""  # the generated text (a stop string and what follows cut)
    finish_reason: str = LENGTH  # STOP (EOS or a stop string), LENGTH, CANCELLED
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

    def timed(self, prefilled: int, prefill_s: float, decode_s: float) -> None:
        """The wall-clock figures: `prefilled` prompt tokens in prefill_s, the tokens after the first in decode_s
        (the first token comes out of prefill)."""
        self.prefill_s, self.decode_s = prefill_s, decode_s
        self.prefill_tok_s = rate(prefilled, prefill_s)
        self.decode_tok_s = rate(len(self.tokens) - 1, decode_s)

    def x_edge0(self) -> dict:
        return {"decode_tok_s": round(self.decode_tok_s, 3), "prefill_tok_s": round(self.prefill_tok_s, 3),
                "bytes_read": self.bytes_read, "reads": self.reads, "cold_fraction": round(self.cold_fraction, 4),
                "stall_ms": round(1e3 * self.stall_s, 3), "prefill_ms": round(1e3 * self.prefill_s, 3),
                "decode_ms": round(1e3 * self.decode_s, 3)}

    def line(self) -> str:
        return (f"prompt {self.prompt_tokens} tok at {self.prefill_tok_s:.1f} tok/s, {self.completion_tokens} tok at "
                f"{self.decode_tok_s:.2f} tok/s, read {self.bytes_read / 2**20:.1f} MiB in {self.reads} reads "
                f"({100 * self.cold_fraction:.0f}% cold), stall {1e3 * self.stall_s:.1f} ms, {self.finish_reason}")


def rate(n: int, seconds: float) -> float:
    """n per second; 0 when there is nothing to time."""
    return n / seconds if n > 0 and seconds else 0.0
