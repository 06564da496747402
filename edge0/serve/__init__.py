"""`edge0 serve` (OpenAI-compatible HTTP server) and `edge0 chat` (terminal chat) over one Edge0 store.

    edge0 serve --model ~/stores/qwen3-30b --port 8080
    edge0 chat --model ~/stores/qwen3-30b
"""

from __future__ import annotations

import argparse

from ..flags import add_engine_flags, add_log_flags, add_sampling_flags, engine_config, sampling
from ..log import log


def _add_shared_flags(p: argparse.ArgumentParser, *, seed_help: str) -> None:
    add_engine_flags(p)
    add_sampling_flags(p, max_tokens=512, seed=None, seed_help=seed_help)
    add_log_flags(p)


def serve_configs(args: argparse.Namespace):
    """(EngineConfig, Sampling) of serve's or chat's flags, checked."""
    return engine_config(args), sampling(args)


DEFAULT_MAX_BATCH = 4  # concurrent requests decoded together by default (llama.cpp's server has 4 slots)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    from .server import DEFAULT_MAX_QUEUE

    # reseeding every request would make every sampled answer the same
    _add_shared_flags(p, seed_help="random seed applied to requests that give no 'seed' (default: none; sampling "
                                   "continues the server's random state)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0: any free port)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests that may wait behind the running one; more get 503 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                   help="sequences decoded together, one step per token for all (continuous batching: a new "
                        "request joins at a step boundary, the experts a step needs are read once for the batch, "
                        "each answer token for token as alone); the staged banks hold 2K slots per sequence, up to "
                        f"E (default {DEFAULT_MAX_BATCH}; 1: one generation at a time)")
    p.add_argument("--model-id", default=None, metavar="NAME",
                   help="the model name clients use (default: the store directory's name; edge0-demo for the "
                        "built-in model)")


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
    config, samp = serve_configs(args)
    loop = new_loop()
    asyncio.set_event_loop(loop)
    server = Server(config, samp, host=args.host, port=args.port, max_queue=args.max_queue)
    server.end_thread = True
    try:
        try:
            loop.run_until_complete(server.start())
        except OSError as e:
            raise Edge0Error(f"--host {args.host} --port {args.port}: cannot listen ({e.strerror or e})") from None
        log.info(f"serving {server.engine.model_id} on {server.url}/v1 (Ctrl-C stops)")
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
    _add_shared_flags(p, seed_help="random seed of the first answer (default: none)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message that starts the conversation")
    p.add_argument("--stats", action="store_true", help="print the figures after every answer (toggle with /stats)")


def chat_cli(args) -> int:
    from .chat import chat

    return chat(args)
