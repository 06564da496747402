"""`edge0 chat`: a terminal conversation with an Edge0 store, answers streamed as they are decoded.

    edge0 chat --model ~/stores/qwen3-30b --system "Answer briefly."

Commands: /stats (the last answer's figures; toggles printing them after every answer), /reset (forget the
conversation), /help, /quit (or Ctrl-D). Ctrl-C during an answer stops it at the next token.
All MLX work runs on this one thread.
"""

from __future__ import annotations

import signal
import sys
import threading

from ..engine import Engine, open_engine
from ..generation import Figures, GenRequest

HELP = "/stats  figures of the last answer (and toggle them after every answer)\n" \
       "/reset  start a new conversation\n/quit   leave (or Ctrl-D)"


def chat(args, *, stdin=None, out=None) -> int:
    from . import serve_configs

    stdin = stdin or sys.stdin
    out = out or sys.stdout
    config, samp = serve_configs(args)
    engine = open_engine(config)
    show = bool(args.stats)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    last: Figures | None = None
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
            cmd = text.strip()
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/help":
                print(HELP, file=out)
                continue
            if cmd == "/reset":
                messages = list(system)
                print("(new conversation)", file=out)
                continue
            if cmd == "/stats":
                show = not show
                print(last.line() if last else "(no answer yet)", file=out)
                print(f"(figures after every answer: {'on' if show else 'off'})", file=out)
                continue
            messages.append({"role": "user", "content": text})
            prompt = engine.encode_chat(messages)
            room = (engine.context - len(prompt)) if engine.context else samp.max_tokens
            if room < 1:
                print("edge0 chat: the conversation fills the model's context; /reset to start again", file=sys.stderr)
                messages.pop()
                continue
            req = GenRequest(prompt=prompt, max_tokens=min(samp.max_tokens, room), temp=samp.temp, top_p=samp.top_p,
                             seed=samp.seed if last is None else None)
            answer: list[str] = []

            def emit(piece: str) -> None:
                answer.append(piece)
                out.write(piece)
                out.flush()

            last = _answer(engine, req, emit)
            out.write("\n")
            messages.append({"role": "assistant", "content": "".join(answer)})
            if last.finish_reason == "cancelled":
                print("(stopped)", file=out)
            if show:
                print(f"[edge0] {last.line()}", file=out)
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
