"""edge0/bench/switches.py: an A/B arm turns a product behaviour off from outside and puts it back."""

from edge0.bench.switches import one_step_at_a_time
from edge0.config import EngineConfig, ServingConfig
from edge0.engine import open_engine


def test_one_step_at_a_time_stops_a_batch_overlapping_and_puts_the_runtime_back():
    # the built-in model: its batch decodes ahead
    with open_engine(EngineConfig(serving=ServingConfig(prompt_cache_gib=0))) as engine:
        rt = engine.store.runtime
        assert rt.overlaps_batch(2)
        with one_step_at_a_time(rt):
            assert not rt.overlaps_batch(1) and not rt.overlaps_batch(2)
        assert rt.overlaps_batch(2) and "overlaps_batch" not in vars(rt)
