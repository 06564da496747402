"""`edge0 serve`: an OpenAI-compatible HTTP server for one Edge0 store.

    edge0 serve --model ~/stores/qwen3-30b --port 8080
    curl localhost:8080/v1/chat/completions -d '{"model": "qwen3-30b", "messages": [{"role": "user", "content": "hi"}]}'

One process, one model, one asyncio loop. Requests are served first come, first served, one generation
at a time: the loop only reads, queues and writes; every MLX call (loading, prefill, decode) runs on
one dedicated worker thread, which hands each piece of text back to the loop as it is decoded. Parsing and
tokenizing a request run on one more thread (prep), so that a large prompt holds up no other client. A client
that goes away cancels its generation at the next token; a full queue answers 503 with Retry-After.
Request bodies are checked in validate.py; the API key, deadlines and size limits are guard.py's. Stopping
(Ctrl-C, SIGTERM) cancels the running generation and answers every waiting request 503 rather than finishing them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from ..errors import Edge0Error
from ..engine import Engine
from ..decode.request import Figures, GenRequest
from ..log import log
from . import messages
from .guard import (Bodies, Connection, Front, Runner, check_key, check_text, http_logger, max_token_bytes,
                    read_body)
from .jobs import DEFAULT_MAX_QUEUE, RETRY_AFTER_S, ApiError, Job, JobQueue, openai_error
from .routes_record import recorder
from .validate import check_completion_fields, chat_prompt, completion_prompt, gen_request, show, stream_flags

SHUTDOWN_TIMEOUT_S = 10.0  # how long stopping waits for the handlers once their generations are cancelled


class Api:
    """The routes, over one engine and its queue."""

    def __init__(self, engine: Engine, jobs: JobQueue, *, model_names: set[str], defaults: dict, front: Front,
                 prep: ThreadPoolExecutor, per_token: int | None = None):
        self.engine, self.jobs, self.front, self.prep = engine, jobs, front, prep
        self.bodies = Bodies(front.max_body)
        self.names = model_names | {engine.model_id}
        self.defaults = defaults  # temp, top_p, seed, max_tokens of the command line
        self.per_token = per_token  # the most bytes of text one token stands for (guard.max_token_bytes)
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.front.max_body, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post(messages.ROUTE, self.messages)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        conn = request.protocol if isinstance(request.protocol, Connection) else None
        if conn is not None:
            conn.busy()  # the headers are in: the body has its own deadline (read_body), generating has none
        try:
            check_key(request, self.front.api_key)
            resp = await handler(request)
        except ApiError as e:
            resp = self._error(request, e)
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            resp = self._error(request, ApiError(e.status, f"{request.method} {request.path[:80]}: {e.reason}",
                                                 "not_found" if e.status == 404 else None))
        except Edge0Error as e:
            resp = self._error(request, ApiError(500, str(e), "internal_error"))
        except Exception as e:
            log.error(f"{request.method} {request.path[:80]} failed", error=repr(e), traceback=traceback.format_exc())
            resp = self._error(request, ApiError(500, f"internal error ({type(e).__name__}); see the server's log",
                                                 "internal_error"))
        finally:
            if conn is not None:
                conn.idle()  # until the next request's headers are in
        if not request.content.is_eof() and (resp.status == 408 or request.content.exception() is not None):
            request.content.feed_eof()  # stalled or undecodable: close; a body merely unread (401, 413...) is
            resp.force_close()  # read and dropped by aiohttp for a while, so that a client still sending hears this
        if resp.status == 401:
            resp.headers["WWW-Authenticate"] = "Bearer"
        status = str(resp.status)
        self.jobs.metrics.requests[status] = self.jobs.metrics.requests.get(status, 0) + 1
        return resp

    @staticmethod
    def _error(request: web.Request, e: ApiError) -> web.Response:
        """An error in the shape of the route's API: Anthropic's on /v1/messages, OpenAI's elsewhere."""
        if request.path == messages.ROUTE:
            return messages.anthropic_error(e)
        return openai_error(e.status, e.message, e.code, e.type, param=e.param, retry_after=e.retry_after)

    # -- GET ------------------------------------------------------------------------------------

    def _model(self) -> dict:
        return {"id": self.engine.model_id, "object": "model", "created": self.created, "owned_by": "edge0"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.names:
            raise ApiError(404, f"the model {show(name)} does not exist; this server has '{self.engine.model_id}'",
                           "model_not_found", param="model")
        return web.json_response(self._model())

    async def health(self, request: web.Request) -> web.Response:
        jobs = self.jobs
        state = {"model": self.engine.model_id, "waiting": jobs.waiting.qsize(),
                 "generating": int(jobs.running is not None)}
        if jobs.closing:
            return web.json_response({"status": "shutting_down", **state}, status=503,
                                     headers={"Retry-After": str(RETRY_AFTER_S)})
        lost = getattr(self.engine, "lost_rank", None)  # edge0/dist: a rank of the service is gone, even while idle
        if jobs.unhealthy is not None or lost:
            return web.json_response({"status": "unhealthy", "error": jobs.unhealthy or lost, **state}, status=503,
                                     headers={"Retry-After": str(RETRY_AFTER_S)})
        return web.json_response({"status": "ok", **state})

    async def prometheus(self, request: web.Request) -> web.Response:
        generating = int(self.jobs.running is not None)
        text = self.jobs.metrics.prometheus(self.jobs.waiting.qsize(), generating) + self._batch_metrics(generating)
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    def _batch_metrics(self, generating: int) -> str:
        """Batch size, prompt-cache and memory figures, read where the queue and the engine keep them (0 before
        they do): jobs.batch_size, engine.prompt_cache.stats (hits, tokens), the runtime's resident expert bytes."""
        stats = getattr(getattr(self.engine, "prompt_cache", None), "stats", None)
        get = stats.get if isinstance(stats, dict) else (lambda name, default: getattr(stats, name, default))
        out, batch = [], getattr(self.jobs, "batch_size", generating)  # 0 or 1 while FIFO
        for name, kind, text, value in [
            ("batch_size", "gauge", "sequences in the running decode step", batch),
            ("prompt_cache_hits_total", "counter", "requests whose prompt began with a cached prefix", get("hits", 0)),
            ("prompt_cache_tokens_total", "counter", "prompt tokens served from the prompt cache", get("tokens", 0)),
            ("resident_expert_bytes", "gauge", "expert bytes held in slot banks and prefill banks now",
             getattr(self.engine.store.runtime, "resident_expert_bytes", 0)),
            ("memory_budget_bytes", "gauge", "--memory-budget (0: none given)",
             int((self.engine.config.io.memory_budget_gib or 0) * 2**30)),
        ]:
            out += [f"# HELP edge0_{name} {text}", f"# TYPE edge0_{name} {kind}", f"edge0_{name} {value}"]
        return "\n".join(out) + "\n"

    # -- POST -----------------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, req = await self._prepared(request, lambda body: self._request(body, chat_prompt, True))
        return await self._generate(request, body, req, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, req = await self._prepared(request, lambda body: self._request(body, completion_prompt, False))
        return await self._generate(request, body, req, chat=False)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body, req = await self._prepared(request, lambda body: messages.messages_request(self.engine, body,
                                                                                         self.defaults))
        return await messages.answer(request, body, req, self.engine, self.jobs)

    async def _prepared(self, request: web.Request, make) -> tuple[dict, GenRequest]:
        """The request's JSON object (_parse) and make(body), both on the prep thread, so that a large prompt
        holds up no other client; its bytes count against the bodies in flight meanwhile."""
        loop = asyncio.get_running_loop()
        with self.bodies.hold(request.content_length):
            body = await loop.run_in_executor(self.prep, self._parse, await read_body(request, self.front))
            return body, await loop.run_in_executor(self.prep, make, body)

    def _request(self, body: dict, prompt_of, chat: bool) -> GenRequest:
        check_completion_fields(body, chat=chat)
        return gen_request(self.engine, body, prompt_of(self.engine, body), self.defaults)

    def _parse(self, raw: bytes) -> dict:
        """The body's JSON object, naming this server's model (or none), with no more text than the context holds."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})", "invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_json")
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise ApiError(400, f"'model': expected a string, got {show(name)}", "invalid_value", param="model")
        if name not in (None, "") and name not in self.names:
            raise ApiError(404, f"the model {show(name)} does not exist; this server has '{self.engine.model_id}'",
                           "model_not_found", param="model")
        check_text(body, self.engine.context, self.per_token)
        return body

    async def _generate(self, request: web.Request, body: dict, req: GenRequest, *, chat: bool) -> web.StreamResponse:
        stream, usage = stream_flags(body)
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
                    raise messages.failure(value)
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
                elif kind == "error":  # the status line has gone: the error is an event of the stream
                    await send(stream_error(value))
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


def stream_error(e: Exception) -> dict:
    return messages.failure(e).body()


class Output:
    """OpenAI response objects for one request (chat.completion or text_completion)."""

    def __init__(self, chat: bool, model: str, job: Job):
        self.chat, self.model, self.job = chat, model, job
        self.id = job.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.ttft: float | None = None

    def first(self, text: str) -> None:
        if self.ttft is None and text:
            self.ttft = time.perf_counter() - self.job.arrived

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def figures(self, fig: Figures) -> tuple[dict, dict]:
        usage = {"prompt_tokens": fig.prompt_tokens, "completion_tokens": fig.completion_tokens,
                 "total_tokens": fig.prompt_tokens + fig.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": fig.cached_tokens}}
        return usage, messages.x_edge0(self.job, fig, self.ttft)

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

    def __init__(self, config, sampling, *, host: str = "127.0.0.1", port: int = 8080,
                 max_queue: int = DEFAULT_MAX_QUEUE, front: Front = Front(), record_routes=None):
        self.config, self.sampling = config, sampling  # EngineConfig, Sampling (the defaults of requests)
        self.host, self.port, self.max_queue, self.front = host, port, max_queue, front
        self.record_routes = record_routes  # --record-routes DIR, checked (serve/routes_record.py record_dir)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-mlx")
        # one thread parses and tokenizes requests: one large prompt's memory at a time
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-prep")
        self.engine: Engine | None = None
        self.jobs: JobQueue | None = None
        self.runner: web.AppRunner | None = None
        self.api: Api | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        from ..dist import serving_engine as open_engine  # under mlx.launch: rank 0 of a pipeline

        self.engine = await loop.run_in_executor(self.worker, open_engine, self.config)
        self.sampling.check_context(self.engine.context)  # the default of requests that give none
        self.jobs = JobQueue(self.engine, self.worker, max_queue=self.max_queue)
        self.jobs.routes = recorder(self.engine, self.record_routes, loop)
        self.jobs.start()
        c, d = self.config, self.sampling
        names = {c.model} if c.model else set()
        per_token = await loop.run_in_executor(self.prep, max_token_bytes, self.engine.tokenizer)
        api = Api(self.engine, self.jobs, model_names=names,
                  defaults={"temp": d.temp, "top_p": d.top_p, "seed": d.seed, "max_tokens": d.max_tokens,
                            **d.penalties()}, front=self.front, prep=self.prep, per_token=per_token)
        self.api = api
        self.runner = Runner(api.app(), stall_s=self.front.client_timeout, handler_cancellation=True,
                             access_log=None, logger=http_logger(), shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]  # the bound port (an ephemeral one for port 0)

    async def stop(self) -> None:
        """Stop listening, answer the waiting requests 503, cancel the running generation (its client gets a
        503 or an error event), then close the connections and the engine."""
        if self.runner is not None:
            for site in list(self.runner.sites):
                await site.stop()
        if self.jobs is not None:
            running, waiting = await self.jobs.shut_down()
            log.info(f"shutting down, cancelled {running} running and {waiting} waiting requests")
        if self.runner is not None:
            await self.runner.cleanup()  # the handlers are answering by now
        if self.jobs is not None:
            await self.jobs.close()
        loop = asyncio.get_running_loop()
        if self.engine is not None:
            await loop.run_in_executor(self.worker, lambda: self.engine.close(end_thread=self.end_thread))
        self.worker.shutdown(wait=True)
        self.prep.shutdown(wait=False, cancel_futures=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class BackgroundServer:
    """A Server on its own loop in a thread (tests, embedding): start() returns once it listens."""

    def __init__(self, config, sampling, *, host: str = "127.0.0.1", port: int = 0,
                 max_queue: int = DEFAULT_MAX_QUEUE, front: Front = Front()):
        from ..sched.loop import new_loop

        self.server = Server(config, sampling, host=host, port=port, max_queue=max_queue, front=front)
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
