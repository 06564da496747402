"""Tokens to text and to a finish: the streaming detokenizer, stop strings, and the one rule that says when and why a
sequence ends (EOS or a stop string, max_tokens, the caller cancelling), for a sequence alone and a batch's rows."""

from __future__ import annotations

from typing import Callable

from .request import CANCELLED, LENGTH, STOP, Figures, GenRequest


class Tally:
    """A sequence's tokens into its figures and text, one at a time; take() says when and why it is done."""

    def __init__(self, req: GenRequest, eos: set, text: "TextOut", fig: Figures, cancelled: Callable[[], bool]):
        self.req, self.eos, self.text, self.fig, self.cancelled = req, eos, text, fig, cancelled

    def take(self, token: int) -> str | None:
        """token was sampled: its finish reason if the sequence ends here (EOS is not counted), else None."""
        if token in self.eos and not self.req.ignore_eos:
            return STOP
        fig = self.fig
        fig.completion_tokens += 1
        fig.tokens.append(token)
        if self.text.add(token):
            return STOP
        if fig.completion_tokens >= self.req.max_tokens:
            return LENGTH
        if self.cancelled():
            return CANCELLED
        return None

    def close(self, reason: str) -> None:
        """The sequence ended for `reason`: what the detokenizer held back is emitted (it may hold a stop string)."""
        self.fig.finish_reason = STOP if self.text.finish() else reason
        self.fig.text = self.text.text


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
