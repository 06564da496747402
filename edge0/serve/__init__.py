"""`edge0 serve` (OpenAI-compatible HTTP server) and `edge0 chat` (terminal chat) over one Edge0 store.

    edge0 serve --model ~/stores/qwen3-30b --port 8080
    edge0 chat --model ~/stores/qwen3-30b
"""

from __future__ import annotations

import argparse
import sys

# Flags of `edge0 run` that make no sense for a server or a chat; every other one of its flags (the model, how
# its experts are read and routed, the sampling defaults) is shared, with the same meaning and checks.
RUN_ONLY = {"prompt": None, "max_tokens": None, "chat": False, "ignore_eos": False, "replay": None, "json": False,
            "trace": None}


def _add_shared_flags(p: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """Copy `edge0 run`'s flags but RUN_ONLY, so that help texts and defaults have one source."""
    from ..cli import add_run_flags

    run = argparse.ArgumentParser(add_help=False)
    add_run_flags(run)
    for action in run._actions:  # argparse's own `parents=` copies actions the same way
        if action.dest not in RUN_ONLY:
            p._add_action(action)
    p.set_defaults(**{k: v for k, v in RUN_ONLY.items() if k != "max_tokens"})  # args stay a superset of run's
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"tokens to generate when a request does not say (default {max_tokens})")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    from .server import DEFAULT_MAX_QUEUE

    _add_shared_flags(p, max_tokens=512)
    for action in p._actions:
        if action.dest == "seed":  # reseeding every request would make every sampled answer the same
            action.default = None
            action.help = ("random seed applied to requests that give no 'seed' (default: none; sampling continues "
                           "the server's random state)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0: any free port)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests that may wait behind the running one; more get 503 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--model-id", default=None, metavar="NAME",
                   help="the model name clients use (default: the store directory's name)")


def serve_cli(args) -> int:
    """Run the server until interrupted (Ctrl-C or SIGTERM)."""
    import asyncio
    import signal

    from ..errors import Edge0Error
    from ..sched.scheduler import new_loop
    from .server import Server

    if not 0 <= args.port <= 65535:
        raise Edge0Error(f"--port {args.port}: must be between 0 and 65535 (0: any free port)")
    if args.max_queue < 0:
        raise Edge0Error(f"--max-queue {args.max_queue}: must not be negative")
    loop = new_loop()
    asyncio.set_event_loop(loop)
    server = Server(args, host=args.host, port=args.port, max_queue=args.max_queue)
    server.end_thread = True
    try:
        try:
            loop.run_until_complete(server.start())
        except OSError as e:
            raise Edge0Error(f"--host {args.host} --port {args.port}: cannot listen ({e.strerror or e})") from None
        print(f"edge0 serve: {server.engine.model_id} on {server.url}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        loop.run_until_complete(stop.wait())
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal ends the process at once
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass
    finally:
        loop.run_until_complete(server.stop())
        loop.close()
    return 0


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    _add_shared_flags(p, max_tokens=512)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message that starts the conversation")
    p.add_argument("--stats", action="store_true", help="print the figures after every answer (toggle with /stats)")


def chat_cli(args) -> int:
    from .chat import chat

    return chat(args)
