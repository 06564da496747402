"""Stop strings through the OpenAI routes with the official openai client: the answer ends where the stop string
began and says finish_reason "stop" (not "length"), streamed or not, one generation at a time or batched. The
reference is the same server's greedy answer to the same request without the stop string. And serve's
--max-tokens is refused past the model's context, as run refuses it.
"""

import argparse
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from edge0.cli.flags import serve_configs  # noqa: E402
from edge0.cli.serve import add_args as add_serve_flags  # noqa: E402
from edge0.serve.server import BackgroundServer  # noqa: E402

N = 24  # tokens per answer
PROMPT = "def fibonacci(n):\n    "
HI = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module", params=["1", "4"], ids=["fifo", "batched"])
def client(request):
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    srv = BackgroundServer(*serve_configs(p.parse_args(["--max-batch", request.param])), port=0).start()
    try:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60), \
            srv.server.engine.model_id
    finally:
        srv.stop()


def completion(client, model, stream: bool, **fields) -> tuple[str, str]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, stream=stream, **fields)
    if not stream:
        return r.choices[0].text, r.choices[0].finish_reason
    chunks = [c for c in r if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def chat(client, model, stream: bool, **fields) -> tuple[str, str]:
    r = client.chat.completions.create(model=model, messages=HI, max_tokens=N, temperature=0, stream=stream, **fields)
    if not stream:
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = [c for c in r if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("route", [completion, chat], ids=["completions", "chat"])
def test_a_stop_string_ends_the_answer_with_finish_reason_stop(client, route):
    oai, model = client
    ref, finish = route(oai, model, False)
    assert finish == "length" and len(ref) > 10, ref  # N tokens, no end of text: a stop must cut it
    cut = next(i for i in range(3, len(ref) - 3) if ref.find(ref[i:i + 3]) == i and ref[i:i + 3].strip())
    stop = ref[cut:cut + 3]  # first found past the answer's start: some text comes before it
    for stream in (False, True):
        text, finish = route(oai, model, stream, stop=["never in it", stop])
        assert (text, finish) == (ref[:cut], "stop"), (stream, stop)
        assert stop not in text


def test_serve_max_tokens_past_the_context_is_refused():
    """As `run --max-tokens 4096` is (the demo's context is 4096 tokens): one line, exit 2, no server started."""
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "serve", "--port", "0", "--max-tokens", "1000000000"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "edge0: error: --max-tokens 1000000000: must be at most 4095" in proc.stderr
    assert "Traceback" not in proc.stderr and "serving" not in proc.stderr
