"""`edge0 serve --record-routes DIR` (serve/routes_record.py) over real HTTP on the demo store: each finished request's
trace, DIR/<its id>.npz, holds exactly what `edge0 run --record-routes` records for the same prompt and settings (run
in-process before the server starts: one MLX user at a time), alone and as a row of a batch; `--routes` replays it;
a DIR that is not new or empty is refused by name."""

import argparse
import contextlib
import io
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from edge0.cli.flags import serve_configs  # noqa: E402
from edge0.cli.run import add_args as add_run_flags, main as run  # noqa: E402
from edge0.cli.serve import add_args as add_serve_flags  # noqa: E402
from edge0.io.routetrace import read_trace  # noqa: E402
from edge0.serve.routes_record import record_dir  # noqa: E402
from edge0.serve.server import BackgroundServer  # noqa: E402
from tests.helpers import http_request  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    ", "import os\n"]
N = 6  # tokens per answer
FLAGS = ("--routing", "native")  # a batch's first step after a join routes by the router, not the heads: native is
# the routing a row has alone and batched


def edge0_run(prompt: str, out, *extra: str) -> dict:
    p = argparse.ArgumentParser()
    add_run_flags(p)
    args = p.parse_args(["--prompt", prompt, "--max-tokens", str(N), "--json", "--record-routes", str(out),
                         *FLAGS, *extra])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert run(args) == 0
    return json.loads(buf.getvalue())


def serve(tmp_path, *flags: str) -> BackgroundServer:
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    args = p.parse_args([*FLAGS, *flags])
    srv = BackgroundServer(*serve_configs(args), port=0)
    srv.server.record_routes = record_dir(str(tmp_path / "routes"))  # as `edge0 serve` checks and passes it
    return srv.start()


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    d = tmp_path_factory.mktemp("refs")
    return {p: (edge0_run(p, d / f"{i}.npz"), read_trace(d / f"{i}.npz")) for i, p in enumerate(PROMPTS)}


def same(got, ref) -> None:
    assert got.ids.shape == ref.ids.shape and (got.ids == ref.ids).all()
    assert got.prompt_tokens == ref.prompt_tokens and got.tokens == ref.tokens and got.layers == ref.layers
    assert np.allclose(got.weights, ref.weights, atol=1e-5)


def test_each_request_one_streamed_writes_the_trace_edge0_run_records(tmp_path, refs):
    """Completions (whole, streamed) and a message: DIR/<id>.npz each, on disk before the answer ends (the writer
    slowed here), equal to `edge0 run --record-routes`'s for the same prompt."""
    srv = serve(tmp_path, "--max-batch", "1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = srv.server.engine.model_id
        rec = srv.server.jobs.routes
        write = rec._write
        rec._write = lambda *a: (time.sleep(0.3), write(*a))
        a = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0)
        assert sorted(p.name for p in (tmp_path / "routes").iterdir()) == [f"{a.id}.npz"]  # on disk when answered
        chunks = list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=N, stream=True))
        body = {"model": model, "max_tokens": N, "messages": [{"role": "user", "content": "hello"}]}
        _, msg, _ = http_request(srv.url, "POST", "/v1/messages", json.dumps(body).encode())
    finally:
        srv.stop()
    b = chunks[0].id
    assert msg["id"].startswith("msg_") and read_trace(tmp_path / "routes" / f"{msg['id']}.npz").prompt_tokens == \
        msg["usage"]["input_tokens"]
    assert sorted(p.name for p in (tmp_path / "routes").iterdir()) == sorted(f"{i}.npz" for i in (a.id, b, msg["id"]))
    for rid, p in ((a.id, PROMPTS[0]), (b, PROMPTS[1])):
        got = read_trace(tmp_path / "routes" / f"{rid}.npz")
        same(got, refs[p][1])
        assert got.tokens[got.prompt_tokens:] == refs[p][0]["tokens"][:N - 1]


def test_two_concurrent_requests_of_a_batch_each_write_their_own_trace(tmp_path, refs):
    """The worker held until both requests are in: the second joins the first's batch (steps of 2 rows, seen by the
    recorder's sink), each row its own trace, equal to its request's run alone."""
    srv = serve(tmp_path, "--max-batch", "2")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = srv.server.engine.model_id
        traced, rows, got, hold = srv.server.jobs.routes.traced, set(), {}, threading.Event()
        sink = traced.sink
        traced.sink = lambda layer, inds, scores: (rows.add(inds.shape[0]), sink(layer, inds, scores))
        srv.server.worker.submit(hold.wait)

        def ask(p):
            got[p] = client.completions.create(model=model, prompt=p, max_tokens=N, temperature=0).id

        threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        end = time.monotonic() + 30
        while srv.call(lambda: srv.server.jobs.arrivals) < 2:
            assert time.monotonic() < end
            time.sleep(0.01)
        hold.set()
        for t in threads:
            t.join(60)
    finally:
        srv.stop()
    assert rows == {1, 2} and len(got) == 2
    for p, rid in got.items():
        same(read_trace(tmp_path / "routes" / f"{rid}.npz"), refs[p][1])


def test_a_served_trace_replays_under_routes(tmp_path, refs):
    """A prompt asked twice is computed whole twice (no prompt cache while recording: the second trace too starts at
    its first token); `edge0 run --routes` reads the served file: the same tokens, and the replay's record the same."""
    srv = serve(tmp_path, "--max-batch", "1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        rid, again = (client.completions.create(model=srv.server.engine.model_id, prompt=PROMPTS[0], max_tokens=N,
                                                temperature=0).id for _ in range(2))
    finally:
        srv.stop()
    same(read_trace(tmp_path / "routes" / f"{again}.npz"), refs[PROMPTS[0]][1])
    path = tmp_path / "routes" / f"{rid}.npz"
    out = edge0_run(PROMPTS[0], tmp_path / "replay.npz", "--routes", str(path))
    assert out["tokens"] == refs[PROMPTS[0]][0]["tokens"]
    same(read_trace(tmp_path / "replay.npz"), read_trace(path))


@pytest.mark.parametrize("case", ["file", "full"])
def test_a_dir_that_is_not_new_or_empty_is_refused_by_name(tmp_path, case):
    path = tmp_path / "routes"
    if case == "file":
        path.write_text("my notes")
    else:
        path.mkdir()
        (path / "mine.npz").write_text("my notes")
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "serve", "--port", "0", "--record-routes", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"edge0: error: --record-routes {path}: "), line
    assert ("exists and is not a directory" if case == "file" else "a directory that is not empty") in line
    assert (path.read_text() if case == "file" else (path / "mine.npz").read_text()) == "my notes"
