"""The HTTP front of `edge0 serve`: who may ask, how long a client may stall, how much it may send.

A connection has --client-timeout seconds to send a request's headers (from connecting, or from the end of its
previous answer), as many again for the body, and is dropped when an answer it does not read stays unsent that
long. With an API key, every route but /health wants it (`Authorization: Bearer KEY` or `x-api-key: KEY`).
A body over --max-body-mib is refused from its Content-Length, and a prompt whose text could not fit the
model's context is refused before it is tokenized (check_text); past a few of the largest bodies in memory at once,
a new one is a 503 (Bodies). Errors are the API's JSON, malformed HTTP included. Built on aiohttp's protocol class
(RequestHandler) and its Server's protocol factory, whose hooks tests/serve/test_front.py exercises.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import traceback
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from ..log import log
from .jobs import RETRY_AFTER_S, ApiError

API_KEY_ENV = "EDGE0_API_KEY"
DEFAULT_CLIENT_TIMEOUT = 60.0  # seconds a client may stall (nginx's client_header_timeout and client_body_timeout)
DEFAULT_MAX_BODY_MIB = 16  # a full 40k-token context is well under 1 MiB of JSON, even as token ids
OPEN_ROUTES = ("/health",)  # answered without the API key (load balancers' probes)


@dataclass(frozen=True)
class Front:
    """What the HTTP front lets in."""

    api_key: str | None = None  # wanted on every route but OPEN_ROUTES; None: anyone who can connect is served
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT  # seconds for a request's headers, for its body, for a stalled read
    max_body: int = DEFAULT_MAX_BODY_MIB * 2**20  # bytes of one request body


def check_key(request: web.Request, key: str | None) -> None:
    """Raise a 401 unless the request carries the key (OpenAI's clients send a bearer token, Anthropic's
    x-api-key). Compared as digests in constant time: neither the key's bytes nor its length leak."""
    if key is None or request.path in OPEN_ROUTES:
        return
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key")
    if given is None:
        raise ApiError(401, "this server wants an API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       "missing_api_key")
    want = hashlib.sha256(key.encode()).digest()
    if not hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest(), want):
        raise ApiError(401, "incorrect API key", "invalid_api_key")


# -- bodies too large, prompts too long to tokenize --------------------------------------------------


async def read_body(request: web.Request, front: Front) -> bytes:
    """The body's bytes: refused from its Content-Length when too large, and when it does not arrive in time."""
    limit, length, wait = front.max_body, request.content_length, front.client_timeout
    if length is not None and length > limit:
        raise _too_large(f" of {length} bytes", limit)
    try:
        return await asyncio.wait_for(request.read(), wait)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {wait:g} s (--client-timeout)",
                       "request_timeout") from None
    except web.HTTPRequestEntityTooLarge:  # chunked, with no Content-Length
        raise _too_large("", limit) from None
    except web.RequestPayloadError as e:  # say, a Content-Encoding it does not decode to
        why = getattr(e.__cause__, "message", None) or " ".join(str(e).split())
        raise ApiError(400, f"the request body cannot be read ({why})", "invalid_body") from None


class Bodies:
    """Bytes of request bodies being read, parsed or tokenized (only the loop counts them): past IN_FLIGHT bodies'
    worth, a new one is refused with 503 rather than held in memory until the prep thread takes it."""

    IN_FLIGHT = 4  # bodies of the largest size

    def __init__(self, max_body: int):
        self.max_body, self.held = max_body, 0

    @contextlib.contextmanager
    def hold(self, length: int | None):
        size = min(length or self.max_body, self.max_body)  # a chunked body may be as large as allowed
        if self.held and self.held + size > self.IN_FLIGHT * self.max_body:
            raise ApiError(503, f"the server is busy: {self.held} bytes of other requests are being read or "
                                "tokenized; retry later", "server_busy", retry_after=RETRY_AFTER_S)
        self.held += size
        try:
            yield
        finally:
            self.held -= size


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body{size} is larger than this server takes ({limit} bytes; --max-body-mib)",
                    "request_too_large")


def check_text(body: dict, context: int | None, per_token: int | None) -> None:
    """Refuse a request with more text than `context` tokens can stand for, before tokenizing it would take
    long for nothing. A normalizer that removes text (collapsed whitespace, composed accents) could fit more:
    such a prompt is refused too."""
    if not context or not per_token:
        return
    limit = context * per_token
    n = text_bytes(body)
    if n > limit:
        raise ApiError(400, f"the request holds {n} bytes of text: no prompt over {limit} fits the model's context "
                            f"of {context} tokens (a token stands for at most {per_token} bytes)",
                       "context_length_exceeded", param="messages" if "messages" in body else "prompt")


def max_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token of the vocabulary stands for, or None when it has no vocabulary to
    read. A vocabulary entry's UTF-8 length is never below its text's: byte-level BPE spells one byte as one or two
    UTF-8 bytes, SentencePiece's ▁ (3 bytes) is one space, a byte-fallback <0x41> is one byte."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 (a tokenizer without a readable vocabulary: no bound)
        return None
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=None)


def text_bytes(value) -> int:
    """UTF-8 bytes of every string in a parsed JSON value, keys included (no recursion: any depth)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


# -- connections ----------------------------------------------------------------------------------------


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection (written below aiohttp's responses)."""
    body = json.dumps(ApiError(status, message, code).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class Connection(RequestHandler):
    """aiohttp's protocol of one connection, with deadlines: the idle one runs from connecting and from the end
    of each request until the next request's headers are in (the middleware calls busy() and idle()); the write
    one runs while the transport's buffer is full (a client not reading its answer)."""

    __slots__ = ("stall_s", "_idle", "_write", "_heard")

    def __init__(self, *args, stall_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.stall_s = stall_s
        self._idle: asyncio.TimerHandle | None = None
        self._write: asyncio.TimerHandle | None = None
        self._heard = False  # bytes arrived since the idle deadline was set: a request is under way

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.idle()

    def data_received(self, data: bytes) -> None:
        self._heard = True
        super().data_received(data)

    def busy(self) -> None:
        """A request's headers are in: no idle deadline while it is handled."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def idle(self) -> None:
        self.busy()
        if self.transport is None:  # closed already
            return
        self._heard = False
        self._idle = self._loop.call_later(self.stall_s, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle = None
        if self.transport is None:
            return
        if self._heard:  # part of a request came, not its end: say why before closing (an idle one just closes)
            self.transport.write(_raw_error(408, "Request Timeout", f"the request's headers did not arrive within "
                                            f"{self.stall_s:g} s (--client-timeout)", "request_timeout"))
            log.warning(f"closed a connection whose request's headers did not arrive within {self.stall_s:g} s")
        if self.transport.get_write_buffer_size():  # its last answer is still unread: close() would wait for it
            self.transport.abort()
        self.force_close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write = self._loop.call_later(self.stall_s, self._write_expired)

    def resume_writing(self) -> None:
        if self._write is not None:
            self._write.cancel()
            self._write = None
        super().resume_writing()

    def _write_expired(self) -> None:
        self._write = None
        if self.transport is not None:
            log.warning(f"dropped a connection that left its answer unread for {self.stall_s:g} s")
            self.transport.abort()  # close() would wait for the unread buffer to drain

    def connection_lost(self, exc) -> None:
        for handle in (self._idle, self._write):
            if handle is not None:
                handle.cancel()
        self._idle = self._write = None
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        """HTTP that no route sees (a bad request line, headers or framing): aiohttp's one log line and
        closing, with the API's JSON error instead of its text."""
        super().handle_error(request, status, exc, message)  # logs it; raises if an answer has begun
        if status < 500:
            why = " ".join(str(message or exc or "").split())[:200]
            err = ApiError(status, f"malformed HTTP request: {why}", "invalid_http")
        else:
            err = ApiError(status, "internal error; see the server's log", "internal_error")
        resp = web.json_response(err.body(), status=status)
        resp.force_close()
        return resp


class _Server(web.Server):
    """The application's web.Server, its connections Connection."""

    stall_s = DEFAULT_CLIENT_TIMEOUT

    def __call__(self) -> Connection:
        return Connection(self, loop=self._loop, stall_s=self.stall_s, **self._kwargs)


class Runner(web.AppRunner):
    """An AppRunner whose connections have the front's deadlines."""

    __slots__ = ("stall_s",)

    def __init__(self, app: web.Application, *, stall_s: float, **kwargs):
        super().__init__(app, **kwargs)
        self.stall_s = stall_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server, its protocol factory ours
        server.stall_s = self.stall_s
        return server


# -- aiohttp's log --------------------------------------------------------------------------------------


class _OneLine(logging.Handler):
    """aiohttp's own log (malformed HTTP that no route sees) as one line of Edge0's log; a traceback only
    for what is not a malformed request."""

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or isinstance(exc, HttpProcessingError):
            why = f": {' '.join(str(exc).split())}" if exc is not None else ""
            log.warning(f"{record.getMessage()}{why}")
        else:
            log.error(record.getMessage(), error=repr(exc), traceback="".join(traceback.format_exception(exc)))


def http_logger() -> logging.Logger:
    logger = logging.getLogger("edge0.serve.http")
    if not logger.handlers:
        logger.addHandler(_OneLine())
        logger.propagate = False
    return logger
