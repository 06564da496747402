"""A closed engine of scheduled routing is freed by refcount alone (no cycle through the runtime)."""

import gc
import weakref

import pytest

from edge0.config import EngineConfig
from edge0.decode.request import GenRequest
from edge0.engine import open_engine
from edge0.model.demo import DEMO_STORE
from edge0.pipeline.prefetch_runtime import PrefetchRuntime

PROMPT = [5, 17, 42, 7, 99, 3, 12, 64]


def config(mode: str, **more) -> EngineConfig:
    return EngineConfig.of({"model": str(DEMO_STORE), "routing.mode": mode, "io.executor": "staged",
                            "serving.prompt_cache_gib": 0, "io.slots": 24, **more})  # 24: the layers no head
    # routes hold every expert, so predicted routing overlaps steps


@pytest.mark.parametrize("mode", ["prefetch", "predicted"])
def test_a_closed_engine_is_freed_by_refcount_alone(mode):
    engine = open_engine(config(mode))
    try:
        engine.generate(GenRequest(prompt=PROMPT, max_tokens=6, ignore_eos=True))
        rt = engine.store.runtime
        assert isinstance(rt, PrefetchRuntime)
        alive = weakref.ref(rt), weakref.ref(rt.executors[min(rt.executors)]), weakref.ref(engine)
    finally:
        engine.close()
    gc.disable()
    try:
        del engine, rt
        assert [r() is None for r in alive] == [True, True, True]
    finally:
        gc.enable()
