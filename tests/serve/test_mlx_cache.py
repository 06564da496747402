"""The server bounds MLX's pool of freed buffers: without a limit it grows to the busiest moment's transients
(a batch of concurrent requests) and keeps them for the life of the process. Stopping restores the limit."""

import argparse
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from edge0.cli.flags import serve_configs  # noqa: E402
from edge0.cli.serve import add_args as add_serve_flags  # noqa: E402
from edge0.serve.server import BackgroundServer  # noqa: E402

MIB = 2**20


def test_a_burst_of_batched_requests_leaves_no_pool_of_freed_buffers():
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    before = mx.set_cache_limit(3 * 2**30)  # the caller's own limit (MLX's default is its memory limit)
    srv = BackgroundServer(*serve_configs(p.parse_args(["--max-batch", "4"])), port=0).start()
    try:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = srv.server.engine.model_id

        def ask(i: int) -> str:
            return oai.completions.create(model=model, prompt=f"def f{i}(x):", max_tokens=8).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            assert all(isinstance(t, str) for t in pool.map(ask, range(8)))
        # without the server's limit MLX would keep the batch's freed arrays here (tens of MiB on the demo)
        assert mx.get_cache_memory() < MIB, mx.get_cache_memory() / MIB
    finally:
        srv.stop()
    assert mx.set_cache_limit(before) == 3 * 2**30  # the server put the caller's limit back
