"""The request queue of `edge0 serve`, its one serving loop (first come, first served, into a batch of --max-batch
sequences; 1: one generation at a time) and the counters behind /metrics. Errors are OpenAI-shaped."""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from ..engine import Engine
from ..errors import ApiError
from ..decode.request import Figures, GenRequest
from ..log import log, log_failure
from .cycle import Batch, Solo, batch_size
from .routes_record import Quiet

DEFAULT_MAX_QUEUE = 32  # requests waiting behind the one being generated
RETRY_AFTER_S = 5  # the Retry-After of a 503: the queue is full, the server stops or its engine is resetting
# MLX keeps freed buffers for reuse up to its memory limit: a long-running server's pool would grow to its busiest
# moment's transients and stay there. On the CPU malloc already reuses freed memory, so the server keeps none.
SERVE_MLX_CACHE_BYTES = 0


def openai_error(status: int, message: str, code: str | None = None, type: str | None = None, *,
                   param: str | None = None, retry_after: int | None = None) -> web.Response:
    e = ApiError(status, message, code, type, param=param, retry_after=retry_after)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(e.body(), status=status, headers=headers)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "server_shutting_down", retry_after=RETRY_AFTER_S)


# -- the queue: FIFO into the decoder's room ---------------------------------------------------------


@dataclass
class Job:
    """One queued generation; its events come back to the loop through `events`."""

    req: GenRequest
    seq: int = 0  # arrival order (1, 2, ...)
    turn: int = 0  # generation order: equal to seq's order, since the queue is FIFO
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when the worker took it
    cancel: threading.Event = field(default_factory=threading.Event)  # set by the loop; read by the worker per token
    shutdown: bool = False  # cancelled because the server stops: answered 503, not as a finished generation
    id: str | None = None  # its answer's id (chatcmpl-..., msg_...): --record-routes names its trace so
    routes: object = None  # --record-routes: its routing so far, then its trace's write (serve/routes_record.py)
    # ("text", str) ..., then ("done", Figures) or ("error", exception)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[str, object]:
        kind, value = await self.events.get()
        if kind == "end":
            raise StopAsyncIteration
        if kind == "done":
            self.events.put_nowait(("end", None))
        return kind, value


@dataclass
class Metrics:
    """Counters since start, summed over requests (GET /metrics)."""

    requests: dict = field(default_factory=dict)  # status -> count
    generations: int = 0
    cancelled: int = 0
    rejected: int = 0  # queue full
    failed: int = 0  # generations that raised
    prompt_tokens: int = 0
    completion_tokens: int = 0
    bytes_read: int = 0
    cold_bytes: float = 0.0
    reads: int = 0
    stall_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_mlx_bytes: int = 0  # the largest of the generations' peaks

    def add(self, f: Figures) -> None:
        self.generations += 1
        self.peak_mlx_bytes = max(self.peak_mlx_bytes, f.peak_mlx_bytes)
        self.cancelled += f.finish_reason == "cancelled"
        self.prompt_tokens += f.prompt_tokens
        self.completion_tokens += f.completion_tokens
        self.bytes_read += f.bytes_read
        self.cold_bytes += f.cold_bytes
        self.reads += f.reads
        self.stall_s += f.stall_s
        self.prefill_s += f.prefill_s
        self.decode_s += f.decode_s

    def prometheus(self, waiting: int, generating: int) -> str:
        out = ["# HELP edge0_requests_total HTTP requests answered, by status", "# TYPE edge0_requests_total counter"]
        out += [f'edge0_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
        for name, kind, text, value in [
            ("generations_total", "counter", "generations run", self.generations),
            ("cancelled_total", "counter", "generations stopped because the client went away", self.cancelled),
            ("rejected_total", "counter", "requests refused with 503 because the queue was full", self.rejected),
            ("failed_total", "counter", "generations that raised an internal error", self.failed),
            ("prompt_tokens_total", "counter", "prompt tokens processed", self.prompt_tokens),
            ("completion_tokens_total", "counter", "tokens generated", self.completion_tokens),
            ("bytes_read_total", "counter", "expert bytes read from the store", self.bytes_read),
            ("cold_bytes_total", "counter", "expert bytes read that were not in the page cache", int(self.cold_bytes)),
            ("reads_total", "counter", "expert read calls", self.reads),
            ("stall_seconds_total", "counter", "time compute waited on prefetch reads", self.stall_s),
            ("prefill_seconds_total", "counter", "time spent processing prompts", self.prefill_s),
            ("decode_seconds_total", "counter", "time spent decoding", self.decode_s),
            ("peak_mlx_bytes", "gauge", "MLX's peak allocation over the generations so far", self.peak_mlx_bytes),
            ("queue_waiting", "gauge", "requests waiting for the generation slot", waiting),
            ("generating", "gauge", "generations running (0 or 1)", generating),
        ]:
            out += [f"# HELP edge0_{name} {text}", f"# TYPE edge0_{name} {kind}", f"edge0_{name} {value}"]
        return "\n".join(out) + "\n"


class JobQueue:
    """Bounded FIFO in front of the one worker thread. Only the loop touches the queue and the metrics.

    After a generation raises, the engine is reset (engine.reset() on the worker, where it has one) before
    anything else runs; while no reset has succeeded the queue is unhealthy: /health says so and requests
    get 503 (each one that arrives tries the reset again)."""

    def __init__(self, engine: Engine, worker: ThreadPoolExecutor, *, max_queue: int = DEFAULT_MAX_QUEUE):
        self.engine, self.worker = engine, worker
        self.max_queue = max_queue
        self.waiting: asyncio.Queue[Job] = asyncio.Queue()  # bounded by submit (0 here would mean unbounded)
        self.running: Job | None = None
        self.active: list[Job] = []  # jobs generating now (one, or a batch's with --max-batch)
        self.batch_size = 0  # sequences in the running decode step
        self.idle = asyncio.Event()  # set while no generation runs
        self.idle.set()
        self.arrivals = 0
        self.turns = 0
        self.metrics = Metrics()
        self.task: asyncio.Task | None = None
        self.unhealthy: str | None = None  # why the engine is not fit to generate (after an error), else None
        self.closing = False  # the server stops: nothing new is taken
        self.mlx_cache_limit: int | None = None  # the process's MLX cache limit before start, restored by close
        self.routes = Quiet()  # the cycles' hook: serve/routes_record.py RouteRecorder under --record-routes

    def start(self) -> None:
        import mlx.core as mx

        if mx.default_device().type == mx.DeviceType.cpu:  # a GPU's allocations cost more: keep MLX's pool there
            self.mlx_cache_limit = mx.set_cache_limit(SERVE_MLX_CACHE_BYTES)
            mx.clear_cache()  # what loading the engine left there
        max_batch = batch_size(self.engine, self.engine.config.serving.max_batch) if hasattr(self.engine, "config") \
            else 1
        serving = self._serve(Batch(self.engine, max_batch, self.routes) if max_batch > 1 else
                              Solo(self.engine, self.routes))
        self.task = asyncio.get_running_loop().create_task(serving)
        self.task.add_done_callback(self._stopped)

    def _stopped(self, task: asyncio.Task) -> None:
        """The serving loop ended. Cancelled: the server stops. Raised (a fault of Edge0's own): nothing would take a
        job again, so its jobs and every later request fail at once with 503 (no client waits forever), /health
        says why, and the log has the traceback."""
        if task.cancelled() or task.exception() is None:
            return
        log_failure("the serving loop stopped", task.exception())
        self.unhealthy = f"its serving loop stopped ({type(task.exception()).__name__}); restart the server"
        jobs = self.active + [self.waiting.get_nowait() for _ in range(self.waiting.qsize())]
        for job in jobs:
            job.events.put_nowait(("error", self._unhealthy_error()))
        self.active, self.running = [], None
        self.idle.set()

    def submit(self, req: GenRequest) -> Job:
        if self.closing:
            raise shutting_down()
        if self.task is not None and self.task.done() and not self.task.cancelled():
            raise self._unhealthy_error()
        if self.unhealthy is not None and getattr(self.engine, "reset", None) is None:
            raise self._unhealthy_error()
        if self.waiting.qsize() >= self.max_queue:
            self.metrics.rejected += 1
            raise ApiError(503, f"the server is busy: {self.waiting.qsize()} requests are already waiting; retry later",
                           "queue_full", retry_after=RETRY_AFTER_S)
        self.arrivals += 1
        job = Job(req, seq=self.arrivals)
        self.waiting.put_nowait(job)
        return job

    @staticmethod
    def shutdown_error() -> ApiError:
        return shutting_down()

    def _unhealthy_error(self) -> ApiError:
        return ApiError(503, f"the server is unhealthy: {self.unhealthy}; see its log", "engine_unhealthy",
                        retry_after=RETRY_AFTER_S)

    async def _serve(self, decoder: "Solo | Batch") -> None:
        """The one serving loop, whatever --max-batch: take waiting jobs into the decoder's room (waiting for one
        while none runs), run one cycle on the worker (cycle.py), answer the jobs it finished or refused. After an
        error every job of the cycle fails (each client gets a 500), once the engine is reset."""
        loop = asyncio.get_running_loop()
        while True:
            newcomers = await self._take(decoder.room, block=not decoder.jobs)
            self._running([*decoder.jobs, *newcomers])
            try:
                refused, finished = await loop.run_in_executor(self.worker, decoder.cycle, newcomers, loop)
            except Exception as e:  # reported to the clients as a 500; the engine is reset first
                failed = [job for job in decoder.abandon(e) if all(job is not n for n in newcomers)] + newcomers
                self.unhealthy = f"a generation failed ({type(e).__name__})"
                await self._reset()  # before the clients hear of the failure: their next request finds it reset
                for job in failed:
                    self.metrics.failed += 1
                    job.events.put_nowait(("error", e))
                self._running(decoder.jobs)
                continue
            for job, e in refused:
                job.events.put_nowait(("error", e))
            for job, fig in finished:
                self.metrics.add(fig)
                # emit's call_soon_threadsafe callbacks were queued before this point: the text comes first
                self._answer(job, ("error", shutting_down()) if job.shutdown else ("done", fig))
            self._running(decoder.jobs)

    def _answer(self, job: Job, event: tuple) -> None:
        """A finished job's last event; under --record-routes once its trace is written (no other job waits)."""
        saved = self.routes.saved(job)
        if saved is None:
            job.events.put_nowait(event)
        else:
            saved.add_done_callback(lambda _: job.events.put_nowait(event))

    async def _take(self, room: int, *, block: bool) -> list[Job]:
        """Waiting jobs for the decoder's free room; waits for one when block (nothing runs)."""
        taken = []
        while len(taken) < room and (not self.waiting.empty() or (block and not taken)):
            job = await self.waiting.get()
            if job.cancel.is_set():  # the client left while waiting
                self.metrics.cancelled += 1
                continue
            if self.unhealthy is not None and (getattr(self.engine, "reset", None) is None or not await self._reset()):
                job.events.put_nowait(("error", self._unhealthy_error()))
                continue
            if self.closing:  # checked after the reset's wait
                job.events.put_nowait(("error", shutting_down()))
                continue
            self.turns += 1
            job.started, job.turn = time.perf_counter(), self.turns
            taken.append(job)
        return taken

    def _running(self, jobs: list[Job]) -> None:
        """The jobs generating now (the cycle's, answered should the loop itself fail)."""
        self.active, self.batch_size = list(jobs), len(jobs)
        self.running = self.active[0] if self.active else None
        if self.running is None:
            self.idle.set()
        else:
            self.idle.clear()

    async def _reset(self) -> bool:
        """Reset the engine after a failed generation, on the worker; whether it is healthy again. Not retried
        for an engine without reset: it stays unhealthy."""
        reset = getattr(self.engine, "reset", None)
        if reset is None:
            self.unhealthy += " and the engine cannot be reset; restart the server"
            log.error(f"unhealthy: {self.unhealthy}")
            return False
        try:
            await asyncio.get_running_loop().run_in_executor(self.worker, reset)
        except Exception as e:
            log.error("resetting the engine failed", error=repr(e), traceback=traceback.format_exc())
            self.unhealthy = f"resetting the engine failed ({type(e).__name__})"
            return False
        self.unhealthy = None
        return True

    async def shut_down(self) -> tuple[int, int]:
        """Take nothing new, answer the waiting jobs 503, cancel the running one and wait until it has
        stopped (its client is answered 503). Returns (running, waiting) cancelled."""
        self.closing = True
        waiting = 0
        while not self.waiting.empty():
            job = self.waiting.get_nowait()
            waiting += not job.cancel.is_set()
            job.events.put_nowait(("error", shutting_down()))
        running = list(self.active)
        for job in running:
            job.shutdown = True
            job.cancel.set()
        await self.idle.wait()
        return len(running), waiting

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        while not self.waiting.empty():
            self.waiting.get_nowait().events.put_nowait(("error", shutting_down()))
        await asyncio.get_running_loop().run_in_executor(None, self.routes.close)  # --record-routes: traces written
        if self.mlx_cache_limit is not None:
            import mlx.core as mx

            mx.set_cache_limit(self.mlx_cache_limit)
