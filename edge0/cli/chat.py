"""`edge0 chat`: a terminal conversation with an Edge0 store, answers streamed as they are decoded.

    edge0 chat --model ~/stores/qwen3-30b --system "Answer briefly."

Commands: /stats (the last answer's figures; toggles printing them after every answer), /reset (forget the
conversation), /help, /quit (or Ctrl-D). Ctrl-C during an answer stops it at the next token.
All MLX work runs on this one thread.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from typing import TYPE_CHECKING

from ..errors import Edge0Error
from ..config.checks import not_utf8
from .flags import add_serving_flags, serve_configs

if TYPE_CHECKING:  # the engine (and MLX) load when a chat starts, not when the parser is built
    from ..engine import Engine
    from ..decode.request import Figures, GenRequest

HELP = "/stats  figures of the last answer (and toggle them after every answer)\n" \
       "/reset  start a new conversation\n/quit   leave (or Ctrl-D)"


def add_args(p: argparse.ArgumentParser) -> None:
    add_serving_flags(p, seed_help="random seed of the first answer (default: none)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message that starts the conversation")
    p.add_argument("--stats", action="store_true", help="print the figures after every answer (toggle with /stats)")


def main(args: argparse.Namespace) -> int:
    return chat(args)


class Conversation:
    """The state of one chat: its messages, the last answer's figures, whether figures are shown."""

    def __init__(self, engine: Engine, samp, out, *, system: str | None, show: bool):
        self.engine, self.samp, self.out, self.show = engine, samp, out, show
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.system)
        self.last: Figures | None = None

    def command(self, cmd: str) -> bool:
        """Run a /command; False when it ends the chat."""
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/help":
            print(HELP, file=self.out)
        elif cmd == "/reset":
            self.messages = list(self.system)
            print("(new conversation)", file=self.out)
        elif cmd == "/stats":
            self.show = not self.show
            print(self.last.line() if self.last else "(no answer yet)", file=self.out)
            print(f"(figures after every answer: {'on' if self.show else 'off'})", file=self.out)
        else:
            print(f"unknown command {cmd}\n{HELP}", file=self.out)
        return True

    def turn(self, text: str) -> None:
        """The user says text; the answer streams to out."""
        from ..decode.request import GenRequest

        engine, samp, out = self.engine, self.samp, self.out
        self.messages.append({"role": "user", "content": text})
        prompt = engine.encode_chat(self.messages)
        room = (engine.context - len(prompt)) if engine.context else samp.max_tokens
        if room < 1:
            print("edge0 chat: the conversation fills the model's context; /reset to start again", file=sys.stderr)
            self.messages.pop()
            return
        req = GenRequest(prompt=prompt, max_tokens=min(samp.max_tokens, room), temp=samp.temp, top_p=samp.top_p,
                         seed=samp.seed if self.last is None else None, **samp.penalties())

        def emit(piece: str) -> None:
            out.write(piece)
            out.flush()

        self.last = _answer(engine, req, emit)
        out.write("\n")
        self.messages.append({"role": "assistant", "content": self.last.text})
        if self.last.finish_reason == "cancelled":
            print("(stopped)", file=out)
        if self.show:
            print(f"[edge0] {self.last.line()}", file=out)


def chat(args, *, stdin=None, out=None) -> int:
    from ..engine import open_engine

    stdin = stdin or sys.stdin
    out = out or sys.stdout
    config, samp = serve_configs(args)
    bad = not_utf8(args.system) if args.system is not None else None
    if bad is not None:  # refused before the model loads; the tokenizer would raise on it at the first turn
        raise Edge0Error(f"--system: not UTF-8 text (byte {bad})")
    engine = open_engine(config)
    try:
        samp.check_context(engine.context)  # as run's and serve's: a turn would cut it to the room left silently
    except Edge0Error:
        engine.close()
        raise
    talk = Conversation(engine, samp, out, system=args.system, show=bool(args.stats))
    interactive = stdin.isatty()
    print(f"edge0 chat: {engine.model_id} (/help for commands)", file=sys.stderr)
    try:
        while True:
            if interactive:
                out.write(">>> ")
                out.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip().startswith("/"):
                if not talk.command(text.strip()):
                    break
                continue
            bad = not_utf8(text)
            if bad is not None:  # the tokenizer would raise on it: the line is refused, the conversation goes on
                print(f"edge0 chat: that line is not UTF-8 text (byte {bad}); say it again", file=sys.stderr)
                continue
            talk.turn(text)
    finally:
        engine.close()
    return 0


def _answer(engine: Engine, req: GenRequest, emit) -> Figures:
    """One answer; Ctrl-C meanwhile cancels it at the next token instead of leaving the chat."""
    stop = []
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return engine.generate(req, emit, lambda: False)
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        return engine.generate(req, emit, lambda: bool(stop))
    finally:
        signal.signal(signal.SIGINT, previous)
