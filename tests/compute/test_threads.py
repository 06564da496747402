"""Where a decode step's threads run (compute/kernels.py): where they outnumber the cores, MLX's stream thread keeps a
core to itself, the kernels' workers and the thread building a generation's graphs run on the others; elsewhere every
thread runs anywhere."""

import os

import pytest

from edge0.compute import kernels
from edge0.compute.machine import allowed_cores

EXT = kernels.load()
pytestmark = [pytest.mark.skipif(EXT is None, reason=f"edge0 CPU kernels {kernels.reason()}"),
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread placement is Linux's")]
CORES = allowed_cores()


@pytest.fixture
def threads():
    yield
    kernels.set_num_threads(kernels.default_threads(), kernels.default_prompt_threads())


@pytest.mark.skipif(len(CORES) < 2, reason="one core: nothing to place")
def test_two_threads_more_than_the_cores_keep_the_streams_core_for_the_stream(threads):
    """Decode threads + the graph-building thread over the cores: the stream runs on the last core alone, the workers
    on the others, and a generation's graph-building thread there too while it decodes (its own cores after)."""
    from mlx_lm.sample_utils import make_sampler

    from edge0.config import EngineConfig, KernelConfig, ServingConfig
    from edge0.engine import demo_store, open_engine
    from edge0.decode import loop as steps

    n = len(CORES)  # n decode threads + the graph-building thread: one more thread than cores
    kernels.set_num_threads(n)
    assert EXT.thread_cpus() == ([CORES[-1]], list(CORES[:-1]))
    before = os.sched_getaffinity(0)
    seen = []
    with open_engine(EngineConfig(model=str(demo_store()), kernel=KernelConfig(name="edge0", threads=n),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine, engine.kernel.active():
        for _ in steps.generate_steps(engine.store.model, [1, 2, 3, 4], max_tokens=3, sampler=make_sampler(0.0),
                                      runtime=engine.store.runtime):
            seen.append(os.sched_getaffinity(0))
    assert seen == [set(CORES[:-1])] * 3
    assert os.sched_getaffinity(0) == before


def test_threads_no_more_than_the_cores_run_anywhere(threads):
    """One decode thread on two cores or more (the default there), or fewer decode threads than cores: no thread is
    placed, and a generation leaves the graph-building thread's cores as they are."""
    kernels.set_num_threads(max(1, len(CORES) - 1), len(CORES))
    stream, workers = EXT.thread_cpus()
    assert stream == list(CORES) and workers in ([], list(CORES))
    before = os.sched_getaffinity(0)
    with kernels.graph_thread():
        assert os.sched_getaffinity(0) == before


def test_an_engine_takes_both_of_two_cores_where_every_expert_is_resident(threads):
    """Without --kernel-threads an engine sets its decode threads for its runtime: on 2 cores both where every expert
    is resident (nothing is read in decode: no I/O pool to leave a core to), one where experts stream; the stream
    then keeps its core (the first case) or nothing is placed (the second)."""
    from edge0.config import EngineConfig, IOConfig, KernelConfig, ServingConfig
    from edge0.engine import demo_store, open_engine

    got = {}
    for executor in ("resident", "staged"):
        with open_engine(EngineConfig(model=str(demo_store()), io=IOConfig(executor=executor),
                                      kernel=KernelConfig(name="edge0"), serving=ServingConfig(prompt_cache_gib=0))):
            got[executor] = (EXT.num_threads(), EXT.thread_cpus()[0])
    want = {ex: kernels.default_threads(resident=ex == "resident") for ex in got}
    assert {ex: n for ex, (n, _) in got.items()} == want
    if len(CORES) == 2 and not os.environ.get("EDGE0_KERNEL_THREADS"):
        assert got == {"resident": (2, [CORES[-1]]), "staged": (1, list(CORES))}


@pytest.mark.skipif(len(CORES) < 2, reason="one core: nothing to place")
def test_a_served_batch_builds_its_steps_off_the_streams_core(threads, monkeypatch):
    """`edge0 serve`'s batched cycle (admit, then one step for all) runs off the stream's core where it keeps one, as
    a generation does, and leaves the worker thread's cores as they were."""
    import asyncio

    from edge0.config import EngineConfig, KernelConfig, ServingConfig
    from edge0.engine import demo_store, open_engine
    from edge0.serve.cycle import Batch

    class Job:  # what a cycle reads of a queued job
        def __init__(self, req):
            self.req, self.events = req, asyncio.Queue()
            self.cancel = type("Flag", (), {"is_set": staticmethod(lambda: False)})

    n = len(CORES)
    with open_engine(EngineConfig(model=str(demo_store()), kernel=KernelConfig(name="edge0", threads=n),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        decoder = Batch(engine, 2)
        batch = decoder.batch
        seen, step = [], batch.step
        monkeypatch.setattr(batch, "step", lambda: seen.append(os.sched_getaffinity(0)) or step())
        before = os.sched_getaffinity(0)
        loop = asyncio.new_event_loop()
        try:
            refused, _ = decoder.cycle([Job(engine.request([1, 2, 3, 4], max_tokens=4))], loop)
            admitted = decoder.jobs
            decoder.cycle([], loop)
        finally:
            loop.close()
    assert len(admitted) == 1 and not refused
    assert seen == [set(CORES[:-1])] * 2 and os.sched_getaffinity(0) == before


@pytest.mark.skipif(len(CORES) < 2, reason="one core: nothing to place")
def test_a_thread_that_cannot_be_placed_builds_where_it_runs(threads, monkeypatch):
    """Cores taken from the process after the kernels placed their threads (a cpuset changed): the graph-building
    thread's placement fails with OSError, and the generation runs where the thread may, with no traceback."""
    kernels.set_num_threads(len(CORES))

    def refused(*_):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refused)
    ran = []
    with kernels.graph_thread():
        ran.append(True)
    assert ran == [True]
