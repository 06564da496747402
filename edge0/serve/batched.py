"""`edge0 serve --max-batch N` (N > 1): the queue's jobs decode together (edge0/batching.py).

The loop takes waiting jobs into the batch at step boundaries, up to N, and runs one cycle at a time on
the worker thread: admit (prefill) the newcomers, then one decode step for all. Text goes back to each
job's client as it is decoded; a finished or cancelled job leaves at the next boundary. An error inside a
cycle fails every job in the batch (each client gets a 500), then the engine is reset as after a failed
generation.
"""

from __future__ import annotations

import asyncio
import time

from ..batching import BatchDecoder
from ..compute.kernels import graph_thread
from ..errors import Edge0Error
from ..log import log_failure


async def serve_batched(queue, max_batch: int) -> None:
    """The queue's serving task when batching (JobQueue._serve's counterpart)."""
    loop = asyncio.get_running_loop()
    batch = BatchDecoder(queue.engine, max_batch)
    jobs: dict[int, object] = {}  # id(sequence) -> job
    while True:
        newcomers = await _take(queue, batch, block=not batch.seqs)
        queue.batch_size = len(batch.seqs) + len(newcomers)
        queue.active = [*jobs.values(), *newcomers]  # the cycle's jobs (answered should the loop itself fail)
        try:
            admitted, refused, finished = await loop.run_in_executor(queue.worker, _cycle, batch, newcomers, loop)
        except Exception as e:
            log_failure("a batched step failed", e)
            failed = [jobs.pop(id(s)) for s in batch.abandon() if id(s) in jobs] + newcomers
            queue.unhealthy = f"a generation failed ({type(e).__name__})"
            await queue._reset()  # before the clients hear of the failure: their next request finds it reset
            for job in failed:
                queue.metrics.failed += 1
                job.events.put_nowait(("error", e))
            _set_running(queue, batch, jobs)
            continue
        for job, e in refused:
            job.events.put_nowait(("error", e))
        for job, seq in admitted:
            jobs[id(seq)] = job
        for seq in finished:
            job = jobs.pop(id(seq))
            queue.metrics.add(seq.fig)
            job.events.put_nowait(("error", queue.shutdown_error()) if job.shutdown else ("done", seq.fig))
        _set_running(queue, batch, jobs)


async def _take(queue, batch: BatchDecoder, *, block: bool) -> list:
    """Waiting jobs for the batch's free room; waits for one when the batch is idle."""
    taken = []
    while len(taken) < batch.room and (not queue.waiting.empty() or (block and not taken)):
        job = await queue.waiting.get()
        if job.cancel.is_set():  # the client left while waiting
            queue.metrics.cancelled += 1
            continue
        if queue.unhealthy is not None and not await queue._reset():
            job.events.put_nowait(("error", queue._unhealthy_error()))
            continue
        if queue.closing:
            job.events.put_nowait(("error", queue.shutdown_error()))
            continue
        queue.turns += 1
        job.started, job.turn = time.perf_counter(), queue.turns
        taken.append(job)
    return taken


def _cycle(batch: BatchDecoder, newcomers: list, loop) -> tuple[list, list, list]:
    """On the worker: admit the newcomers (a refused one, e.g. too long, is answered alone), then one step (off the
    stream's core where it keeps one, as a generation's graph-building thread is)."""
    admitted, refused = [], []
    with graph_thread():
        for job in newcomers:
            def emit(text: str, job=job) -> None:  # worker thread -> loop
                loop.call_soon_threadsafe(job.events.put_nowait, ("text", text))

            try:
                admitted.append((job, batch.admit(job.req, emit, job.cancel.is_set)))
            except Edge0Error as e:
                refused.append((job, e))
        finished = batch.step()  # also reports the newcomers done at their first token
    return admitted, refused, finished


def _set_running(queue, batch: BatchDecoder, jobs: dict) -> None:
    queue.active = list(jobs.values())
    queue.running = queue.active[0] if queue.active else None
    queue.batch_size = len(batch.seqs)
    if queue.running is None:
        queue.idle.set()
    else:
        queue.idle.clear()
