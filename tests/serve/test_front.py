"""The server's front (serve/guard.py) over real HTTP on 127.0.0.1: the API key with the official openai and
anthropic clients, deadlines on stalled connections with raw sockets, bodies too large and prompts too long
refused before they are tokenized, tokenizing off the event loop, and serve's front flags.

One in-process server on the built-in demo model (context 4096), with an API key, a 1 s client timeout and a
1 MiB body cap, so that every deadline and limit is reached in a second.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("aiohttp")

from tests import helpers  # noqa: E402
from edge0.cli import main  # noqa: E402
from edge0.cli.flags import serve_configs  # noqa: E402
from edge0.cli.serve import add_args as add_serve_flags  # noqa: E402
from edge0.serve.guard import Front  # noqa: E402
from edge0.serve.server import BackgroundServer  # noqa: E402

KEY = "sk-edge0-front-test"
STALL = 1.0  # --client-timeout of the server under test
MAX_BODY = 2**20
DEADLINE = 30.0
P = "/v1/completions"


@pytest.fixture(scope="module")
def srv():
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    server = BackgroundServer(*serve_configs(p.parse_args([])), port=0,
                              front=Front(api_key=KEY, client_timeout=STALL, max_body=MAX_BODY)).start()
    try:
        yield server
    finally:
        server.stop()


def post(srv, path: str, body: bytes, key: str | None = KEY, timeout: float = DEADLINE):
    """(status, JSON or text, headers) of one POST with urllib (Bearer key), and the seconds it took."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(srv.url + path, data=body, method="POST", headers=headers)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text), time.monotonic() - t0
    except ValueError:
        return status, text, time.monotonic() - t0


def exchange(srv, data: bytes, *, rcvbuf: int | None = None) -> tuple[bytes, float]:
    """Send data on a raw connection, then read until the server closes it: (what came back, seconds)."""
    host, port = srv.url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(STALL + 10)
    with s:
        s.connect((host, int(port)))
        t0 = time.monotonic()
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out, time.monotonic() - t0


def error_of(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head, answer[:300]
    return int(head.split(b" ", 2)[1]), json.loads(body)


# -- the API key --------------------------------------------------------------------------------------


def test_api_key_with_the_openai_and_anthropic_clients(srv):
    model = srv.server.engine.model_id
    ok = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=DEADLINE)
    assert ok.completions.create(model=model, prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert [m.id for m in ok.models.list()] == [model]
    for wrong in ("nope", KEY[:-1], KEY + "x"):
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key=wrong, max_retries=0, timeout=DEADLINE)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=model, prompt="x", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key", e.value.body
    msg = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for client in (anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=DEADLINE),
                   anthropic.Anthropic(base_url=srv.url, auth_token=KEY, max_retries=0, timeout=DEADLINE)):
        assert client.messages.create(**msg).usage.output_tokens == 2  # x-api-key, then Bearer
    bad = anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0, timeout=DEADLINE)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(**msg)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error", e.value.body


def test_every_route_but_health_wants_the_key(srv):
    status, health, _ = helpers.http_request(srv.url, "GET", "/health")
    assert status == 200 and health["status"] == "ok"
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/models/x"), ("GET", "/nowhere"),
                         ("POST", P), ("POST", "/v1/chat/completions")]:
        status, err, headers = helpers.http_request(srv.url, method, path, b"{}" if method == "POST" else None)
        assert status == 401 and err["error"]["code"] == "missing_api_key", (path, err)
        assert headers["WWW-Authenticate"] == "Bearer"
    status, err, _ = helpers.http_request(srv.url, "POST", "/v1/messages", b"{}")
    assert status == 401 and err == {"type": "error", "error": {"type": "authentication_error",
                                                                  "message": err["error"]["message"]}}, err
    status, err, _ = post(srv, P, json.dumps({"prompt": "x", "max_tokens": 1}).encode(), key="Bearer")
    assert status == 401 and err["error"]["code"] == "invalid_api_key"


# -- stalled connections and malformed HTTP -------------------------------------------------------------


def test_a_connection_stalled_in_its_headers_is_closed_with_a_408(srv):
    answer, took = exchange(srv, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert STALL * 0.9 <= took < STALL + 5, took
    status, err = error_of(answer)
    assert status == 408 and err["error"]["code"] == "request_timeout", err
    assert "--client-timeout" in err["error"]["message"]


def test_an_idle_connection_is_closed(srv):
    answer, took = exchange(srv, b"")
    assert answer == b"" and STALL * 0.9 <= took < STALL + 5, (answer, took)
    # and after an answer, the same deadline until the next request's headers
    get = f"GET /health HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    answer, took = exchange(srv, get)
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1, answer
    assert STALL * 0.9 <= took < STALL + 5, took


def test_a_connection_stalled_in_its_body_is_closed_with_a_408(srv):
    head = (f"POST {P} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n").encode()
    answer, took = exchange(srv, head + b'{"prompt": "x"')
    assert STALL * 0.9 <= took < STALL + 5, took
    status, err = error_of(answer)
    assert status == 408 and "the request body did not arrive within 1 s" in err["error"]["message"], err
    assert helpers.http_request(srv.url, "GET", "/health")[0] == 200


def unread(kind: str) -> bytes:
    if kind == "pipelined":
        return b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 2000  # some 500 KB of answers
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4000, "stream": True,
                       "ignore_eos": True}).encode()  # some 700 KB of events
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize("kind", ["pipelined", "stream"])
def test_a_client_that_does_not_read_its_answers_is_dropped(srv, kind):
    """A client that reads none of its answers (a stream, or pipelined requests) fills the sockets, then the
    transport's buffer: the server drops the connection after the client timeout, which cancels a generation,
    instead of holding both for ever. The buffers are made small, as a slow link's would be, so that a few
    kilobytes fill them (else the kernel takes megabytes first)."""
    def connections() -> set:
        return srv.call(lambda: set(srv.server.runner.server.connections))

    before = connections()
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.connect((host, int(port)))
        end = time.monotonic() + DEADLINE
        while not (new := connections() - before):
            assert time.monotonic() < end
            time.sleep(0.01)
        conn = new.pop()
        def small_buffers():
            conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1024)
            conn.transport.set_write_buffer_limits(high=4096)

        srv.call(small_buffers)
        s.sendall(unread(kind))
        t0 = time.monotonic()
        while conn in connections():
            assert time.monotonic() < t0 + DEADLINE, "the connection of a client that reads nothing is still open"
            time.sleep(0.05)
        assert time.monotonic() - t0 >= STALL * 0.9
    while helpers.http_request(srv.url, "GET", "/health")[1]["generating"]:  # cancelled at its next token
        assert time.monotonic() < t0 + DEADLINE, "the dropped client's generation goes on"
        time.sleep(0.05)


def test_malformed_http_is_the_apis_json(srv):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    for data in [b"GARBAGE\r\n\r\n", head + b"Content-Length: abc\r\n\r\n{}",
                 head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
                 head + b"X-Long: " + b"a" * 10_000 + b"\r\nContent-Length: 2\r\n\r\n{}"]:
        status, err = error_of(exchange(srv, data)[0])
        assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == "invalid_http", err
        assert err["error"]["message"].startswith("malformed HTTP request: ") and len(err["error"]["message"]) < 300


# -- bodies too large, prompts too long to tokenize -------------------------------------------------------


def tokenizing(srv, monkeypatch, block: threading.Event | None = None) -> list:
    """The prompts the engine tokenizes from now on (block: each waits for it first)."""
    engine, seen = srv.server.engine, []
    for name in ("encode_text", "encode_chat"):
        real = getattr(engine, name)

        def spy(x, real=real):
            seen.append(x)
            if block is not None:
                assert block.wait(DEADLINE)
            return real(x)

        monkeypatch.setattr(engine, name, spy)
    return seen


def test_a_body_over_the_cap_is_a_413_before_it_is_read(srv, monkeypatch):
    seen = tokenizing(srv, monkeypatch)
    body = json.dumps({"prompt": "a " * MAX_BODY, "max_tokens": 1}).encode()
    status, err, _ = post(srv, P, body)
    assert status == 413 and err["error"]["code"] == "request_too_large", err
    assert f"of {len(body)} bytes is larger than this server takes ({MAX_BODY} bytes" in err["error"]["message"]
    pieces = [body[i:i + 65536] for i in range(0, len(body), 65536)]
    chunked = (f"POST {P} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n"
               "Connection: close\r\n\r\n").encode() + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in pieces)
    status, err = error_of(exchange(srv, chunked + b"0\r\n\r\n")[0])
    assert status == 413 and "the request body is larger than this server takes" in err["error"]["message"], err
    assert seen == []


@pytest.mark.parametrize("path", [P, "/v1/chat/completions", "/v1/messages"])
def test_text_no_context_can_hold_is_refused_before_tokenizing(srv, monkeypatch, path):
    """Under the body cap, with more text than 4096 tokens can stand for: refused without tokenizing it."""
    seen = tokenizing(srv, monkeypatch)
    text = "ab " * 300_000  # 900 KB: some 300k tokens (the demo's longest token is 45 bytes: 184k at the fewest)
    fields = {"prompt": text} if path == P else {"messages": [{"role": "user", "content": text}]}
    status, err, _ = post(srv, path, json.dumps({**fields, "max_tokens": 1}).encode())
    assert status == 400 and "fits the model's context of 4096 tokens" in str(err), err
    assert (err.get("error", {}).get("code") == "context_length_exceeded") == (path != "/v1/messages"), err
    assert seen == []


def test_a_prompt_of_the_longest_tokens_that_fits_is_tokenized(srv, monkeypatch):
    """The bound refuses nothing that fits: the vocabulary's longest token (by its text's bytes), repeated to
    just under the context, is many times more bytes than tokens, and is tokenized and counted. (Asked for more
    tokens than the context has left, it is refused by its token count: no prefill of 4k tokens in a test.)"""
    engine = srv.server.engine
    tok = engine.tokenizer
    longest = max((tok.decode([i]) for i in range(engine.vocab)), key=lambda s: len(s.encode()))
    text = longest * (4096 - 16)
    n = len(engine.encode_text(text))  # the reference: the tokenizer itself
    assert n <= 4096 - 8 and len(text.encode()) > 16 * 4096, n  # far over one byte, or character, per token
    seen = tokenizing(srv, monkeypatch)
    status, err, _ = post(srv, P, json.dumps({"prompt": text, "max_tokens": 4096 - n + 1}).encode())
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert f"the prompt's {n} tokens + max_tokens {4096 - n + 1} exceed" in err["error"]["message"], err
    assert seen == [text]


def test_tokenizing_runs_off_the_event_loop(srv, monkeypatch):
    """While one prompt is being tokenized, /health and other clients are answered."""
    release = threading.Event()
    seen = tokenizing(srv, monkeypatch, block=release)
    got: dict = {}
    worker = threading.Thread(target=lambda: got.update(r=post(srv, P, b'{"prompt": "x", "max_tokens": 1}')))
    worker.start()
    try:
        end = time.monotonic() + DEADLINE
        while not seen:
            assert time.monotonic() < end, "the prompt was never tokenized"
            time.sleep(0.01)
        status, health, _ = helpers.http_request(srv.url, "GET", "/health", timeout=5)
        assert status == 200 and health["status"] == "ok"
        models = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=5).models.list()
        assert [m.id for m in models] == [srv.server.engine.model_id]
    finally:
        release.set()
        worker.join(DEADLINE)
    assert got["r"][0] == 200, got


def test_bodies_in_flight_are_bounded(srv, monkeypatch):
    """While the prep thread is busy, bodies wait for it in memory: past four of the largest, a new one is a 503
    at once (the others are then answered as ever)."""
    release = threading.Event()
    seen = tokenizing(srv, monkeypatch, block=release)
    big = json.dumps({"prompt": "ab " * (MAX_BODY * 9 // 30), "max_tokens": 1}).encode()  # 0.9 MiB
    answers: list = []
    threads = [threading.Thread(target=lambda b=b: answers.append(post(srv, P, b)))
               for b in [b'{"prompt": "x", "max_tokens": 1}'] + [big] * 4]
    try:
        threads[0].start()
        end = time.monotonic() + DEADLINE
        while not seen:  # the first holds the prep thread
            assert time.monotonic() < end
            time.sleep(0.01)
        for t in threads[1:]:
            t.start()
        while srv.call(lambda: srv.server.api.bodies.held) < 4 * len(big):
            assert time.monotonic() < end, "the four bodies are not all held"
            time.sleep(0.01)
        status, err, _ = post(srv, P, big, timeout=5)
        assert status == 503 and err["error"]["code"] == "server_busy", err
    finally:
        release.set()
        for t in threads:
            t.join(DEADLINE)
    assert sorted(a[0] for a in answers) == [200, 400, 400, 400, 400], answers  # the big ones: too much text
    assert srv.call(lambda: srv.server.api.bodies.held) == 0


# -- serve's flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--host", "0.0.0.0"], "--host 0.0.0.0: listening beyond this machine needs an API key: give --api-key KEY "
                            "(or set EDGE0_API_KEY), or --no-api-key"),
    (["--host", "::"], "--host ::: listening beyond this machine needs an API key"),
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: cannot resolve it"),
    (["--api-key", "k", "--no-api-key"], "--no-api-key: --api-key gives a key too; drop one of them"),
    (["--api-key", "a b"], "--api-key: must be printable ASCII without spaces"),
    (["--api-key", ""], "--api-key: must be printable ASCII without spaces"),
    (["--client-timeout", "0"], "--client-timeout 0: must be more than 0 and at most 86400"),
    (["--client-timeout", "nan"], "--client-timeout nan: must be more than 0"),
    (["--max-body-mib", "-1"], "--max-body-mib -1: must be more than 0 and at most 4096"),
])
def test_bad_front_flags_are_one_line(argv, says, capsys, monkeypatch):
    monkeypatch.delenv("EDGE0_API_KEY", raising=False)
    t0 = time.monotonic()
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"edge0: error: {says}" or (err.startswith(f"edge0: error: {says}") and "\n" not in err), err
    assert time.monotonic() - t0 < 5  # refused before the model loads


def test_the_key_may_come_from_the_environment(capsys, monkeypatch):
    from edge0.cli.serve import front_config

    p = argparse.ArgumentParser()
    add_serve_flags(p)
    monkeypatch.setenv("EDGE0_API_KEY", "from-env")
    assert front_config(p.parse_args(["--host", "0.0.0.0"])).api_key == "from-env"
    assert front_config(p.parse_args(["--api-key", "flag"])).api_key == "flag"
    assert main(["serve", "--port", "0", "--no-api-key"]) == 2
    assert "--no-api-key: EDGE0_API_KEY gives a key too" in capsys.readouterr().err
    monkeypatch.setenv("EDGE0_API_KEY", "")  # set but empty: none
    assert front_config(p.parse_args(["--host", "0.0.0.0", "--no-api-key"])).api_key is None
    assert front_config(p.parse_args(["--host", "localhost"])).api_key is None
