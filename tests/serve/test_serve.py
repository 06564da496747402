"""`edge0 serve` over real HTTP on 127.0.0.1 (ephemeral port) with the official openai client, and `edge0 chat`.

The server runs in-process (its loop on a thread, MLX on its worker thread) on the built-in demo model with its
default routing (predicted), its experts streamed through the scheduled path (--executor staged: pending reads
must be cancelled cleanly; the default keeps the demo's experts resident and reads nothing per request, see
test_defaults.py). References come from `edge0 run` with no flag (resident, whose heads name 2K candidates; the
streamed default names K, so the server is given --candidates 8 to serve the same tokens). They are run
before the server starts (one MLX user at a time). Malformed requests and stopping the server are in
test_serve_input.py.
"""

import argparse
import contextlib
import io
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from tests import helpers  # noqa: E402
from edge0.cli.run import add_args as add_run_flags, main as run  # noqa: E402
from edge0.cli.chat import add_args as add_chat_flags  # noqa: E402
from edge0.cli.flags import serve_configs  # noqa: E402
from edge0.cli.serve import add_args as add_serve_flags  # noqa: E402
from edge0.decode.text import StopFilter  # noqa: E402
from edge0.serve.server import BackgroundServer  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    ", "import os\n", "class Stack:\n"]
N = 24  # tokens per answer
DEADLINE = 30.0  # seconds any polling loop may wait


def edge0_run(prompt: str, *extra: str) -> dict:
    p = argparse.ArgumentParser()
    add_run_flags(p)
    args = p.parse_args(["--prompt", prompt, "--max-tokens", str(N), "--json", *extra])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run(args) == 0
    return json.loads(out.getvalue())


def serve_args(*flags: str):
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return p.parse_args(list(flags))


@pytest.fixture(scope="module")
def setup():
    refs = {p: edge0_run(p)["text"] for p in PROMPTS}
    refs["chat"] = edge0_run("hello", "--chat")["text"]
    # one generation at a time: these tests are about the queue (FIFO order, one generating while others wait,
    # a full queue, a failure mid-generation); the default (batched) server: tests/test_defaults.py, test_batching.py
    srv = BackgroundServer(*serve_configs(serve_args("--max-batch", "1", "--executor", "staged", "--candidates", "8")), port=0, max_queue=8).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE)
    try:
        yield srv, client, refs
    finally:
        srv.stop()


def http(srv, method: str, path: str, body: bytes | None = None) -> tuple[int, dict | str]:
    return http_headers(srv, method, path, body)[:2]


def http_headers(srv, method: str, path: str, body: bytes | None = None) -> tuple[int, dict | str, dict]:
    return helpers.http_request(srv.url, method, path, body, timeout=DEADLINE)


def metric(srv, name: str) -> float:
    return helpers.metric(srv.url, name)


def wait_for(cond, what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def pending_reads(srv) -> int:
    """Reads in flight, asked on the worker thread (after any generation queued before it)."""
    sched = srv.server.engine.store.runtime.sched
    return srv.server.worker.submit(lambda: sched.pending).result(DEADLINE)


def test_completions_match_edge0_run(setup):
    srv, client, refs = setup
    for p in PROMPTS[:2]:
        r = client.completions.create(model=srv.server.engine.model_id, prompt=p, max_tokens=N,
                                      temperature=0)
        assert r.choices[0].text == refs[p]
        assert r.usage.completion_tokens == N and r.usage.total_tokens == r.usage.prompt_tokens + N
        x = r.model_extra["x_edge0"]
        assert x["decode_tok_s"] > 0 and x["prefill_tok_s"] > 0 and x["bytes_read"] > 0
        assert 0 <= x["cold_fraction"] <= 1 and x["stall_ms"] >= 0
    # streamed, with usage at the end
    chunks = list(client.completions.create(model=srv.server.engine.model_id, prompt=PROMPTS[2], max_tokens=N,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == refs[PROMPTS[2]]
    assert chunks[-1].usage.completion_tokens == N and chunks[-1].choices == []


def test_chat_streaming_and_not(setup):
    srv, client, refs = setup
    model = srv.server.engine.model_id
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == refs["chat"] and r.choices[0].finish_reason == "length"
    s = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=N, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s) == refs["chat"]
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model


def test_stop_strings(setup):
    srv, client, refs = setup
    text = refs[PROMPTS[0]]
    stop = text[5:8]
    cut = text.find(stop)
    for stream in (False, True):
        r = client.completions.create(model=srv.server.engine.model_id, prompt=PROMPTS[0], max_tokens=N, stop=[stop],
                                      stream=stream)
        got = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert got == text[:cut]
    f = StopFilter(["END"])
    assert f.feed("abcE") == ("abc", False) and f.feed("N") == ("", False) and f.feed("Dx") == ("", True)
    assert StopFilter(["zz"]).feed("az", final=True) == ("az", False)


def test_cancel_mid_stream_then_next_is_clean(setup):
    srv, client, refs = setup
    cancelled, tokens = metric(srv, "cancelled_total"), metric(srv, "completion_tokens_total")
    s = client.completions.create(model=srv.server.engine.model_id, prompt=PROMPTS[0], max_tokens=4000, stream=True)
    got = 0
    for c in s:
        got += 1
        if got == 3:
            break
    s.close()
    wait_for(lambda: metric(srv, "cancelled_total") == cancelled + 1 and metric(srv, "generating") == 0, "the cancel")
    assert metric(srv, "completion_tokens_total") - tokens < 4000  # stopped early
    assert pending_reads(srv) == 0
    r = client.completions.create(model=srv.server.engine.model_id, prompt=PROMPTS[1], max_tokens=N)
    assert r.choices[0].text == refs[PROMPTS[1]]


def test_concurrent_clients_fifo(setup):
    srv, client, refs = setup
    n = 6
    results: dict = {}
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        p = PROMPTS[i % len(PROMPTS)]
        barrier.wait(DEADLINE)
        chunks = list(client.completions.create(model=srv.server.engine.model_id, prompt=p, max_tokens=N, stream=True,
                                                stream_options={"include_usage": True}))
        results[i] = (p, "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].model_extra["x_edge0"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert len(results) == n
    for p, text, _ in results.values():
        assert text == refs[p]  # no tokens of another request
    order = sorted(results.values(), key=lambda r: r[2]["request"])
    assert [r[2]["turn"] for r in order] == sorted(r[2]["turn"] for r in order)  # served in arrival order


def test_bad_values_are_400_and_the_server_lives(setup):
    srv, client, refs = setup
    model = srv.server.engine.model_id
    vocab = srv.server.engine.vocab
    assert vocab
    ok = {"model": model, "prompt": "x", "max_tokens": 2}
    cases = [
        ({"prompt": [5000000, 2]}, "prompt"),  # used to read the embedding out of range: a segfault
        ({"prompt": [-5]}, "prompt"),
        ({"prompt": [vocab]}, "prompt"),
        ({"seed": -1}, "seed"),
        ({"seed": 1e23}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"model": ["x"]}, "model"),
        ({"top_k": 999999}, "top_k"),
        ({"top_k": 10**400}, "top_k"),
    ]
    for extra, field in cases:
        got, err = http(srv, "POST", "/v1/completions", json.dumps({**ok, **extra}).encode())
        assert got == 400 and f"'{field}'" in err["error"]["message"], (extra, err)
    for raw in (b"NaN", b"Infinity", b"-Infinity"):  # Python's json reads these; they are not numbers to sample with
        body = json.dumps(ok)[:-1].encode() + b', "temperature": ' + raw + b"}"
        got, err = http(srv, "POST", "/v1/completions", body)
        assert got == 400 and "'temperature'" in err["error"]["message"], (raw, err)
    assert http(srv, "GET", "/health")[0] == 200
    body = {**ok, "prompt": [vocab - 1, 0], "seed": 2**64 - 1}
    got, r = http(srv, "POST", "/v1/completions", json.dumps(body).encode())
    assert got == 200, r
    # max_completion_tokens: null is as absent, so max_tokens holds
    got, r = http(srv, "POST", "/v1/completions",
                  json.dumps({**ok, "max_tokens": 3, "max_completion_tokens": None, "prompt": PROMPTS[0]}).encode())
    assert got == 200 and r["usage"]["completion_tokens"] == 3, r


def test_sampling_is_reseeded_only_when_asked(setup):
    srv, client, refs = setup
    assert srv.server.sampling.seed is None  # `edge0 serve` without --seed

    def sample(**kw):
        return client.completions.create(model=srv.server.engine.model_id, prompt=PROMPTS[0], max_tokens=N,
                                         temperature=1.0, **kw).choices[0].text

    assert sample() != sample()  # the engine's random state goes on between requests
    assert sample(seed=7) == sample(seed=7)


def test_serve_port_out_of_range_is_refused_before_loading(tmp_path):
    from edge0.errors import Edge0Error
    from edge0.cli.serve import main as serve_cli

    p = argparse.ArgumentParser()
    add_serve_flags(p)
    for port in ("99999", "-1"):
        args = p.parse_args(["--model", str(tmp_path / "no-store"), "--port", port])
        with pytest.raises(Edge0Error, match="--port"):
            serve_cli(args)


def test_bad_requests(setup, monkeypatch, capfd):
    srv, client, refs = setup
    model = srv.server.engine.model_id
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": model}).encode(), 400),  # no messages
        (json.dumps({"model": model, "messages": [{"role": "user", "content": "x " * 42000}]}).encode(), 400),
        (json.dumps({"model": model, "messages": [{"content": "hi"}]}).encode(), 400),
        (json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(), 400),
        (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),
    ]
    for body, status in cases:
        got, err = http(srv, "POST", "/v1/chat/completions", body)
        assert got == status, (body[:60], err)
        assert set(err["error"]) >= {"message", "type", "code"}
        assert http(srv, "GET", "/health") == (200, {"status": "ok", "model": model, "waiting": 0, "generating": 0})
    got, err = http(srv, "POST", "/v1/completions", json.dumps({"model": model}).encode())
    assert got == 400 and "prompt" in err["error"]["message"]
    got, err = http(srv, "GET", "/v1/nothing-here")
    assert got == 404 and "error" in err
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])

    # internal failure: 500 without a traceback, streamed or not, then served again
    def boom(*a, **k):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(srv.server.engine, "generate", boom)
    capfd.readouterr()
    got, err = http(srv, "POST", "/v1/chat/completions", chat)
    assert got == 500 and "Traceback" not in json.dumps(err) and "secret" not in json.dumps(err)
    log = capfd.readouterr().err
    assert log.count("Traceback") == 1 and log.count("secret detail") >= 1  # logged once, not by queue and route both
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True))
    monkeypatch.undo()
    wait_for(lambda: http(srv, "GET", "/health")[0] == 200, "the engine's reset after each failure")
    assert client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=N).choices[0].message.content == refs["chat"]

    # queue full: one generating, one waiting, the third is refused
    srv.call(lambda: setattr(srv.server.jobs, "max_queue", 1))
    try:
        a = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4000, stream=True)
        next(iter(a))
        b_result = {}
        b = threading.Thread(target=lambda: b_result.update(r=client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=N)))
        b.start()
        wait_for(lambda: http(srv, "GET", "/health")[1]["waiting"] == 1, "the second request to queue")
        got, err, headers = http_headers(srv, "POST", "/v1/chat/completions", chat)
        assert got == 503 and err["error"]["code"] == "queue_full" and int(headers["Retry-After"]) > 0
        a.close()  # frees the slot: the waiting request runs next
        b.join(DEADLINE)
        assert b_result["r"].choices[0].text == refs[PROMPTS[1]]
    finally:
        srv.call(lambda: setattr(srv.server.jobs, "max_queue", 8))
    assert 'edge0_requests_total{status="503"}' in http(srv, "GET", "/metrics")[1]
    assert metric(srv, "rejected_total") >= 1 and pending_reads(srv) == 0


def test_internal_error_resets_the_engine_or_reports_unhealthy(setup, monkeypatch):
    """A generation that fails half-way (at its third piece of text) leaves the runtime mid-step: the queue resets
    the engine, and the next request gets the reference answer. While no reset succeeds, /health and new requests
    answer 503."""
    srv, client, refs = setup
    engine = srv.server.engine
    model = engine.model_id
    real = engine.generate
    body = json.dumps({"model": model, "prompt": PROMPTS[1], "max_tokens": N}).encode()

    def fails_midway(req, emit, cancelled):
        pieces = []

        def emit_then_fail(text: str) -> None:
            pieces.append(text)
            if len(pieces) == 3:
                raise RuntimeError("injected failure")
            emit(text)

        return real(req, emit_then_fail, cancelled)

    def fail_once() -> None:
        monkeypatch.setattr(engine, "generate", fails_midway)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N)
        monkeypatch.setattr(engine, "generate", real)

    def served() -> str:
        return client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=N).choices[0].text

    failed = metric(srv, "failed_total")
    fail_once()
    assert http(srv, "GET", "/health")[1]["status"] == "ok"  # reset by the engine's own reset()
    assert served() == refs[PROMPTS[1]] and pending_reads(srv) == 0
    assert metric(srv, "failed_total") == failed + 1

    def broken_reset():
        raise RuntimeError("cannot reset")

    monkeypatch.setattr(engine, "reset", broken_reset)
    fail_once()
    status, health, headers = http_headers(srv, "GET", "/health")
    assert status == 503 and health["status"] == "unhealthy" and "RuntimeError" in health["error"], health
    assert int(headers["Retry-After"]) > 0
    status, err, headers = http_headers(srv, "POST", "/v1/completions", body)  # the reset is tried again, and fails
    assert status == 503 and err["error"]["code"] == "engine_unhealthy" and int(headers["Retry-After"]) > 0
    monkeypatch.undo()  # the engine's own reset: the next request resets it and is served
    assert served() == refs[PROMPTS[1]] and http(srv, "GET", "/health")[1]["status"] == "ok"

    monkeypatch.setattr(engine, "reset", None)  # an engine that cannot be reset: refused before queuing
    fail_once()
    status, health = http(srv, "GET", "/health")
    assert status == 503 and "restart the server" in health["error"], health
    status, err, headers = http_headers(srv, "POST", "/v1/completions", body)
    assert status == 503 and err["error"]["code"] == "engine_unhealthy", err
    assert "restart the server" in err["error"]["message"]
    monkeypatch.undo()
    assert served() == refs[PROMPTS[1]] and http(srv, "GET", "/health")[1]["status"] == "ok"


def test_chat_cli(setup):
    _, _, refs = setup
    from edge0.cli.chat import chat

    p = argparse.ArgumentParser()
    add_chat_flags(p)
    args = p.parse_args(["--max-tokens", str(N)])
    out = io.StringIO()
    assert chat(args, stdin=io.StringIO("hello\n/stats\n/reset\nhello\n/quit\n"), out=out) == 0
    text = out.getvalue()
    assert text.count(refs["chat"]) == 2  # the same answer after /reset
    assert "tok/s" in text and "MiB" in text


def test_chat_template_fallback():
    from types import SimpleNamespace

    from edge0.config import EngineConfig
    from edge0.engine import Engine

    tok = SimpleNamespace(eos_token_ids=[0], chat_template=None, encode=lambda text: list(text.encode()))
    store = SimpleNamespace(tokenizer=tok, config={}, path=__import__("pathlib").Path("m"),
                            manifest=SimpleNamespace(top_k=2))
    engine = Engine(EngineConfig(), store, kernel=None)
    ids = engine.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert bytes(ids).decode() == "system: Be brief.\n\nuser: hi\n\nassistant:"
