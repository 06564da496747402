"""The default path, as a new user runs it: the built-in model with no flags (it ships heads, so routing is
predicted), generation after generation, in run, serve (with concurrent streaming clients) and chat."""

import argparse
import contextlib
import io
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

from edge0.cli.run import add_args as add_run_flags, main as run  # noqa: E402
from edge0.cli.chat import add_args as add_chat_flags  # noqa: E402
from edge0.cli.flags import serve_configs  # noqa: E402
from edge0.cli.serve import add_args as add_serve_flags  # noqa: E402
from edge0.serve.server import BackgroundServer  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    if n", "import os", "class Stack:\n    def push(self, item", "x"]
N = 16  # tokens per answer
CLIENTS = 8


def run_default(prompt: str) -> dict:
    """`edge0 run --prompt P --max-tokens N --json` and nothing else: a fresh engine per call."""
    p = argparse.ArgumentParser()
    add_run_flags(p)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run(p.parse_args(["--prompt", prompt, "--max-tokens", str(N), "--json"])) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def solo():
    """Each prompt's answer from a fresh process-state engine (the reference of every later answer)."""
    answers = {p: run_default(p) for p in PROMPTS}
    assert {a["routing"] for a in answers.values()} == {"predicted"}  # the default of the built-in model
    return {p: a["text"] for p, a in answers.items()}


@pytest.fixture(scope="module")
def server():
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    srv = BackgroundServer(*serve_configs(p.parse_args([])), port=0, max_queue=32).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        yield srv, client
    finally:
        srv.stop()


def complete(client, prompt: str, stream: bool) -> str:
    if not stream:
        r = client.completions.create(model="edge0-demo", prompt=prompt, max_tokens=N, temperature=0)
        return r.choices[0].text
    chunks = client.completions.create(model="edge0-demo", prompt=prompt, max_tokens=N, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_run_engine_generation_after_generation(solo):
    """One engine, prompts of 1 to 20 tokens one after the other, twice round: each equals its solo answer."""
    from edge0.config import EngineConfig
    from edge0.engine import open_engine
    from edge0.decode.request import GenRequest

    with open_engine(EngineConfig()) as engine:
        assert engine.config.routing.mode == "predicted"
        for prompt in PROMPTS + PROMPTS[::-1]:
            fig = engine.generate(GenRequest(prompt=engine.encode_text(prompt), max_tokens=N, seed=0))
            assert fig.text == solo[prompt], prompt


def test_serve_sequential_requests(server, solo):
    srv, client = server
    for i, prompt in enumerate(PROMPTS * 3):
        assert complete(client, prompt, stream=i % 2 == 1) == solo[prompt], (i, prompt)
    assert srv.call(lambda: srv.server.jobs.running) is None


def test_serve_concurrent_streaming_clients(server, solo):
    """8 clients at once, streaming, greedy: every answer equals the prompt's solo answer."""
    _, client = server
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(CLIENTS)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(lambda p: complete(client, p, stream=True), prompts))
    assert answers == [solo[p] for p in prompts]
    models = client.models.list()  # the built-in model's name for clients, not its directory's ("store")
    assert [m.id for m in models.data] == ["edge0-demo"] and client.models.retrieve("edge0-demo").id == "edge0-demo"


def test_chat_second_turn_and_reset(capsys):
    """`edge0 chat` with no flags: the second turn and the turn after /reset answer, the latter as the first. A line
    that is not UTF-8 (its byte kept as a surrogate, as Python reads standard input) is refused and changes nothing
    (the tokenizer raised on it)."""
    from edge0.cli.chat import chat

    p = argparse.ArgumentParser()
    add_chat_flags(p)
    args = p.parse_args(["--max-tokens", str(N), "--stats"])
    out = io.StringIO()
    said = "def add(a, b):\nab\udcff\nand more\n/reset\ndef add(a, b):\n/quit\n"
    assert chat(args, stdin=io.StringIO(said), out=out) == 0
    assert "edge0 chat: that line is not UTF-8 text (byte 2); say it again" in capsys.readouterr().err
    answers = re.split(r"\n\[edge0\][^\n]*\n", out.getvalue())  # the figures line after every answer
    assert len(answers) == 4 and answers[3] == "", answers
    assert answers[0].strip() and answers[1].strip()
    assert answers[2] == "(new conversation)\n" + answers[0]
