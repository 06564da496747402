"""`edge0 serve` across ranks: rank 0 runs the HTTP server; before each generation it posts the request (tokens and
sampling settings) to the other ranks, which run the same generation in a worker loop and end when rank 0 stops.

Everything goes over the ranks' own collectives on the MLX thread (no second connection): a post is one all_sum of
a header and one of the payload; during a generation each token's cancellation check is one all_sum of rank 0's
flag, so a client that leaves stops every rank at the same token. A rank that is lost fails the next collective on
rank 0 (one Edge0Error: the server turns unhealthy and says why on /health, and the service stops).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time

import mlx.core as mx

from ..errors import Edge0Error
from ..log import log

REQUEST, STOP = 1, 2


class Channel:
    """Rank 0 -> every rank, blocking, on the thread that runs MLX."""

    def __init__(self, group):
        self.group = group

    def _sum(self, a: mx.array) -> mx.array:
        out = mx.distributed.all_sum(a, group=self.group, stream=mx.cpu)
        mx.eval(out)  # SYNC: a message, once per request or token
        return out

    def post(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0: a message to the others."""
        self._sum(mx.array([kind, len(payload)], dtype=mx.int32))
        if payload:
            self._sum(mx.array(list(payload), dtype=mx.uint8))

    def take(self) -> tuple[int, bytes]:
        """The other ranks: rank 0's next message."""
        kind, n = self._sum(mx.zeros((2,), dtype=mx.int32)).tolist()
        payload = bytes(self._sum(mx.zeros((n,), dtype=mx.uint8)).tolist()) if n else b""
        return kind, payload

    def flag(self, value: bool) -> bool:
        """Every rank: rank 0's value (the others pass False)."""
        return bool(self._sum(mx.array([int(value) if self.group.rank() == 0 else 0], dtype=mx.int32)).item())


def encode(req) -> bytes:
    fields = dataclasses.asdict(req)
    if fields.get("logit_bias"):
        fields["logit_bias"] = [[int(k), float(v)] for k, v in fields["logit_bias"].items()]
    return json.dumps(fields).encode()


def decode(engine, payload: bytes):
    fields = json.loads(payload)
    if fields.get("logit_bias"):
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"]}
    prompt = fields.pop("prompt")
    return engine.request(prompt, **fields)


def lead(engine, group, lifeline=None) -> None:
    """Rank 0 of a served pipeline: each generation posted first, its cancellation shared; close posts STOP (not
    once a rank is lost: stop_when_lost). lifeline (dist/lifeline.py): told before STOP that the ranks will end."""
    channel, generate, close = Channel(group), engine.generate, engine.close

    watch = Watchdog(rank_timeout())

    def posted(req, emit=lambda s: None, cancelled=lambda: False):
        if getattr(engine, "lost_rank", None):  # found by the lifeline while idle: no collective would answer
            raise Edge0Error(f"rank 0: another rank stopped or failed, the pipeline stops ({engine.lost_rank})")
        engine.check(req)  # a request the model refuses is refused here alone, not on every rank
        with watch:
            channel.post(REQUEST, encode(req))
            return generate(req, emit, lambda: watch.beat() or channel.flag(cancelled()))

    def closing(*args, **kwargs):
        if lifeline is not None:
            lifeline.stop()
        try:
            if not getattr(engine, "lost_rank", None):
                channel.post(STOP)
        except Exception as e:  # a rank already lost: nothing to tell it
            log.warning("pipeline: the other ranks could not be told to stop", error=str(e))
        close(*args, **kwargs)

    engine.generate, engine.close = posted, closing


def follow(engine, group) -> None:
    """A rank > 0 of a served pipeline: generate what rank 0 posts until it posts STOP."""
    channel = Channel(group)
    while True:
        try:
            kind, payload = channel.take()
        except RuntimeError as e:
            raise Edge0Error(f"rank {group.rank()}: lost rank 0 ({e}); stopping") from None
        if kind == STOP:
            return
        if kind != REQUEST:
            raise Edge0Error(f"rank {group.rank()}: unknown message {kind} from rank 0")
        engine.generate(decode(engine, payload), cancelled=lambda: channel.flag(False))


def stop_when_lost(engine, rank: int) -> None:
    """Rank 0: after a generation fails because a rank is lost, the service stops (SIGTERM to this process, which
    the server handles as a graceful stop) once /health has said why; without it every later request would fail.
    The engine's reset fails from then on, so the server stays unhealthy."""
    generate, reset = engine.generate, engine.reset

    def call(*args, **kwargs):
        try:
            return generate(*args, **kwargs)
        except Edge0Error as e:
            if "another rank stopped or failed" in str(e):
                log.error(f"pipeline: {e}; the service stops")
                mark_lost(engine, str(e))
            raise

    def reset_unless_lost() -> None:
        if getattr(engine, "lost_rank", None):
            raise Edge0Error(f"a rank was lost ({engine.lost_rank}); restart every rank")
        reset()
    engine.generate, engine.reset = call, reset_unless_lost


def mark_lost(engine, why: str) -> None:
    """Rank 0, once: engine.lost_rank says why (/health reads it), and the service stops STOP_AFTER_S later."""
    with _LOST:
        if getattr(engine, "lost_rank", None):
            return
        engine.lost_rank = why
    threading.Timer(STOP_AFTER_S, os.kill, (os.getpid(), signal.SIGTERM)).start()


def lost_while_idle(engine):
    """The lifeline's callback on rank 0: a rank's process or host is gone."""
    def lost(rank: int) -> None:
        if not getattr(engine, "lost_rank", None):
            log.error(f"pipeline: rank {rank} stopped or disconnected; the service stops")
        mark_lost(engine, f"rank {rank} stopped or disconnected")
    return lost


_LOST = threading.Lock()


STOP_AFTER_S = 2.0  # a lost rank: seconds /health answers "unhealthy" before the server stops
TIMEOUT_ENV = "EDGE0_RANK_TIMEOUT_S"  # set by `edge0 launch --rank-timeout`
DEFAULT_RANK_TIMEOUT_S = 300.0  # a generation with no token for this long: a rank hangs (a long prompt's first
# token on a slow disk takes far less)
EXIT_AFTER_S = 5.0  # after a hang is found: the graceful stop's time before the process exits regardless


def rank_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_RANK_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise Edge0Error(f"{TIMEOUT_ENV}={raw}: seconds, more than 0")
    return value


class Watchdog:
    """Rank 0 while it generates: a token (or the request's post) at least every `timeout` seconds, else a rank hangs
    (a collective with no answer never returns): the error is logged and the process stops (SIGTERM, then exit)."""

    def __init__(self, timeout: float):
        self.timeout, self.last, self.busy = timeout, 0.0, False
        self.thread = threading.Thread(target=self._watch, name="edge0-rank-watchdog", daemon=True)
        self.thread.start()

    def __enter__(self):
        self.last, self.busy = time.monotonic(), True

    def __exit__(self, *exc):
        self.busy = False

    def beat(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            if self.busy and time.monotonic() - self.last > self.timeout:
                log.error(f"pipeline: no token for {self.timeout:g} s: a rank is not answering; the service stops")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(EXIT_AFTER_S)
                os._exit(1)
