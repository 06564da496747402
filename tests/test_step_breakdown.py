"""tools/step_breakdown.py counts the graph-building thread's waits in every sync it makes, the streamed path's too."""

import importlib.util
import time
from pathlib import Path

import mlx.core as mx
import pytest

from edge0.compute import kernels

spec = importlib.util.spec_from_file_location("step_breakdown", Path(__file__).parents[1] / "tools" / "step_breakdown.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.parametrize("wait", ["mx.eval", "host_eval", "queue"])
def test_eval_clock_counts_the_waits_of_every_sync(wait):
    """A graph of a few milliseconds waited for through mx.eval, kernels.host_eval, or kernels.queue then mx.eval: the
    clock holds most of that time (host_eval and queue call the extension, not mx.eval), and puts back what it patched."""
    if wait != "mx.eval" and not kernels.available():
        pytest.skip(f"edge0 CPU kernels {kernels.reason()}")
    saved = (mx.eval, mx.async_eval, *((kernels.load().host_eval, kernels.load().queue) if kernels.available() else ()))
    x = mx.random.normal((256, 256), key=mx.random.key(0)) / 16
    mx.eval(x)
    with tool.EvalClock() as clock:
        y = x
        for _ in range(60):
            y = mx.tanh(y @ x)
        t0 = time.perf_counter()
        if wait == "mx.eval":
            mx.eval(y)
        elif wait == "host_eval":
            kernels.host_eval(y)
        else:
            kernels.queue(y)
            kernels.host_eval(y + 1)
        elapsed = time.perf_counter() - t0
    assert clock.s >= 0.8 * elapsed > 0
    assert (mx.eval, mx.async_eval, *((kernels.load().host_eval, kernels.load().queue) if kernels.available() else ())) \
        == saved
