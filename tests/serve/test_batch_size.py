"""The server's batch over staged slot banks takes at most the rows whose expected union of experts fits a layer's bank
(a bigger one re-reads the overflow every step: slower in aggregate than its sequences one after another); over
resident experts --max-batch stands."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from edge0.config import EngineConfig, IOConfig, RoutingConfig, ServingConfig
from edge0.engine import open_engine
from edge0.serve.jobs import JobQueue

PROMPTS = ["def fibonacci(n):", "import os", "class Stack:", "for i in range(10):"]


def step_sizes(engine) -> list[int]:
    """The jobs of every serving cycle (one decode step each) while the 4 prompts, queued at once, are served."""

    async def serve():
        with ThreadPoolExecutor(1) as worker:
            q = JobQueue(engine, worker)
            sizes, running = [], q._running
            q._running = lambda jobs: (sizes.append(len(jobs)), running(jobs))
            jobs = [q.submit(engine.request(engine.encode_text(p), max_tokens=6)) for p in PROMPTS]
            q.start()
            for job in jobs:
                assert [kind async for kind, _ in job][-1] == "done"
            await q.close()
        return sizes

    return asyncio.run(serve())


def fitting_rows(experts: int, top_k: int, slots: int, most: int) -> int:
    """The most rows, up to `most`, whose expected union of experts (rows independent) fits `slots`."""
    return max(b for b in range(1, most + 1) if experts * (1 - (1 - top_k / experts) ** b) <= slots)


@pytest.mark.parametrize("executor,slots", [("staged", 8), ("resident", None)])
def test_staged_banks_cap_the_batch_at_the_rows_they_fit(executor, slots, capsys):
    config = EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor=executor, slots=slots),
                          serving=ServingConfig(max_batch=4, prompt_cache_gib=0))
    with open_engine(config) as engine:
        m = engine.store.manifest
        sizes = step_sizes(engine)
    if executor == "staged":
        rows = fitting_rows(m.num_experts, m.top_k, slots, 4)
        assert 1 < rows < 4  # the store's shape makes the test: a batch of 4 would overflow 8 slots
        assert max(sizes) == rows, sizes
        assert f"at most {rows} sequences a step (--max-batch 4)" in capsys.readouterr().err
    else:
        assert max(sizes) == 4, sizes
        assert "sequences a step" not in capsys.readouterr().err
