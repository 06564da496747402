"""POST /v1/messages (Anthropic's Messages API) over real HTTP on 127.0.0.1 with the official `anthropic` client,
and the batch and prompt-cache figures of /metrics.

The server runs in-process with the default flags (the built-in demo model, its default routing). The
reference of every answer is the OpenAI chat route's greedy answer to the same conversation on the same
server: the two routes must give the same tokens.
"""

import argparse
import json
import threading
import time
from types import SimpleNamespace

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from tests import helpers  # noqa: E402
from edge0.cli.flags import serve_configs  # noqa: E402
from edge0.cli.serve import add_args as add_serve_flags  # noqa: E402
from edge0.serve.messages import stop_reason  # noqa: E402
from edge0.serve.server import BackgroundServer  # noqa: E402

N = 16  # tokens per answer
DEADLINE = 60.0
M = "/v1/messages"
HI = [{"role": "user", "content": "hi"}]
# (system, messages) as Anthropic takes them, and the same conversation as OpenAI's chat messages
CONVERSATIONS = [
    (None, [{"role": "user", "content": "hello"}], [{"role": "user", "content": "hello"}]),
    ("Be brief.", [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}],
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]),
    ([{"type": "text", "text": "You write "}, {"type": "text", "text": "Python.", "cache_control": {"type": "ephemeral"}}],
     [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "ok"},
      {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "sys?"}]}],
     [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"},
      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and sys?"}]),
]


@pytest.fixture(scope="module")
def setup():
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    # one generation at a time: the 529 and failure tests act on the queue's one generating slot; no prompt cache:
    # answers are compared across routes, and a cached prefix splits the prefill elsewhere (docs/USAGE.md)
    srv = BackgroundServer(*serve_configs(p.parse_args(["--max-batch", "1", "--prompt-cache-gib", "0"])), port=0,
                           max_queue=8).start()
    claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=DEADLINE)
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE)
    try:
        yield srv, claude, oai, srv.server.engine.model_id
    finally:
        srv.stop()


def http(srv, method: str, path: str, body: bytes | None = None) -> tuple[int, dict | str, dict]:
    return helpers.http_request(srv.url, method, path, body, timeout=DEADLINE)


def metric(srv, name: str) -> float:
    return helpers.metric(srv.url, name)


def wait_for(cond, what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def openai_answer(oai, model: str, msgs: list, **kw):
    r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=N, temperature=0, **kw)
    return r.choices[0].message.content, r.usage


def test_answers_equal_the_openai_chat_route(setup):
    srv, claude, oai, model = setup
    for system, msgs, same in CONVERSATIONS:
        ref, usage = openai_answer(oai, model, same)
        kw = {"system": system} if system is not None else {}
        m = claude.messages.create(model=model, max_tokens=N, messages=msgs, **kw)  # the server's default: greedy
        assert m.content[0].text == ref and len(m.content) == 1 and m.content[0].type == "text"
        assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == model
        assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
        assert m.usage.output_tokens == usage.completion_tokens == N
        with claude.messages.stream(model=model, max_tokens=N, messages=msgs, **kw) as s:
            assert "".join(s.text_stream) == ref
            final = s.get_final_message()
        assert final.content[0].text == ref and final.stop_reason == "max_tokens" and final.usage.output_tokens == N
    # sampling fields (sent in the body: this client version has no arguments for them); top_k 1 is greedy
    m = claude.messages.create(model=model, max_tokens=N, messages=msgs, extra_body={"temperature": 1.0, "top_k": 1},
                               cache_control={"type": "ephemeral"}, speed="standard", metadata={"user_id": "u"}, **kw)
    assert m.content[0].text == ref


def test_stop_sequences(setup):
    srv, claude, oai, model = setup
    ref, _ = openai_answer(oai, model, HI)
    stop = ref.strip()[2:4]
    cut = ref.find(stop)
    assert cut > 0
    m = claude.messages.create(model=model, max_tokens=N, messages=HI, stop_sequences=["never here", stop])
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (ref[:cut], "stop_sequence", stop)
    assert m.usage.output_tokens < N
    with claude.messages.stream(model=model, max_tokens=N, messages=HI, stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == ref[:cut]
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_stop_reason_end_turn(setup):
    """EOS (finish "stop" with no stop string in the text) is end_turn; a stop string found is stop_sequence."""
    engine = setup[0].server.engine
    ids = engine.encode_text(" x = 1\ny = 2")
    req = SimpleNamespace(prompt=[engine.encode_text("a")[-1]], stop=["y ="])
    text = engine.tokenizer.decode(req.prompt + ids)[len(engine.tokenizer.decode(req.prompt)):]
    fig = SimpleNamespace(finish_reason="stop", tokens=ids, text=text[:text.find("y =")])
    assert stop_reason(engine, req, fig) == ("stop_sequence", "y =")
    assert stop_reason(engine, SimpleNamespace(prompt=req.prompt, stop=["z"]), fig) == ("end_turn", None)
    assert stop_reason(engine, SimpleNamespace(prompt=req.prompt, stop=[]), fig) == ("end_turn", None)
    assert stop_reason(engine, req, SimpleNamespace(**{**fig.__dict__, "finish_reason": "length"})) == ("max_tokens", None)


def test_event_stream(setup):
    srv, _, oai, model = setup
    ref, _ = openai_answer(oai, model, HI)
    body = json.dumps({"model": model, "max_tokens": N, "messages": HI, "stream": True}).encode()
    status, text, headers = http(srv, "POST", M, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    data = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert all(d["type"] == n for n, d in zip(names, data))
    deltas = len(names) - 6
    assert deltas > 0 and names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                                    "content_block_stop", "message_delta", "message_stop"]
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert data[1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for d in data[3:3 + deltas]) == ref
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for d in data[3:3 + deltas])
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == N


def test_final_assistant_message_is_continued(setup):
    """Prefill: a final assistant message is the start of the answer (the completions route with the same ids)."""
    srv, claude, oai, model = setup
    engine = srv.server.engine
    ids = engine.encode_chat(HI) + engine.tokenizer.encode("def", add_special_tokens=False)
    ref = oai.completions.create(model=model, prompt=ids, max_tokens=N, temperature=0).choices[0].text
    m = claude.messages.create(model=model, max_tokens=N, messages=[*HI, {"role": "assistant", "content": "def"}])
    assert m.content[0].text == ref and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)


def msg(**fields) -> bytes:
    return json.dumps({"max_tokens": 2, "messages": HI, **fields}).encode()


def turn(role: str = "user", **fields) -> bytes:
    return msg(messages=[*HI, {"role": role, **fields}])


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
# (method, body, status, Anthropic error type, what the message says)
CASES = [
    ("POST", b"{not json", 400, "invalid_request_error", "not valid JSON"),
    ("POST", b"[1]", 400, "invalid_request_error", "must be a JSON object"),
    ("POST", b'{"messages": ' + b"[" * 100_000, 400, "invalid_request_error", "nested too deeply"),
    ("POST", json.dumps({"messages": HI}).encode(), 400, "invalid_request_error", "'max_tokens': required"),
    ("POST", msg(max_tokens=None), 400, "invalid_request_error", "'max_tokens': required"),
    ("POST", msg(max_tokens=0), 400, "invalid_request_error", "'max_tokens': 0 is out of range [1, 4096]"),
    ("POST", msg(max_tokens="8"), 400, "invalid_request_error", "'max_tokens': expected an integer"),
    ("POST", msg(temperature=1.5), 400, "invalid_request_error", "'temperature': 1.5 is out of range [0.0, 1.0]"),
    ("POST", msg(top_p=0), 400, "invalid_request_error", "'top_p': 0 is out of range (0, 1]"),
    ("POST", msg(top_k=-1), 400, "invalid_request_error", "'top_k': -1 is out of range"),
    ("POST", msg(stop_sequences="x"), 400, "invalid_request_error", "'stop_sequences': expected a list"),
    ("POST", msg(stop_sequences=[1]), 400, "invalid_request_error", "'stop_sequences': expected a list"),
    ("POST", msg(stream="yes"), 400, "invalid_request_error", "'stream': expected true or false"),
    ("POST", msg(messages=None), 400, "invalid_request_error", "'messages': required"),
    ("POST", msg(messages=[]), 400, "invalid_request_error", "'messages': expected a non-empty list"),
    ("POST", msg(messages=["hi"]), 400, "invalid_request_error", "'messages[0]': expected an object"),
    ("POST", turn("system", content="x"), 400, "invalid_request_error",
     "'messages[1].role': expected 'user' or 'assistant', got 'system' (the system prompt is the top-level"),
    ("POST", turn("tool", content="x"), 400, "invalid_request_error", "'messages[1].role': expected 'user'"),
    ("POST", turn(), 400, "invalid_request_error", "'messages[1].content': required"),
    ("POST", turn(content=""), 400, "invalid_request_error", "'messages[1].content': must not be empty"),
    ("POST", turn(content=5), 400, "invalid_request_error", "'messages[1].content': expected a string or a list"),
    ("POST", turn(content=[IMAGE]), 400, "invalid_request_error",
     "'messages[1].content[0]': 'image' blocks are not supported (text only)"),
    ("POST", turn(content=[{"type": "tool_result", "tool_use_id": "t", "content": "x"}]), 400,
     "invalid_request_error", "'messages[1].content[0]': 'tool_result' blocks are not supported"),
    ("POST", turn(content=[{"text": "x"}]), 400, "invalid_request_error", "'messages[1].content[0]': expected a"),
    ("POST", turn(content=[{"type": "text"}]), 400, "invalid_request_error", "'messages[1].content[0].text': required"),
    ("POST", turn(content=[{"type": "text", "text": "x", "mood": 1}]), 400, "invalid_request_error",
     "'messages[1].content[0].mood': not a field of a text block"),
    ("POST", turn(content="x", name="me"), 400, "invalid_request_error", "'messages[1].name': not a field"),
    ("POST", turn("assistant", content="def "), 400, "invalid_request_error", "must not end with whitespace"),
    # JSON's lone surrogates, which the tokenizer raises on: named by field and byte (the prefill was a 500)
    ("POST", turn("assistant", content="d\u00e9f\ud800"), 400, "invalid_request_error",
     "'messages[1].content': a lone surrogate at byte 4 is not text"),
    ("POST", turn(content="ab\udcff"), 400, "invalid_request_error",
     "'messages[1].content': a lone surrogate at byte 2 is not text"),
    ("POST", turn(content=[{"type": "text", "text": "ok"}, {"type": "text", "text": "\ud800"}]), 400,
     "invalid_request_error", "'messages[1].content[1].text': a lone surrogate at byte 0 is not text"),
    ("POST", msg(system="x\udfff"), 400, "invalid_request_error", "'system': a lone surrogate at byte 1 is not text"),
    ("POST", msg(system=5), 400, "invalid_request_error", "'system': expected a string or a list of text blocks"),
    ("POST", msg(system=[IMAGE]), 400, "invalid_request_error", "'system[0]': 'image' blocks are not supported"),
    ("POST", msg(tools=[{"name": "f", "input_schema": {"type": "object"}}]), 400, "invalid_request_error",
     "'tools': not supported (this server does not call tools)"),
    ("POST", msg(tool_choice={"type": "any"}), 400, "invalid_request_error", "'tool_choice': not supported"),
    ("POST", msg(thinking={"type": "enabled", "budget_tokens": 1024}), 400, "invalid_request_error",
     "'thinking': not supported (no extended thinking)"),
    ("POST", msg(mcp_servers=[{"type": "url", "url": "x", "name": "m"}]), 400, "invalid_request_error",
     "'mcp_servers': not supported"),
    ("POST", msg(seed=1), 400, "invalid_request_error", "'seed': not a field of /v1/messages"),
    ("POST", msg(stop=["x"]), 400, "invalid_request_error", "'stop': not a field of /v1/messages"),
    ("POST", msg(metadata="x"), 400, "invalid_request_error", "'metadata': expected an object"),
    ("POST", msg(messages=[{"role": "user", "content": "x " * 5000}], max_tokens=4000), 400,
     "invalid_request_error", "exceed the model's context"),
    ("POST", msg(model="no-such-model"), 404, "not_found_error", "the model 'no-such-model' does not exist"),
    ("GET", None, 405, "invalid_request_error", "GET /v1/messages: Method Not Allowed"),
]


def test_bad_requests_are_anthropic_errors(setup):
    srv, claude, _, model = setup
    for method, body, status, kind, says in CASES:
        got, err, _ = http(srv, method, M, body)
        assert got == status and isinstance(err, dict), (body, got, err)
        assert err == {"type": "error", "error": {"type": kind, "message": err["error"]["message"]}}, err
        assert says in err["error"]["message"], (body, err)
    # neutral values of unsupported fields pass, as clients send them
    got, r, _ = http(srv, "POST", M, msg(tools=[], tool_choice={"type": "auto"}, thinking={"type": "disabled"},
                                         metadata={"user_id": "u"}, service_tier="auto", model=model, top_k=0))
    assert got == 200 and r["usage"]["output_tokens"] == 2, r
    with pytest.raises(anthropic.BadRequestError, match="'max_tokens': 0 is out of range"):
        claude.messages.create(model=model, max_tokens=0, messages=HI)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=2, messages=HI)
    assert http(srv, "GET", "/health")[1]["status"] == "ok"


def test_overloaded_and_failed_generations(setup, monkeypatch):
    srv, claude, _, model = setup
    srv.call(lambda: setattr(srv.server.jobs, "max_queue", 0))
    try:
        got, err, headers = http(srv, "POST", M, msg())
        assert got == 529 and err["error"]["type"] == "overloaded_error" and int(headers["Retry-After"]) > 0, err
    finally:
        srv.call(lambda: setattr(srv.server.jobs, "max_queue", 8))

    def boom(*a, **k):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(srv.server.engine, "generate", boom)
    got, err, _ = http(srv, "POST", M, msg())
    assert got == 500 and err["error"]["type"] == "api_error" and "secret" not in json.dumps(err), err
    with pytest.raises(anthropic.APIStatusError, match="api_error"):  # an `error` event: the status line was 200
        with claude.messages.stream(model=model, max_tokens=2, messages=HI) as s:
            list(s.text_stream)
    monkeypatch.undo()
    assert claude.messages.create(model=model, max_tokens=2, messages=HI).usage.output_tokens == 2


def test_metrics_batch_queue_and_prompt_cache(setup, monkeypatch):
    srv, claude, oai, model = setup
    for name in ("batch_size", "queue_waiting", "generating"):
        assert metric(srv, name) == 0
    # one long generation and one more request: each is either in the running step or waiting
    cancelled = metric(srv, "cancelled_total")
    s = claude.messages.stream(model=model, max_tokens=4000, messages=HI).__enter__()
    next(iter(s.text_stream))
    done = {}
    t = threading.Thread(target=lambda: done.update(m=claude.messages.create(model=model, max_tokens=2, messages=HI)))
    t.start()
    try:
        wait_for(lambda: metric(srv, "batch_size") + metric(srv, "queue_waiting") == 2, "two requests in")
        assert metric(srv, "batch_size") >= 1 and metric(srv, "generating") == 1
    finally:
        s.close()
    t.join(DEADLINE)
    assert done["m"].usage.output_tokens == 2
    wait_for(lambda: metric(srv, "batch_size") == 0, "the server to be idle")
    assert metric(srv, "cancelled_total") == cancelled + 1  # the closed stream stopped its generation

    # the prompt-cache counters are the engine's (0 without a prompt cache)
    stats = getattr(getattr(srv.server.engine, "prompt_cache", None), "stats", None)
    assert metric(srv, "prompt_cache_hits_total") == getattr(stats, "hits", 0)
    assert metric(srv, "prompt_cache_tokens_total") == getattr(stats, "tokens", 0)
    monkeypatch.setattr(srv.server.engine, "prompt_cache", SimpleNamespace(stats={"hits": 3, "tokens": 70}),
                        raising=False)
    assert metric(srv, "prompt_cache_hits_total") == 3 and metric(srv, "prompt_cache_tokens_total") == 70
    monkeypatch.setattr(srv.server.engine, "prompt_cache", SimpleNamespace(stats=SimpleNamespace(hits=4, tokens=9)),
                        raising=False)
    assert metric(srv, "prompt_cache_hits_total") == 4 and metric(srv, "prompt_cache_tokens_total") == 9
