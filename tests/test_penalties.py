"""OpenAI's presence and frequency penalties: the tokens mlx-lm's own logits processors give on the same checkpoint,
a batched sequence's tokens as alone, and the server's routes serving them."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from edge0.decode.batch import BatchDecoder
from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig, ServingConfig
from edge0.engine import open_engine
from edge0.decode.request import GenRequest
from edge0.decode.sampling import PENALTY_TOKENS
from edge0.model.load import cast_floats

from tests.test_batching import PROMPTS

STEPS = 24
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.5)


def test_penalized_tokens_match_mlx_lm(models):
    """Greedy with both penalties, exact path and native routing on MLX's kernels: mlx-lm's generate_step with its
    logits processors over the same window is the oracle; the penalties change this looping model's output."""
    src, store = models("qwen3_moe", "mlx", "src"), models("qwen3_moe")
    model, tok = load(str(src))
    cast_floats(model, mx.float32)
    prompt = tok.encode("def fibonacci(n):\n    return")
    processors = make_logits_processors(presence_penalty=PENALTIES["presence_penalty"],
                                        presence_context_size=PENALTY_TOKENS,
                                        frequency_penalty=PENALTIES["frequency_penalty"],
                                        frequency_context_size=PENALTY_TOKENS)
    steps = generate_step(mx.array(prompt), model, sampler=make_sampler(0.0), logits_processors=processors)
    want = [t for (t, _), _ in zip(steps, range(STEPS))]
    config = EngineConfig(model=str(store), routing=RoutingConfig(mode="native"), io=IOConfig(executor="exact"),
                          kernel=KernelConfig(name="mlx", dtype="float32"), serving=ServingConfig(prompt_cache_gib=0))
    with open_engine(config) as engine:
        got = engine.generate(GenRequest(prompt=prompt, max_tokens=STEPS, ignore_eos=True, **PENALTIES)).tokens
        plain = engine.generate(GenRequest(prompt=prompt, max_tokens=STEPS, ignore_eos=True)).tokens
    assert got == want
    assert plain != want and len(set(want)) > len(set(plain)), "the penalties changed nothing on this prompt"
    # OpenAI's logit_bias through mlx-lm's processor of it: the unbiased first token forbidden, another favoured
    bias = {plain[0]: -100.0, plain[3]: 5.0}
    steps = generate_step(mx.array(prompt), model, sampler=make_sampler(0.0),
                          logits_processors=make_logits_processors(logit_bias=bias))
    want = [t for (t, _), _ in zip(steps, range(STEPS))]
    with open_engine(config) as engine:
        got = engine.generate(GenRequest(prompt=prompt, max_tokens=STEPS, ignore_eos=True, logit_bias=bias)).tokens
    assert got == want and got[0] != plain[0]


@pytest.mark.parametrize("stagger", [False, True])
def test_batched_penalized_sequences_answer_as_alone(stagger):
    """The default engine (predicted routing, its kernels), a batch of 4 where half the requests carry penalties
    (the batch's greedy shortcut then off) and sequences join together or one per step: each equals its solo run."""
    with open_engine(EngineConfig(serving=ServingConfig(max_batch=4, prompt_cache_gib=0))) as engine:
        reqs = [GenRequest(prompt=engine.encode_text(p), max_tokens=16, **(PENALTIES if i % 2 else {}))
                for i, p in enumerate(PROMPTS)]
        solo = [engine.generate(r).tokens for r in reqs]
        plain = [engine.generate(GenRequest(prompt=r.prompt, max_tokens=16)).tokens for r in reqs]
        batch, pending, index, got = BatchDecoder(engine, 4), list(range(len(reqs))), {}, {}
        while pending or batch.seqs:
            while pending and batch.room:
                i = pending.pop(0)
                index[id(batch.admit(reqs[i], lambda t: None, lambda: False))] = i
                if stagger:
                    break
            for s in batch.step():
                got[index[id(s)]] = s.fig.tokens
    assert got == dict(enumerate(solo))
    assert any(solo[i] != plain[i] for i in range(1, len(reqs), 2)), "the penalties changed nothing"


def engine_ids(text: str) -> list[int]:
    with open_engine(EngineConfig(serving=ServingConfig(prompt_cache_gib=0))) as engine:
        return engine.encode_text(text)


def engine_text(ids: list[int], **fields) -> str:
    """The default engine's greedy text for ids (EOS ignored, STEPS tokens)."""
    with open_engine(EngineConfig(serving=ServingConfig(prompt_cache_gib=0))) as engine:
        return engine.generate(GenRequest(prompt=ids, max_tokens=STEPS, ignore_eos=True, **fields)).text


def test_the_server_serves_penalties_as_the_engine_generates_them(tmp_path):
    """`edge0 serve` with no flags: a completion with both penalties, or with a logit bias, is the engine's
    generation with them, and differs from the same request without; out of range is a 400 naming the field. With
    the penalties as
    flags, they are the default of a request that does not name them."""
    from tests.serve.test_serve_input import ServeProcess, request

    ids = engine_ids(PROMPTS[0])
    want = engine_text(ids, **PENALTIES)
    srv = ServeProcess(tmp_path / "stderr.txt")
    try:
        def complete(**fields):
            body = {"prompt": ids, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True, **fields}
            return request(srv.url, "POST", "/v1/completions", json.dumps(body).encode())[:2]

        status, got = complete(**PENALTIES)
        assert status == 200 and got["choices"][0]["text"] == want, got
        assert complete()[1]["choices"][0]["text"] != want
        biased = engine_text(ids, logit_bias={ids[-1]: 8.0})
        assert complete(logit_bias={str(ids[-1]): 8})[1]["choices"][0]["text"] == biased != want
        status, err = complete(presence_penalty=2.5)
        assert status == 400 and "'presence_penalty': 2.5 is out of range [-2.0, 2.0]" in err["error"]["message"]
    finally:
        srv.stop()
    # the server's own defaults, for requests that do not say
    srv = ServeProcess(tmp_path / "stderr2.txt", "--presence-penalty", "1.5", "--frequency-penalty", "0.5")
    try:
        assert complete()[1]["choices"][0]["text"] == want
        assert complete(presence_penalty=0, frequency_penalty=0)[1]["choices"][0]["text"] != want
    finally:
        srv.stop()


def test_run_takes_the_penalties_as_flags():
    """`edge0 run --presence-penalty --frequency-penalty` (also chat's and serve's defaults): the engine's penalized
    tokens; a value out of range is one line naming the flag."""
    import subprocess
    import sys

    from tests.helpers import run_json

    prompt = PROMPTS[0]
    with open_engine(EngineConfig(serving=ServingConfig(prompt_cache_gib=0))) as engine:
        want = engine.generate(GenRequest(prompt=engine.encode_text(prompt), max_tokens=STEPS, ignore_eos=True,
                                          **PENALTIES)).tokens
    got = run_json("--prompt", prompt, "--max-tokens", str(STEPS), "--ignore-eos", "--presence-penalty", "1.5",
                   "--frequency-penalty", "0.5")
    assert got["tokens"] == want
    bad = subprocess.run([sys.executable, "-m", "edge0.run", "--frequency-penalty", "-3"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
        "edge0: error: --frequency-penalty -3.0: must be at least -2"]


def test_a_logit_bias_outside_the_vocabulary_is_refused():
    """The engine's own check, for callers other than the server (which refuses it first, as a 400)."""
    from edge0.errors import Edge0Error

    with open_engine(EngineConfig(serving=ServingConfig(prompt_cache_gib=0))) as engine:
        with pytest.raises(Edge0Error, match=f"logit_bias: token id {engine.vocab} is outside the model's vocabulary"):
            engine.generate(GenRequest(prompt=[1, 2], max_tokens=2, logit_bias={5: 1.0, engine.vocab: 1.0}))
