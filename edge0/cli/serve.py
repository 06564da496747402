"""`edge0 serve`: an OpenAI-compatible HTTP server over one Edge0 store (edge0/serve/).

    edge0 serve --model ~/stores/qwen3-30b --port 8080
"""

from __future__ import annotations

import argparse

from .flags import add_serving_flags, serve_configs

DEFAULT_MAX_BATCH = 4  # concurrent requests decoded together by default (llama.cpp's server has 4 slots)


def add_args(p: argparse.ArgumentParser) -> None:
    from ..serve.server import DEFAULT_MAX_QUEUE

    # reseeding every request would make every sampled answer the same
    add_serving_flags(p, seed_help="random seed applied to requests that give no 'seed' (default: none; sampling "
                                   "continues the server's random state)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0: any free port)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests that may wait behind the running one; more get 503 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                   help="sequences decoded together, one step per token for all (continuous batching: a new "
                        "request joins at a step boundary, the experts a step needs are read once for the batch, "
                        "each answer token for token as alone); the staged banks hold 2K slots per sequence, up to "
                        "E. Over staged banks a step takes at most the sequences whose expected union of experts "
                        "fits a layer's --slots (more would re-read the overflow every step), said at start; the "
                        f"others wait (default {DEFAULT_MAX_BATCH}; 1: one generation at a time)")
    p.add_argument("--record-routes", metavar="DIR", default=None,
                   help="write each finished request's routing (every MoE layer's K ids and weights per token, "
                        "prompt and decode rows marked, the token ids) to DIR/<its id>.npz (chatcmpl-..., msg_...), "
                        "a trace --routes reads; DIR must be new or empty. Turns the prompt cache off (a trace starts "
                        "at the prompt's first token); batched requests are each their own trace")
    p.add_argument("--model-id", default=None, metavar="NAME",
                   help="the model name clients use (default: the store directory's name; edge0-demo for the "
                        "built-in model)")
    _add_front_flags(p)


def _add_front_flags(p: argparse.ArgumentParser) -> None:
    from ..serve.guard import API_KEY_ENV, DEFAULT_CLIENT_TIMEOUT, DEFAULT_MAX_BODY_MIB

    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="a key every request but GET /health must carry, as 'Authorization: Bearer KEY' or "
                        f"'x-api-key: KEY' (default: ${API_KEY_ENV}, which keeps it out of the process list); "
                        "required to listen on an address other than loopback")
    p.add_argument("--no-api-key", action="store_true",
                   help="listen on a --host other than loopback without a key: anyone who can reach it may use it")
    p.add_argument("--client-timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT, metavar="S",
                   help="seconds a client has to send a request's headers (from connecting or its previous answer), "
                        "as many for its body, and may leave its answer unread, before it is disconnected "
                        f"(default {DEFAULT_CLIENT_TIMEOUT:g})")
    p.add_argument("--max-body-mib", type=float, default=DEFAULT_MAX_BODY_MIB, metavar="MIB",
                   help=f"largest request body; a larger one gets 413 (default {DEFAULT_MAX_BODY_MIB})")


def front_config(args: argparse.Namespace):
    """The Front of serve's flags, checked: an address beyond loopback needs an API key or --no-api-key."""
    import math
    import os

    from ..errors import Edge0Error
    from ..serve.guard import API_KEY_ENV, Front

    for flag, value, hi in (("--client-timeout", args.client_timeout, 86400),
                            ("--max-body-mib", args.max_body_mib, 4096)):
        if not (math.isfinite(value) and 0 < value <= hi):
            raise Edge0Error(f"{flag} {value:g}: must be more than 0 and at most {hi}")
    env = os.environ.get(API_KEY_ENV) or None  # set but empty: no key
    where = "--api-key" if args.api_key is not None else API_KEY_ENV
    key = args.api_key if args.api_key is not None else env
    if args.no_api_key and key is not None:
        raise Edge0Error(f"--no-api-key: {where} gives a key too; drop one of them")
    if key is not None and not (key and all(33 <= ord(c) <= 126 for c in key)):
        raise Edge0Error(f"{where}: must be printable ASCII without spaces (an HTTP header carries it)")
    if key is None and not args.no_api_key and not _is_loopback(args.host):
        raise Edge0Error(f"--host {args.host}: listening beyond this machine needs an API key: give --api-key KEY "
                         f"(or set {API_KEY_ENV}), or --no-api-key to let anyone who can reach it use the server")
    return Front(api_key=key, client_timeout=args.client_timeout, max_body=int(args.max_body_mib * 2**20))


def _is_loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's loopback (a name is resolved, as listening does)."""
    import ipaddress
    import socket

    from ..errors import Edge0Error

    if not host:
        return False
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise Edge0Error(f"--host {host}: cannot resolve it ({getattr(e, 'strerror', None) or e})") from None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in found)


def main(args: argparse.Namespace) -> int:
    """Run the server until interrupted (Ctrl-C or SIGTERM)."""
    import asyncio
    import signal

    from ..dist import follow_served
    from ..dist.routes import refuse_record
    from ..errors import Edge0Error
    from ..log import log
    from ..sched.loop import new_loop
    from ..serve.server import Server

    if not 0 <= args.port <= 65535:
        raise Edge0Error(f"--port {args.port}: must be between 0 and 65535 (0: any free port)")
    if args.max_queue < 0:
        raise Edge0Error(f"--max-queue {args.max_queue}: must not be negative")
    front = front_config(args)
    config, samp = serve_configs(args)
    refuse_record(args.record_routes)
    if follow_served(config):  # a rank > 0 under mlx.launch (edge0/dist): rank 0 serves, this one follows
        return 0
    loop = new_loop()
    asyncio.set_event_loop(loop)
    from ..serve.routes_record import record_dir

    record = record_dir(args.record_routes) if args.record_routes is not None else None
    server = Server(config, samp, host=args.host, port=args.port, max_queue=args.max_queue, front=front,
                    record_routes=record)
    server.end_thread = True
    try:
        try:
            loop.run_until_complete(server.start())
        except OSError as e:
            raise Edge0Error(f"--host {args.host} --port {args.port}: cannot listen ({e.strerror or e})") from None
        log.info(f"serving {server.engine.model_id} on {server.url}/v1 "
                 f"({'with an API key' if front.api_key else 'no API key'}; Ctrl-C stops)")
        if front.api_key is None and not _is_loopback(args.host):
            log.warning(f"no API key on {args.host} (--no-api-key): anyone who can reach it may use this server")
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
