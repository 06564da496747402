"""--split cost's calibration under --routes: it forces the run's trace, so the split balances the reads the run does
(one process stands for the ranks of an even split: no ranks started)."""

import gc
import json

import mlx.core as mx
import numpy as np

from edge0.config import EngineConfig, IOConfig, RoutingConfig
from edge0.dist.calibrate import measured_reads
from edge0.dist.split import cost_split, layer_costs
from edge0.engine import open_engine
from edge0.io.routetrace import RouteTrace


def trace_busy_in(store, busy: set[int], tokens: int = 48) -> RouteTrace:
    """Layers in `busy` route each token to K experts drawn afresh; the others always to experts 0..K-1 (read once,
    then kept in their bank: no decode reads)."""
    manifest = json.loads((store / "edge0.json").read_text())
    e, k = manifest["num_experts"], manifest["top_k"]
    rng = np.random.default_rng(7)
    ids = np.array([[rng.choice(e, k, replace=False) if i in busy else np.arange(k) for _ in range(tokens)]
                    for i in range(4)], dtype=np.int32)
    return RouteTrace(ids, None, list(range(4)), e)


def test_calibration_follows_the_trace(dist_store):
    config = EngineConfig(model=str(dist_store), routing=RoutingConfig(mode="native", lora="none"),
                          io=IOConfig(executor="staged"))
    costs, group = layer_costs(dist_store, 4), mx.distributed.init()
    # the one split of each that puts one busy layer on each rank (either rank with both would read all)
    for busy, want in (({0, 1}, [range(0, 1), range(1, 4)]), ({2, 3}, [range(0, 3), range(3, 4)])):
        gc.collect()
        before = mx.get_active_memory()
        reads = measured_reads(lambda: open_engine(config), group, 4, trace_busy_in(dist_store, busy), "t.json")
        # its engine freed before the run's opens (the trace's hooks hold it in a cycle: collected, not left)
        assert mx.get_active_memory() - before < 4096
        assert all((reads[i] > 0) == (i in busy) for i in range(4)), (busy, reads)
        assert cost_split(costs, 2, reads) == want, (busy, reads)
