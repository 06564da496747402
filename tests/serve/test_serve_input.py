"""`edge0 serve` as a subprocess with the default flags (the built-in demo model, its default routing), fed
malformed and unsupported requests over real HTTP, then stopped with Ctrl-C while it generates.

Every malformed request must get a 4xx JSON error in OpenAI's shape naming what is wrong, and the server's
log (its captured stderr) must hold no traceback.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from tests import helpers  # noqa: E402

DEADLINE = 60.0  # seconds for start-up, a request or a stop
C, P = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


class ServeProcess:
    """`edge0 serve --port 0 FLAGS` with its stderr in a file; the URL is read from its start-up line."""

    def __init__(self, log: Path, *flags: str):
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "edge0.cli", "serve", "--port", "0", *flags],
                                         stdout=subprocess.DEVNULL, stderr=err)
        end = time.monotonic() + DEADLINE
        while not (m := re.search(r"(http://127\.0\.0\.1:\d+)/v1", self.stderr())):
            assert self.proc.poll() is None, f"edge0 serve exited: {self.stderr()}"
            assert time.monotonic() < end, f"edge0 serve did not start: {self.stderr()}"
            time.sleep(0.1)
        self.url = m.group(1)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(DEADLINE)


def request(url: str, method: str, path: str, body: bytes | None = None,
            content_type: str = "application/json") -> tuple[int, dict | str, dict]:
    return helpers.http_request(url, method, path, body, content_type, timeout=DEADLINE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess(tmp_path_factory.mktemp("serve") / "stderr.txt")
    try:
        status, health, _ = request(srv.url, "GET", "/health")
        assert status == 200, health
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE)
        yield srv, client, health["model"]
    finally:
        srv.stop()


def chat(**fields) -> bytes:
    return json.dumps({"messages": HI, "max_tokens": 2, **fields}).encode()


def comp(**fields) -> bytes:
    return json.dumps({"prompt": "x", "max_tokens": 2, **fields}).encode()


def message(**fields) -> bytes:
    return chat(messages=[{"role": "user", "content": "hi"}, fields])


CONTEXT, VOCAB = 4096, 4096  # the demo model's (checked below against the server)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
FORM = b"prompt=hi&max_tokens=2"
BAD_CALL = [{"function": {"name": "f", "arguments": "{\ud800"}}]  # a chat template may render it: the tokenizer raises
MULTIPART = b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--b--\r\n'

# (method, path, body, content type or None, status, what the message says, code or None)
CASES = [
    # bodies that are not a JSON object
    ("POST", P, b"{not json", None, 400, "not valid JSON", "invalid_json"),
    ("POST", P, b"", None, 400, "not valid JSON", "invalid_json"),
    ("POST", P, b"[" * 100_000, None, 400, "nested too deeply", "invalid_json"),
    ("POST", C, b'{"messages": ' + b"[" * 100_000, None, 400, "nested too deeply", "invalid_json"),
    ("POST", P, b'{"prompt": ' + b'{"a": ' * 100_000, None, 400, "nested too deeply", "invalid_json"),
    ("POST", P, b"\xff\xfe\x00\xd8garbage", None, 400, "not valid JSON", "invalid_json"),
    ("POST", P, b'{"prompt": "\xc3\x28"}', None, 400, "not valid JSON", "invalid_json"),
    ("POST", P, b"[1, 2]", None, 400, "must be a JSON object", "invalid_json"),
    ("POST", P, b'"a string"', None, 400, "must be a JSON object", "invalid_json"),
    ("POST", C, b"null", None, 400, "must be a JSON object", "invalid_json"),
    ("POST", P, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, 400, "not valid JSON", None),
    ("POST", P, FORM, "application/x-www-form-urlencoded", 400, "not valid JSON", "invalid_json"),
    ("POST", P, MULTIPART, "multipart/form-data; boundary=b", 400, "not valid JSON", "invalid_json"),
    ("POST", P, comp()[:-1] + b', "temperature": NaN}', None, 400, "'temperature': expected a number", None),
    ("POST", P, comp()[:-1] + b', "top_p": -Infinity}', None, 400, "'top_p': expected a number", None),
    ("POST", P, comp(temperature=json.loads("[" * 500 + "]" * 500)), None, 400,
     "'temperature': expected a number, got a list", None),
    # missing or malformed messages and prompts
    ("POST", C, b"{}", None, 400, "'messages': required", "missing_field"),
    ("POST", C, chat(messages=[]), None, 400, "'messages': expected a non-empty list", None),
    ("POST", C, chat(messages="hi"), None, 400, "'messages': expected a non-empty list", None),
    ("POST", C, chat(messages=["hi"]), None, 400, "'messages[0]': expected an object", None),
    ("POST", C, chat(messages=[{"content": "hi"}]), None, 400, "'messages[0].role': required", None),
    ("POST", C, chat(messages=[{"role": 5, "content": "hi"}]), None, 400, "'messages[0].role': required", None),
    ("POST", C, chat(messages=[{"role": "wizard", "content": "hi"}]), None, 400,
     "'messages[0].role': unknown role 'wizard' (expected system, user, assistant, tool, developer)", None),
    ("POST", C, message(role="function", content="x"), None, 400, "'messages[1].role': unknown role 'function'", None),
    ("POST", C, message(role="", content="x"), None, 400, "'messages[1].role': unknown role ''", None),
    ("POST", C, chat(messages=[{"role": "user"}]), None, 400,
     "'messages[0].content': required in a message of role 'user'", "missing_field"),
    ("POST", C, message(role="system", content=None), None, 400, "'messages[1].content': required", None),
    ("POST", C, message(role="assistant"), None, 400,
     "'messages[1].content': required (or tool_calls) in a message of role 'assistant'", None),
    ("POST", C, message(role="assistant", tool_calls=[]), None, 400, "'messages[1].content': required", None),
    ("POST", C, message(role="user", content=5), None, 400, "'messages[1].content': expected a string or a list", None),
    ("POST", C, message(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]), None, 400,
     "'messages[1].content': expected a string or a list of text parts", None),
    ("POST", C, message(role="user", content="x", mood="happy"), None, 400, "'messages[1].mood': not a field", None),
    ("POST", C, message(role="user", content="x", tool_calls=[{"function": {}}]), None, 400,
     "'messages[1].tool_calls'", None),
    ("POST", C, message(role="user", content="x", name=5), None, 400, "'messages[1].name': expected a string", None),
    ("POST", C, message(role="assistant", content="x", tool_calls=BAD_CALL), None, 400,
     "'messages[1].tool_calls[0].function.arguments': a lone surrogate at byte 1 is not text", None),
    ("POST", P, b"{}", None, 400, "'prompt': required", "missing_field"),
    ("POST", P, comp(prompt=5), None, 400, "'prompt': expected a string", None),
    ("POST", P, comp(prompt=[[1, 2], [3]]), None, 400, "'prompt': expected a string", None),
    ("POST", P, comp(prompt=[1, "a"]), None, 400, "'prompt': expected a string", None),
    ("POST", P, comp(prompt=[True]), None, 400, "'prompt': expected a string", None),
    ("POST", P, comp(prompt=[-5]), None, 400, "'prompt': token id -5 is out of range", None),
    ("POST", P, comp(prompt=[VOCAB]), None, 400, f"'prompt': token id {VOCAB} is out of range", None),
    ("POST", P, comp(prompt="\u00e9\ud800cd"), None, 400, "'prompt': a lone surrogate at byte 2 is not text",
     "invalid_value"),  # (JSON's \ud800: the tokenizer raised on it, a 500)
    ("POST", C, message(role="user", content="ab\udcff"), None, 400,
     "'messages[1].content': a lone surrogate at byte 2 is not text", "invalid_value"),
    ("POST", P, comp(prompt=""), None, 400, "the prompt is empty", "invalid_value"),
    ("POST", P, comp(prompt=[]), None, 400, "the prompt is empty", "invalid_value"),
    ("POST", P, comp(prompt=[""]), None, 400, "the prompt is empty", "invalid_value"),
    ("POST", P, comp(prompt=[5] * (CONTEXT - 5), max_tokens=10), None, 400, "exceed the model's context",
     "context_length_exceeded"),
    # fields this server does not know or does not implement
    ("POST", P, comp(foo=1), None, 400, "'foo': not a field of /v1/completions", "unknown_parameter"),
    ("POST", P, comp(messages=HI), None, 400, "'messages': not a field of /v1/completions", "unknown_parameter"),
    ("POST", C, chat(prompt="x"), None, 400, "'prompt': not a field of /v1/chat/completions", "unknown_parameter"),
    ("POST", C, chat(**{f"x{i}": i for i in range(1000)}), None, 400, "'x4' and 995 more: not a field", None),
    ("POST", P, comp(echo=True), None, 400, "'echo': not supported", "unsupported_value"),
    ("POST", P, comp(suffix="}"), None, 400, "'suffix': not supported", "unsupported_value"),
    ("POST", P, comp(n=2), None, 400, "'n': only 1 choice per request is supported", "unsupported_value"),
    ("POST", C, chat(n=3), None, 400, "'n': only 1 choice", "unsupported_value"),
    ("POST", P, comp(best_of=3), None, 400, "'best_of': only 1 is supported", "unsupported_value"),
    ("POST", C, chat(tools=[TOOL]), None, 400, "'tools': not supported", "unsupported_value"),
    ("POST", C, chat(functions=[TOOL["function"]]), None, 400, "'functions': not supported", "unsupported_value"),
    ("POST", C, chat(tool_choice="required"), None, 400, "'tool_choice': 'required' is not supported", None),
    ("POST", C, chat(response_format={"type": "json_object"}), None, 400,
     "'response_format': type 'json_object' is not supported", "unsupported_value"),
    ("POST", C, chat(response_format="json"), None, 400, "'response_format': expected an object", None),
    ("POST", C, chat(logprobs=True), None, 400, "'logprobs': not supported yet", "unsupported_value"),
    ("POST", C, chat(logprobs=True, top_logprobs=2), None, 400, "'logprobs': not supported yet", None),
    ("POST", C, chat(top_logprobs=2), None, 400, "'top_logprobs': needs 'logprobs': true", None),
    ("POST", P, comp(logprobs=3), None, 400, "'logprobs': not supported yet", "unsupported_value"),
    ("POST", P, comp(logprobs=0), None, 400, "'logprobs': not supported yet", "unsupported_value"),
    ("POST", P, comp(logit_bias={"x": 10}), None, 400, f"'logit_bias': 'x' is not a token id (0 to {VOCAB - 1})", None),
    ("POST", P, comp(logit_bias={str(VOCAB): 1}), None, 400, f"'logit_bias': '{VOCAB}' is not a token id", None),
    ("POST", C, chat(logit_bias={"5": 101}), None, 400, "'logit_bias.5': 101 is out of range [-100.0, 100.0]", None),
    ("POST", C, chat(logit_bias={"5": "1"}), None, 400, "'logit_bias.5': expected a number, got '1'", None),
    ("POST", P, comp(logit_bias=[5]), None, 400, "'logit_bias': expected an object of at most 1024 token ids", None),
    # digits to str.isdigit() that int() refuses (a 500), reads as another number ('١' is 1), or cannot hold
    ("POST", P, comp(logit_bias={"\u00b2": 1}), None, 400, "'logit_bias': '\u00b2' is not a token id", None),
    ("POST", P, comp(logit_bias={"\u0661": 1}), None, 400, "'logit_bias': '\u0661' is not a token id", None),
    ("POST", C, chat(logit_bias={"9" * 5000: 1}), None, 400, "'logit_bias': '999", None),
    ("POST", C, chat(user=5), None, 400, "'user': expected a string", None),
    ("POST", C, chat(metadata="x"), None, 400, "'metadata': expected an object", None),
    # types and ranges of numbers and flags
    ("POST", P, comp(max_tokens=0), None, 400, f"'max_tokens': 0 is out of range [1, {CONTEXT}]", "invalid_value"),
    ("POST", P, comp(max_tokens=-5), None, 400, "'max_tokens': -5 is out of range", None),
    ("POST", P, comp(max_tokens=CONTEXT + 1), None, 400, f"'max_tokens': {CONTEXT + 1} is out of range", None),
    ("POST", P, comp(max_tokens="8"), None, 400, "'max_tokens': expected an integer, got '8'", None),
    ("POST", P, comp(max_tokens=2.5), None, 400, "'max_tokens': expected an integer", None),
    ("POST", P, comp(max_tokens=True), None, 400, "'max_tokens': expected an integer, got True", None),
    ("POST", C, chat(max_completion_tokens=0), None, 400, "'max_completion_tokens': 0 is out of range", None),
    ("POST", C, chat(max_completion_tokens=4, max_tokens=0), None, 400, "'max_tokens': 0 is out of range", None),
    ("POST", P, comp(temperature=-0.1), None, 400, "'temperature': -0.1 is out of range [0.0, 2.0]", None),
    ("POST", C, chat(temperature=2.5), None, 400, "'temperature': 2.5 is out of range [0.0, 2.0]", None),
    ("POST", C, chat(temperature="hot"), None, 400, "'temperature': expected a number, got 'hot'", None),
    ("POST", P, comp(top_p=0), None, 400, "'top_p': 0 is out of range (0, 1]", None),
    ("POST", P, comp(top_p=1.5), None, 400, "'top_p': 1.5 is out of range (0, 1]", None),
    ("POST", P, comp(top_k=-1), None, 400, "'top_k': -1 is out of range", None),
    ("POST", P, comp(top_k=VOCAB + 1), None, 400, f"'top_k': {VOCAB + 1} is out of range [0, {VOCAB}]", None),
    ("POST", P, comp(top_k=2.5), None, 400, "'top_k': expected an integer", None),
    ("POST", P, comp(seed=-1), None, 400, "'seed': -1 is out of range", None),
    ("POST", P, comp(seed=2**64), None, 400, "'seed': 18446744073709551616 is out of range", None),
    ("POST", P, comp(seed=1.5), None, 400, "'seed': expected an integer", None),
    ("POST", C, chat(presence_penalty=3), None, 400, "'presence_penalty': 3 is out of range [-2.0, 2.0]", None),
    ("POST", P, comp(frequency_penalty=-2.5), None, 400, "'frequency_penalty': -2.5 is out of range", None),
    ("POST", P, comp(n=0), None, 400, "'n': 0 is out of range", None),
    ("POST", C, chat(logprobs=True, top_logprobs=21), None, 400, "'top_logprobs': 21 is out of range [0, 20]", None),
    ("POST", P, comp(logprobs=6), None, 400, "'logprobs': 6 is out of range [0, 5]", None),
    ("POST", C, chat(logprobs="yes"), None, 400, "'logprobs': expected true or false", None),
    ("POST", P, comp(stop=5), None, 400, "'stop': expected a string or a list of at most 16 strings", None),
    ("POST", P, comp(stop=["a"] * 17), None, 400, "'stop': expected a string or a list of at most 16", None),
    ("POST", P, comp(stream="yes"), None, 400, "'stream': expected true or false, got 'yes'", None),
    ("POST", P, comp(stream=True, stream_options="x"), None, 400, "'stream_options': expected an object", None),
    ("POST", P, comp(stream=True, stream_options={"include_usage": "yes"}), None, 400,
     "'stream_options.include_usage': expected true or false", None),
    ("POST", P, comp(ignore_eos="no"), None, 400, "'ignore_eos': expected true or false", None),
    ("POST", P, comp(echo="no"), None, 400, "'echo': expected true or false", None),
    ("POST", P, comp(model=["x"]), None, 400, "'model': expected a string, got a list", None),
    ("POST", C, chat(model="no-such-model"), None, 404, "the model 'no-such-model' does not exist", "model_not_found"),
    # routes and methods
    ("GET", "/v1/nothing-here", None, None, 404, "GET /v1/nothing-here: Not Found", "not_found"),
    ("POST", P + "/extra", comp(), None, 404, "Not Found", "not_found"),
    ("GET", P, None, None, 405, "GET /v1/completions: Method Not Allowed", None),
    ("PUT", C, chat(), None, 405, "Method Not Allowed", None),
    ("DELETE", "/v1/models", None, None, 405, "Method Not Allowed", None),
    ("POST", "/health", b"{}", None, 405, "Method Not Allowed", None),
    ("GET", "/v1/models/no-such-model", None, None, 404, "the model 'no-such-model' does not exist", "model_not_found"),
    ("GET", "/v1/models/org%2Fname", None, None, 404, "the model 'org/name' does not exist", "model_not_found"),
]


def test_malformed_requests_are_4xx_json_and_no_traceback(server):
    srv, _, model = server
    _, models, _ = request(srv.url, "GET", "/v1/models")
    assert len(CASES) >= 60
    before = srv.stderr()
    for method, path, body, ctype, status, says, code in CASES:
        got, err, _ = request(srv.url, method, path, body, ctype or "application/json")
        what = (method, path, (body or b"")[:60])
        assert got == status and 400 <= got < 500, (what, got, err)
        assert isinstance(err, dict) and set(err) == {"error"}, (what, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}, (what, err)
        assert err["error"]["type"] == "invalid_request_error", (what, err)
        assert says in err["error"]["message"], (what, err)
        assert code is None or err["error"]["code"] == code, (what, err)
        assert len(err["error"]["message"]) < 300, (what, err)  # one line, not a dump of the request
    assert request(srv.url, "GET", "/health")[:2] == (200, {"status": "ok", "model": model, "waiting": 0,
                                                            "generating": 0})
    log = srv.stderr()[len(before):]
    assert "Traceback" not in log and "error" not in log, log
    _, metrics, _ = request(srv.url, "GET", "/metrics")
    assert "edge0_generations_total 0" in metrics  # none of them reached the engine


def send_raw(url: str, data: bytes) -> bytes:
    """One HTTP/1.1 exchange written by hand (what urllib refuses to send); the answer up to the close."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=DEADLINE) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_malformed_http_is_a_400_and_one_log_line(server):
    """Requests broken below JSON: those no route sees and a body that cannot be decoded are JSON 400s (the
    former's shape: test_front.py). The log gets one line each, never a traceback."""
    srv, _, _ = server
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    cases = [
        (b"GARBAGE\r\n\r\n", None),
        (head + b"Content-Length: abc\r\n\r\n{}", None),
        (head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", None),
        (head + b"X-Long: " + b"a" * 10_000 + b"\r\nContent-Length: 2\r\n\r\n{}", None),
        (head + b"Content-Encoding: gzip\r\nContent-Length: 7\r\n\r\ngarbage",
         "the request body cannot be read (Can not decode content-encoding: gzip)"),
        (head.replace(b"/v1/completions", b"/nowhere") + b"Content-Encoding: gzip\r\nContent-Length: 7\r\n\r\ngarbage",
         "POST /nowhere: Not Found"),
    ]
    before = srv.stderr()
    for data, says in cases:
        answer = send_raw(srv.url, data)
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, (data[:60], answer)
        if says is not None:
            err = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert err["error"]["message"] == says and err["error"]["type"] == "invalid_request_error", err
    time.sleep(0.2)  # aiohttp logs after answering
    log = srv.stderr()[len(before):]
    assert "Traceback" not in log and log.count("\n") <= len(cases), log
    assert request(srv.url, "GET", "/health")[0] == 200


def test_limits_match_the_demo_model(server):
    """CASES assume the demo model's context and vocabulary: check them against the server's own answers."""
    srv, _, _ = server
    got, err, _ = request(srv.url, "POST", P, comp(max_tokens=CONTEXT))
    assert got == 400 and err["error"]["code"] == "context_length_exceeded", err  # in range, but with the prompt
    got, err, _ = request(srv.url, "POST", P, comp(prompt=[VOCAB - 1, 0], max_tokens=1, top_k=VOCAB))
    assert got == 200, err


def test_client_defaults_and_neutral_values_are_served(server):
    """What OpenAI clients send (the openai package only what is given; others neutral values on every
    request) is served, and values that change nothing give the same greedy answer as leaving them out."""
    srv, client, model = server
    base = client.chat.completions.create(model=model, messages=HI, max_tokens=6, temperature=0)
    neutral = client.chat.completions.create(
        model=model, messages=HI, max_tokens=6, temperature=0, n=1, logprobs=False, tools=[], tool_choice="none",
        response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="u-1",
        metadata={"k": "v"}, store=False, parallel_tool_calls=False, seed=0, stop=None, top_p=1)
    assert neutral.choices[0].message.content == base.choices[0].message.content
    parts = client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
        {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}], max_tokens=6, temperature=0)
    assert parts.choices[0].message.content == base.choices[0].message.content
    chunks = list(client.completions.create(model=model, prompt="x", max_tokens=3, echo=False, best_of=1, n=1,
                                            suffix=None, logprobs=None, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []


def test_roles(server):
    """developer is sent to the template as system; an assistant message may carry tool_calls without content."""
    srv, client, model = server

    def answer(messages):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens

    system = answer([{"role": "system", "content": "Be brief."}, *HI])
    assert answer([{"role": "developer", "content": "Be brief."}, *HI]) == system
    assert answer(HI) != system  # the system message is part of the prompt
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    text, _ = answer([*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "user", "content": "and?"}])
    assert isinstance(text, str)


def test_models_retrieve(server):
    srv, client, model = server
    m = client.models.retrieve(model)
    assert (m.id, m.object, m.owned_by) == (model, "model", "edge0")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def stream_until_stopped(client, model: str, got: list, done: threading.Event) -> None:
    try:
        for c in client.completions.create(model=model, prompt="x", max_tokens=CONTEXT - 8, stream=True,
                                           extra_body={"ignore_eos": True}):
            got.append(c.choices[0].text)
    except openai.APIError as e:
        got.append(e)
    done.set()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stopping_cancels_the_running_and_waiting_requests(tmp_path, sig):
    """Ctrl-C or SIGTERM while one request streams and another waits: both are answered at once. One generation
    at a time, so that a request waits (batched: tests/test_batching.py)."""
    srv = ServeProcess(tmp_path / "stderr.txt", "--max-batch", "1")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE)
    try:
        model = request(srv.url, "GET", "/health")[1]["model"]
        streamed: list = []
        done = threading.Event()
        threading.Thread(target=stream_until_stopped, args=(client, model, streamed, done), daemon=True).start()
        end = time.monotonic() + DEADLINE
        while len(streamed) < 3:
            assert time.monotonic() < end and not done.is_set(), streamed
            time.sleep(0.01)
        waiting: dict = {}
        threading.Thread(target=lambda: waiting.update(r=request(srv.url, "POST", P, comp())), daemon=True).start()
        while request(srv.url, "GET", "/health")[1]["waiting"] != 1:
            assert time.monotonic() < end
            time.sleep(0.01)
        t0 = time.monotonic()
        srv.proc.send_signal(sig)
        assert done.wait(DEADLINE)
        rc = srv.proc.wait(DEADLINE)
    finally:
        srv.stop()
    took = time.monotonic() - t0
    log = srv.stderr()
    assert rc == 0 and took < 15, (rc, took, log)
    assert isinstance(streamed[-1], openai.APIError) and "the server is shutting down" in str(streamed[-1])
    assert len(streamed) - 1 < CONTEXT - 8  # stopped, not finished
    status, err, headers = waiting["r"]
    assert status == 503 and err["error"]["code"] == "server_shutting_down", err
    assert int(headers["Retry-After"]) > 0
    assert log.count("shutting down, cancelled 1 running and 1 waiting requests") == 1, log
    assert "Traceback" not in log, log
