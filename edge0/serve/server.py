"""`edge0 serve`: an OpenAI-compatible HTTP server for one Edge0 store.

    edge0 serve --model ~/stores/qwen3-30b --port 8080
    curl localhost:8080/v1/chat/completions -d '{"model": "qwen3-30b", "messages": [{"role": "user", "content": "hi"}]}'

One process, one model, one asyncio loop. Requests are served first come, first served, one generation
at a time: the loop only parses, queues and writes; every MLX call (loading, prefill, decode) runs on
one dedicated worker thread, which hands each piece of text back to the loop as it is decoded. A client
that goes away cancels its generation at the next token; a full queue answers 503.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from ..errors import Edge0Error
from .engine import Engine, Figures, GenRequest
from .jobs import DEFAULT_MAX_QUEUE, ApiError, Job, JobQueue, error_response

MAX_BODY = 64 * 2**20  # bytes of one request body


# -- requests ----------------------------------------------------------------------------------------


def _number(body: dict, name: str, kind, default, lo=None, hi=None):
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
            or (kind is int and isinstance(value, float) and not value.is_integer())):
        raise ApiError(400, f"'{name}': expected {'an integer' if kind is int else 'a number'}, got {value!r}",
                       "invalid_value")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiError(400, f"'{name}': {value} is out of range [{lo}, {hi if hi is not None else 'inf'}]",
                       "invalid_value")
    return kind(value)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}]: text parts only
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(t, str) for t in parts):
            return "".join(parts)
    raise ApiError(400, f"'messages[{i}].content': expected a string or a list of text parts", "invalid_value")


class Api:
    """The routes, over one engine and its queue."""

    def __init__(self, engine: Engine, jobs: JobQueue, *, model_names: set[str], defaults: dict):
        self.engine, self.jobs = engine, jobs
        self.names = model_names | {engine.model_id}
        self.defaults = defaults  # temp, top_p, seed, max_tokens of the command line
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except ApiError as e:
            resp = error_response(e.status, e.message, e.code, e.type)
        except web.HTTPException as e:  # unknown route, wrong method
            resp = error_response(e.status, f"{request.method} {request.path}: {e.reason}",
                                  "not_found" if e.status == 404 else None)
        except Edge0Error as e:
            resp = error_response(500, str(e), "internal_error")
        except Exception as e:
            print(f"edge0 serve: {request.method} {request.path} failed: {e!r}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            resp = error_response(500, f"internal error ({type(e).__name__}); see the server's log", "internal_error")
        status = str(resp.status)
        self.jobs.metrics.requests[status] = self.jobs.metrics.requests.get(status, 0) + 1
        return resp

    # -- GET ------------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.engine.model_id, "object": "model", "created": self.created, "owned_by": "edge0"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.engine.model_id,
                                  "waiting": self.jobs.waiting.qsize(), "generating": int(self.jobs.running is not None)})

    async def prometheus(self, request: web.Request) -> web.Response:
        text = self.jobs.metrics.prometheus(self.jobs.waiting.qsize(), int(self.jobs.running is not None))
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    # -- POST -----------------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages': required, a non-empty list of {role, content}", "missing_field")
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"'messages[{i}]': expected an object with a 'role' string", "invalid_value")
            msgs.append({"role": m["role"], "content": _content(m, i)})
        try:
            prompt = self.engine.encode_chat(msgs)
        except Exception as e:  # the model's template refused the conversation
            raise ApiError(400, f"'messages': the chat template failed: {e}", "invalid_value") from None
        return await self._generate(request, body, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.engine.encode_text(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.vocab
            bad = next((t for t in prompt if t < 0 or (vocab and t >= vocab)), None)
            if bad is not None:
                raise ApiError(400, f"'prompt': token id {bad} is out of range [0, {vocab - 1 if vocab else 'inf'}]"
                               " (the model's vocabulary)", "invalid_value")
            ids = prompt  # token ids
        elif prompt is None:
            raise ApiError(400, "'prompt': required", "missing_field")
        else:
            raise ApiError(400, "'prompt': expected a string, a list of one string, or a list of token ids",
                           "invalid_value")
        return await self._generate(request, body, ids, chat=False)

    async def _body(self, request: web.Request) -> dict:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_json")
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise ApiError(400, f"'model': expected a string, got {name!r}", "invalid_value")
        if name not in (None, "") and name not in self.names:
            raise ApiError(404, f"the model '{name}' does not exist; this server has '{self.engine.model_id}'",
                           "model_not_found")
        return body

    def _request(self, body: dict, prompt: list[int]) -> GenRequest:
        d = self.defaults
        context = self.engine.context
        room = max(context - len(prompt), 0) if context else d["max_tokens"]
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(name)  # null is as absent
        max_tokens = _number({name: max_tokens}, name, int, min(d["max_tokens"], room) or 1, 1)
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise ApiError(400, "'stop': expected a string or a list of at most 16 strings", "invalid_value")
        req = GenRequest(prompt=list(prompt), max_tokens=max_tokens,
                         temp=_number(body, "temperature", float, d["temp"], 0, 100),
                         top_p=_number(body, "top_p", float, d["top_p"], 0, 1),
                         top_k=_number(body, "top_k", int, 0, 0, (self.engine.vocab - 1) if self.engine.vocab else None),
                         seed=_number(body, "seed", int, d["seed"], 0, 2**64 - 1), stop=stop)
        if body.get("n", 1) != 1:
            raise ApiError(400, "'n': only 1 is supported", "invalid_value")
        try:
            self.engine.check_length(req.prompt, req.max_tokens)
        except Edge0Error as e:
            raise ApiError(400, str(e), "context_length_exceeded") from None
        return req

    async def _generate(self, request: web.Request, body: dict, prompt: list[int], *, chat: bool) -> web.StreamResponse:
        req = self._request(body, prompt)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"'stream': expected true or false, got {stream!r}", "invalid_value")
        opts = body.get("stream_options") or {}
        usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        job = self.jobs.submit(req)
        out = Output(chat, self.engine.model_id, job)
        try:
            if stream:
                return await self._stream(request, job, out, usage)
            text = []
            async for kind, value in job:
                if kind == "text":
                    out.first(value)
                    text.append(value)
                elif kind == "error":  # logged by the queue: answered here without a second traceback
                    if isinstance(value, (ApiError, Edge0Error)):
                        raise value
                    raise ApiError(500, f"internal error ({type(value).__name__}); see the server's log",
                                   "internal_error")
                else:
                    return web.json_response(out.whole("".join(text), value))
        finally:
            job.cancel.set()  # a no-op when done; else the worker stops at its next token

    async def _stream(self, request: web.Request, job: Job, out: "Output", usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        try:
            if out.chat:
                await send(out.chunk({"role": "assistant", "content": ""}))
            async for kind, value in job:
                if kind == "text":
                    out.first(value)
                    await send(out.chunk(value))
                elif kind == "error":
                    e = value
                    msg = str(e) if isinstance(e, (Edge0Error, ApiError)) else f"internal error ({type(e).__name__})"
                    await send({"error": {"message": msg, "type": "server_error", "param": None, "code": "internal_error"}})
                    break
                else:
                    await send(out.chunk(None, finish=value.finish_reason))
                    if usage:
                        await send(out.usage_chunk(value))
            await send(b"[DONE]")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            job.cancel.set()  # the client went away: stop at the next token
            raise
        return resp


class Output:
    """OpenAI response objects for one request (chat.completion or text_completion)."""

    def __init__(self, chat: bool, model: str, job: Job):
        self.chat, self.model, self.job = chat, model, job
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.ttft: float | None = None

    def first(self, text: str) -> None:
        if self.ttft is None and text:
            self.ttft = time.perf_counter() - self.job.arrived

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def figures(self, fig: Figures) -> tuple[dict, dict]:
        usage = {"prompt_tokens": fig.prompt_tokens, "completion_tokens": fig.completion_tokens,
                 "total_tokens": fig.prompt_tokens + fig.completion_tokens}
        x = fig.x_edge0()
        x["queue_ms"] = round(1e3 * ((self.job.started or self.job.arrived) - self.job.arrived), 3)
        x["ttft_ms"] = round(1e3 * self.ttft, 3) if self.ttft is not None else None
        x["request"], x["turn"] = self.job.seq, self.job.turn
        return usage, x

    def whole(self, text: str, fig: Figures) -> dict:
        self.first(text)
        usage, x = self.figures(fig)
        finish = fig.finish_reason
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage, "x_edge0": x}

    def chunk(self, text: str | dict | None, finish: str | None = None) -> dict:
        if self.chat:
            delta = text if isinstance(text, dict) else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, fig: Figures) -> dict:
        usage, x = self.figures(fig)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage, "x_edge0": x}


# -- running it --------------------------------------------------------------------------------------


class Server:
    """Engine + queue + HTTP site on the calling loop; the engine is loaded on the worker thread."""

    end_thread = False  # clear the MLX worker's streams at stop (the process exits right after)

    def __init__(self, args, *, host: str = "127.0.0.1", port: int = 8080, max_queue: int = DEFAULT_MAX_QUEUE):
        self.args, self.host, self.port, self.max_queue = args, host, port, max_queue
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-mlx")
        self.engine: Engine | None = None
        self.jobs: JobQueue | None = None
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.engine = await loop.run_in_executor(self.worker, Engine.open, self.args)
        self.jobs = JobQueue(self.engine, self.worker, max_queue=self.max_queue)
        self.jobs.start()
        a = self.args
        names = {a.model} if a.model else set()
        api = Api(self.engine, self.jobs, model_names=names,
                  defaults={"temp": a.temp, "top_p": a.top_p, "seed": a.seed, "max_tokens": a.max_tokens})
        self.runner = web.AppRunner(api.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]  # the bound port (an ephemeral one for port 0)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.jobs is not None:
            if self.jobs.running is not None:
                self.jobs.running.cancel.set()
            await self.jobs.close()
        loop = asyncio.get_running_loop()
        if self.engine is not None:
            await loop.run_in_executor(self.worker, lambda: self.engine.close(end_thread=self.end_thread))
        self.worker.shutdown(wait=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class BackgroundServer:
    """A Server on its own loop in a thread (tests, embedding): start() returns once it listens."""

    def __init__(self, args, *, host: str = "127.0.0.1", port: int = 0, max_queue: int = DEFAULT_MAX_QUEUE):
        from ..sched.scheduler import new_loop

        self.server = Server(args, host=host, port=port, max_queue=max_queue)
        self.loop = new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="edge0-serve", daemon=True)

    def start(self, timeout: float = 120.0) -> "BackgroundServer":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout)
        return self

    def call(self, fn, timeout: float = 30.0):
        """Run fn() on the server's loop (state is only read or changed there)."""
        async def wrapped():
            return fn()
        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
            self.loop.close()

    @property
    def url(self) -> str:
        return self.server.url
