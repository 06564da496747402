"""`POST /v1/messages`: Anthropic's Messages API over the same engine, queue and checks as the OpenAI routes.

    curl localhost:8080/v1/messages -d '{"max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}'

Text only: `system` (a string or text blocks), user/assistant messages with string or text-block content, a
final assistant message continued as Anthropic does (prefill), max_tokens (required), temperature, top_p,
top_k, stop_sequences, stream. Anything else a request asks for (tools, images, thinking...) is a 400 naming
it. Errors take Anthropic's shape, {"type": "error", "error": {"type", "message"}}; a stream's events are
Anthropic's: message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta (stop_reason, usage), message_stop, or an `error` event once the status line has gone.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from ..errors import Edge0Error
from .jobs import ApiError, Job
from .validate import MAX_STOPS, flag, gen_request, number, show, text_value

ROUTE = "/v1/messages"
# Fields that change nothing when sent with their neutral value ([], null, "auto", disabled); else a 400.
UNSUPPORTED = {"tools": "this server does not call tools", "tool_choice": "this server does not call tools",
               "thinking": "no extended thinking", "mcp_servers": "no MCP servers", "container": "no containers",
               "context_management": "no context management", "output_format": "no structured outputs",
               "output_config": "no output configuration"}
# Bookkeeping and hints with no effect here (the prompt cache needs no cache_control): type-checked, ignored.
IGNORED = {"metadata": dict, "service_tier": str, "cache_control": dict, "inference_geo": str, "speed": str}
FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          *IGNORED, *UNSUPPORTED}
MESSAGE_FIELDS = {"role", "content"}
TEXT_BLOCK_FIELDS = {"type", "text", "cache_control", "citations"}  # cache_control: a hint, nothing to do here
TEMP_RANGE = (0.0, 1.0)  # Anthropic's range (OpenAI's is [0, 2])
# Anthropic's error type of each status; any other 4xx is an invalid request, any other 5xx an api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for a server with no room (the OpenAI routes answer 503)


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(e: ApiError) -> web.Response:
    status = OVERLOADED if e.code == "queue_full" else e.status
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return web.json_response(error_body(status, e.message), status=status, headers=headers)


def _bad(name: str, why: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"'{name}': {why}", code, param=name)


def check_message_fields(body: dict) -> None:
    """Unknown fields, then known fields asking for what this server does not do."""
    unknown = [k for k in body if k not in FIELDS]
    if unknown:
        names = ", ".join(show(k) for k in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ApiError(400, f"{names}: not a field of {ROUTE}", "unknown_parameter", param=str(unknown[0])[:40])
    for name, why in UNSUPPORTED.items():
        value = body.get(name)
        neutral = value in (None, [], "auto", "none") or (isinstance(value, dict) and value.get("type") in (
            ("auto", "none") if name == "tool_choice" else ("disabled",) if name == "thinking" else ()))
        if not neutral:
            raise _bad(name, f"not supported ({why})", "unsupported_value")
    for name, kind in IGNORED.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise _bad(name, f"expected {'an object' if kind is dict else 'a string'}, got {show(body[name])}")


def _text(content, where: str, *, blocks_only: bool = False) -> str:
    """A string, or a list of text blocks joined; any other block type is a 400 naming it, and so is a lone
    surrogate (JSON's \\ud800, which the tokenizer raises on) named by its field and byte."""
    if isinstance(content, str) and not blocks_only:
        return text_value(content, where)
    if not isinstance(content, list):
        raise _bad(where, f"expected a string or a list of text blocks, got {show(content)}")
    parts = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise _bad(at, "expected a content block with a 'type'")
        if kind != "text":
            raise _bad(at, f"{show(kind)} blocks are not supported (text only)", "unsupported_value")
        extra = [k for k in block if k not in TEXT_BLOCK_FIELDS]
        if extra:
            raise _bad(f"{at}.{str(extra[0])[:40]}", "not a field of a text block", "unknown_parameter")
        if block.get("citations"):
            raise _bad(f"{at}.citations", "not supported", "unsupported_value")
        if not isinstance(block.get("text"), str):
            raise _bad(f"{at}.text", "required, a string")
        parts.append(text_value(block["text"], f"{at}.text"))
    return "".join(parts)


def conversation(body: dict) -> tuple[list[dict], str]:
    """(chat messages with the system first, the final assistant message's text to continue, or "")."""
    raw = body.get("messages")
    if raw is None:
        raise ApiError(400, "'messages': required, a non-empty list of {role, content}", "missing_field",
                       param="messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", f"expected a non-empty list of {{role, content}}, got {show(raw)}")
    msgs = []
    system = body.get("system")
    if system is not None:
        system = _text(system, "system")
        if system:
            msgs.append({"role": "system", "content": system})
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object with 'role' and 'content', got {show(m)}")
        extra = [k for k in m if k not in MESSAGE_FIELDS]
        if extra:
            raise _bad(f"{where}.{str(extra[0])[:40]}", "not a field of a message", "unknown_parameter")
        role = m.get("role")
        if role not in ("user", "assistant"):
            hint = " (the system prompt is the top-level 'system' field)" if role == "system" else ""
            raise _bad(f"{where}.role", f"expected 'user' or 'assistant', got {show(role)}{hint}")
        if m.get("content") is None:
            raise ApiError(400, f"'{where}.content': required", "missing_field", param=f"{where}.content")
        text = _text(m["content"], f"{where}.content")
        last = i == len(raw) - 1
        if not text and not (last and role == "assistant"):
            raise _bad(f"{where}.content", "must not be empty (only a final assistant message may be)")
        msgs.append({"role": role, "content": text})
    prefill = msgs.pop()["content"] if msgs[-1]["role"] == "assistant" else ""
    if prefill != prefill.rstrip():
        raise _bad(f"messages[{len(raw) - 1}].content", "a final assistant message must not end with whitespace")
    return msgs, prefill


def prompt(engine, body: dict) -> list[int]:
    """The prompt's token ids: the chat template's, then a final assistant message's text to continue."""
    msgs, prefill = conversation(body)
    try:
        ids = engine.encode_chat(msgs)
    except Exception as e:  # the model's template refused the conversation
        raise _bad("messages", f"the chat template failed: {e}") from None
    if prefill:
        tok = engine.tokenizer
        try:
            ids += tok.encode(prefill, add_special_tokens=False)
        except TypeError:  # a tokenizer without special-token options
            ids += tok.encode(prefill)
    return ids


def messages_request(engine, body: dict, defaults: dict):
    """The GenRequest of a checked /v1/messages body (max_tokens required, as Anthropic has it)."""
    check_message_fields(body)
    if body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens': required, the most tokens to generate", "missing_field",
                       param="max_tokens")
    number(body, "temperature", float, None, *TEMP_RANGE)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
                              or len(stops) > MAX_STOPS):
        raise _bad("stop_sequences", f"expected a list of at most {MAX_STOPS} strings")
    ids = prompt(engine, body)
    fields = {k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k")}
    return gen_request(engine, {**fields, "stop": stops, "messages": None}, ids, defaults)


def stop_reason(engine, req, fig) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation: which stop string cut the text, if one did."""
    if fig.finish_reason != "stop":
        return "max_tokens", None
    stops = [s for s in req.stop if s]
    if stops:
        # the whole generated text, decoded with the last prompt token for spacing as the stream was
        tok, head = engine.tokenizer, [req.prompt[-1]]
        full = tok.decode(head + fig.tokens)[len(tok.decode(head)):]
        at = {s: full.find(s, len(fig.text)) for s in stops}  # the text was cut where the stop string began
        found = sorted((i, s) for s, i in at.items() if i >= 0)
        if found:
            return "stop_sequence", found[0][1]
    return "end_turn", None


def x_edge0(job: Job, fig, ttft: float | None) -> dict:
    """Edge0's figures of one answer (the x_edge0 object of every route)."""
    x = fig.x_edge0()
    x["queue_ms"] = round(1e3 * ((job.started or job.arrived) - job.arrived), 3)
    x["ttft_ms"] = round(1e3 * ttft, 3) if ttft is not None else None
    x["request"], x["turn"] = job.seq, job.turn
    return x


# -- the answer ---------------------------------------------------------------------------------------


class Answer:
    """Anthropic's message object for one request, whole or as the events of its stream."""

    def __init__(self, engine, job: Job):
        self.engine, self.job = engine, job
        self.id = job.id = "msg_" + uuid.uuid4().hex[:24]
        self.ttft: float | None = None

    def first(self, text: str) -> None:
        if self.ttft is None and text:
            self.ttft = time.perf_counter() - self.job.arrived

    def usage(self, fig=None) -> dict:
        """Anthropic's usage: input_tokens and cache_read_input_tokens are disjoint parts of the prompt (the
        cached part is known once the generation has started: message_start counts the whole prompt)."""
        cached = getattr(fig, "cached_tokens", 0)
        return {"input_tokens": len(self.job.req.prompt) - cached, "cache_read_input_tokens": cached,
                "output_tokens": fig.completion_tokens if fig is not None else 0}

    def message(self, text: str, fig=None) -> dict:
        """The message so far: empty with no stop_reason before the generation ends (message_start)."""
        reason, seq = stop_reason(self.engine, self.job.req, fig) if fig is not None else (None, None)
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.engine.model_id,
               "content": [{"type": "text", "text": text}] if fig is not None else [],
               "stop_reason": reason, "stop_sequence": seq, "usage": self.usage(fig)}
        if fig is not None:
            out["x_edge0"] = x_edge0(self.job, fig, self.ttft)
        return out

    def ending(self, fig) -> list[tuple[str, dict]]:
        """The events after the last text: content_block_stop, message_delta, message_stop."""
        reason, seq = stop_reason(self.engine, self.job.req, fig)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                 "usage": self.usage(fig), "x_edge0": x_edge0(self.job, fig, self.ttft)}
        return [("content_block_stop", {"type": "content_block_stop", "index": 0}), ("message_delta", delta),
                ("message_stop", {"type": "message_stop"})]


def failure(e: Exception) -> ApiError:
    """What a failed generation answers: its own error, or an internal one without its details."""
    if isinstance(e, ApiError):
        return e
    msg = str(e) if isinstance(e, Edge0Error) else f"internal error ({type(e).__name__}); see the server's log"
    return ApiError(500, msg, "internal_error")


async def answer(request: web.Request, body: dict, req, engine, jobs) -> web.StreamResponse:
    """POST /v1/messages of a parsed body naming this server's model (or none), and its messages_request (made
    off the loop: tokenizing a long prompt takes a while)."""
    stream = flag(body, "stream")
    job = jobs.submit(req)
    out = Answer(engine, job)
    try:
        if stream:
            return await _stream(request, job, out)
        text = []
        async for kind, value in job:
            if kind == "text":
                out.first(value)
                text.append(value)
            elif kind == "error":  # logged by the queue: answered here without a second traceback
                raise failure(value)
            else:
                return web.json_response(out.message("".join(text), value))
    finally:
        job.cancel.set()  # a no-op when done; else the worker stops at its next token


async def _stream(request: web.Request, job: Job, out: Answer) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(event: str, obj: dict) -> None:
        await resp.write(f"event: {event}\ndata: {json.dumps(obj)}\n\n".encode())

    try:
        await send("message_start", {"type": "message_start", "message": out.message("")})
        await send("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}})
        await send("ping", {"type": "ping"})
        async for kind, value in job:
            if kind == "text":
                out.first(value)
                await send("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": value}})
            elif kind == "error":  # the status line has gone: the error is an event of the stream
                e = failure(value)
                await send("error", error_body(e.status, e.message))
                break
            else:
                for event, obj in out.ending(value):
                    await send(event, obj)
        await resp.write_eof()
    except (ConnectionError, asyncio.CancelledError):
        job.cancel.set()  # the client went away: stop at the next token
        raise
    return resp
