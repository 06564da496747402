"""What the serving loop (jobs.py JobQueue._serve) runs on the worker thread, one cycle at a time.

Solo (--max-batch 1): a cycle is one whole generation (engine.generate: a batch of one, edge0/decode/loop.py). Batch
(--max-batch N): a cycle admits the newcomers (prefill, edge0/decode/batch.py) and takes one decode step for all; a
finished or cancelled job leaves at the next boundary. Both answer cycle(newcomers) -> (refused, finished) and
abandon(error) after one; the loop does the rest (taking jobs, answering them, the metrics, the reset after an error).
"""

from __future__ import annotations

from typing import Callable

from ..compute.kernels import graph_thread
from ..compute.runtime import batch_rows
from ..decode.batch import BatchDecoder
from ..errors import Edge0Error
from ..log import log, log_failure
from .routes_record import Quiet


def emitter(job, loop) -> Callable[[str], None]:
    """emit(text) for job's generation: worker thread -> the loop."""
    return lambda text: loop.call_soon_threadsafe(job.events.put_nowait, ("text", text))


class Solo:
    """One generation at a time: the jobs' FIFO."""

    room = 1  # jobs a cycle takes
    jobs: tuple = ()  # jobs carried from one cycle to the next: none

    def __init__(self, engine, hook=None):
        self.engine, self.hook = engine, hook or Quiet()  # hook: routes_record.py (--record-routes)

    def cycle(self, newcomers: list, loop) -> tuple[list, list]:
        """The newcomer's whole generation (any error fails it: the loop resets the engine)."""
        (job,) = newcomers
        self.hook.start(job)
        fig = self.engine.generate(job.req, emitter(job, loop), job.cancel.is_set)
        self.hook.finish(job, fig)
        return [], [(job, fig)]

    def abandon(self, e: Exception) -> list:
        """After the cycle raised e (logged): no job is carried."""
        log_failure("generation failed", e)
        return []


def batch_size(engine, max_batch: int) -> int:
    """The sequences a step takes: --max-batch, or fewer over staged slot banks, the most rows whose expected union of
    experts fits a layer's bank (compute/runtime.py batch_rows): beyond it every step reads the overflow again."""
    if max_batch <= 1:
        return max_batch
    rt = engine.store.runtime
    if rt.executor != "staged" or not rt.banks:  # resident, or every layer held: nothing is read per step
        return max_batch
    slots, experts = min(b.slots for b in rt.banks), engine.store.manifest.num_experts
    rows = batch_rows(max_batch, slots=slots, experts=experts, top_k=engine.top_k)
    if rows < max_batch:
        log.info(f"batching: at most {rows} sequences a step (--max-batch {max_batch}): the expected union of more "
                 f"rows' experts overflows the staged banks' {slots} slots a layer", experts=experts,
                 top_k=engine.top_k, hint="--slots raises it")
    return rows


class Batch:
    """Continuous batching: the jobs' sequences decode together, joining and leaving at step boundaries."""

    def __init__(self, engine, max_batch: int, hook=None):
        self.batch = BatchDecoder(engine, max_batch)
        self.hook = hook or Quiet()  # told who is admitted and whose rows a step holds (routes_record.py)
        self.hook.follow(lambda: self.jobs)

    @property
    def room(self) -> int:
        return self.batch.room

    @property
    def jobs(self) -> list:
        return [s.owner for s in self.batch.seqs]

    def cycle(self, newcomers: list, loop) -> tuple[list, list]:
        """Admit the newcomers (a refused one, e.g. too long, is answered alone), then one step (off the stream's core
        where it keeps one, as a generation's graph-building thread is)."""
        refused = []
        with graph_thread():
            for job in newcomers:
                self.hook.start(job)
                try:
                    self.batch.admit(job.req, emitter(job, loop), job.cancel.is_set).owner = job
                except Edge0Error as e:
                    refused.append((job, e))
            self.hook.start(None)
            finished = self.batch.step()  # also reports the newcomers done at their first token
        for s in finished:
            self.hook.finish(s.owner, s.fig, len(s.fed))
        return refused, [(s.owner, s.fig) for s in finished]

    def abandon(self, e: Exception) -> list:
        """After the cycle raised e (logged): the jobs that were in the batch (the runtime is recovered)."""
        log_failure("a batched step failed", e)
        return [s.owner for s in self.batch.abandon()]
