"""Routing forced from a trace and recorded into one (`--routes`, `--record-routes`; model/traced.py) on the demo
store: the traced experts are exactly the ones computed, a recorded run replays to the same tokens and reads, and a
trace that does not fit the run is refused by name."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig, ServingConfig
from edge0.engine import open_engine
from edge0.errors import Edge0Error
from edge0.io.routetrace import RouteTrace, read_trace, write_trace
from edge0.model.blocks import _routing
from edge0.model.route_stats import moe_blocks
from edge0.model.traced import TracedRouting
from tests.helpers import run_json

PROMPT = [317, 288, 1350, 269, 1245, 488, 10, 80, 302, 275, 306, 299]  # the demo prompt's ids
LAYERS, EXPERTS, K = 6, 32, 4  # the demo store's


def _random_trace(tokens: int, *, layers=LAYERS, k=K, experts=EXPERTS, seed=0, weights=False) -> RouteTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.permutation(experts)[:k] for _ in range(tokens)] for _ in range(layers)]).astype(np.int32)
    w = rng.random(ids.shape).astype(np.float32) if weights else None
    return RouteTrace(ids, w, list(range(layers)), num_experts=experts)


def _generate(engine, n: int) -> list[int]:
    return engine.generate(engine.request(PROMPT, max_tokens=n, ignore_eos=True)).tokens


def test_forced_routing_computes_exactly_the_traced_experts_at_every_layer():
    """Every layer's executor is handed the trace's ids, row for row (the prompt's, in its chunks, then each step's)."""
    trace = _random_trace(40)
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="staged"))) as engine:
        blocks = moe_blocks(engine.store.model)
        seen = {i: [] for i in blocks}
        for i, blk in blocks.items():
            def spy(x, inds, _run=blk.executor, _seen=seen[i]):
                _seen.append(np.array(inds).reshape(-1, K))
                return _run(x, inds)

            blk.executor = spy
        TracedRouting(engine.store.model, trace=trace, record=False, what="--routes t")
        tokens = _generate(engine, 6)
    rows = len(PROMPT) + len(tokens) - 1
    for j, i in enumerate(blocks):
        assert (np.concatenate(seen[i]) == trace.ids[j, :rows]).all(), i


def test_forced_weights_are_the_traces_or_else_the_routers_own_for_those_ids():
    """With weights in the trace the block combines them; without, its router's softmax over every expert taken at
    the forced ids and renormalised over the K (the demo's norm_topk_prob), computed here in float64."""
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="exact"))) as engine:
        x = mx.random.normal((1, 3, engine.store.model.args.hidden_size), key=mx.random.key(0))
        blk = moe_blocks(engine.store.model)[2]
        for weighed in (True, False):
            trace = _random_trace(3, weights=weighed, seed=1)
            traced = TracedRouting(engine.store.model, trace=trace, record=False, what="--routes t")
            inds, scores = _routing(blk, x)
            traced.detach()
            assert (np.array(inds)[0] == trace.ids[2]).all()
            if weighed:
                assert np.array(scores)[0].tobytes() == trace.weights[2].tobytes()
                continue
            logits = np.array(blk.logits(x), dtype=np.float64)[0]  # (T, E)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p = np.take_along_axis(p / p.sum(-1, keepdims=True), trace.ids[2].astype(np.int64), -1)
            np.testing.assert_allclose(np.array(scores)[0], p / p.sum(-1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "bailing_moe"])
def test_forcing_the_routers_own_choice_gives_its_own_weights(models, arch):
    """The router's chosen ids, forced without weights, are weighed as its own selection weighs them (softmax top-k;
    Bailing's sigmoid, renormalised and scaled): what a public trace without weights replays with."""
    with open_engine(EngineConfig(model=str(models(arch)), routing=RoutingConfig(mode="native"),
                                  io=IOConfig(executor="exact"))) as engine:
        blocks = moe_blocks(engine.store.model)
        x = mx.random.normal((1, 5, engine.store.model.args.hidden_size), key=mx.random.key(3))
        for blk in blocks.values():
            inds, scores = blk.route(x)
            ids = np.array(inds)[0].astype(np.int32)
            trace = RouteTrace(np.stack([ids] * len(blocks)), None, list(blocks))
            traced = TracedRouting(engine.store.model, trace=trace, record=False, what="--routes t")
            f_inds, f_scores = _routing(blk, x)
            traced.detach()
            assert (np.array(f_inds) == np.array(inds)).all()
            np.testing.assert_allclose(np.array(f_scores.astype(mx.float32)), np.array(scores.astype(mx.float32)),
                                       rtol=1e-5, atol=1e-7)


def test_a_recorded_run_replays_without_weights_to_the_same_tokens():
    """The demo's native routing recorded, its weights dropped (a public trace's layout): forced, the router weighs
    the same ids as it did, so greedy decoding gives the same tokens (no prompt cache: the second run computes every
    token again, as the trace's rows are the sequence's)."""
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="staged"),
                                  serving=ServingConfig(prompt_cache_gib=0))) as engine:
        traced = TracedRouting(engine.store.model, trace=None, record=True, what="--record-routes t")
        native = _generate(engine, 8)
        got = traced.recorded(prompt_tokens=len(PROMPT), num_experts=EXPERTS)
        traced.detach()
        assert got.ids.shape == (LAYERS, len(PROMPT) + 7, K)
        TracedRouting(engine.store.model, trace=RouteTrace(got.ids, None, got.layers), record=False, what="t")
        assert _generate(engine, 8) == native


def test_a_trace_that_runs_out_mid_run_is_refused_by_name():
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="staged"))) as engine:
        TracedRouting(engine.store.model, trace=_random_trace(len(PROMPT) + 2), record=False, what="--routes t.json")
        with pytest.raises(Edge0Error, match=r"--routes t.json: the trace holds 14 tokens, the run reached token 15"):
            _generate(engine, 6)


def test_record_then_replay_gives_the_same_tokens_and_reads(tmp_path):
    """`edge0 run --record-routes` on the demo store (native routing, staged), then `--routes` with that file: the
    same tokens, bytes and reads, and the replay records the same trace; the recorded rows are the prompt's tokens and
    the generated ones but the last (it is never computed)."""
    flags = ("--max-tokens", "8", "--ignore-eos", "--executor", "staged", "--routing", "native")
    a = run_json(*flags, "--record-routes", str(tmp_path / "a.json"))
    b = run_json(*flags, "--routes", str(tmp_path / "a.json"), "--record-routes", str(tmp_path / "b.npz"))
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 8
    assert (a["bytes_read"], a["reads"], a["hit_rate"]) == (b["bytes_read"], b["reads"], b["hit_rate"])
    ta, tb = read_trace(tmp_path / "a.json"), read_trace(tmp_path / "b.npz")
    assert (ta.ids == tb.ids).all() and ta.weights.tobytes() == tb.weights.tobytes()
    assert ta.ids.shape == (LAYERS, a["prompt_tokens"] + 7, K) and ta.prompt_tokens == a["prompt_tokens"]
    assert ta.tokens[ta.prompt_tokens:] == a["tokens"][:-1]


def _refused(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "edge0.run", "--max-tokens", "8", "--executor", "staged", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("case", ["layers", "k", "short", "not a trace", "predicted"])
def test_the_command_refuses_a_trace_that_does_not_fit_by_name(tmp_path, case):
    path = tmp_path / "t.json"
    fits = _random_trace(len(PROMPT) + 7)
    if case == "layers":  # the public layout, as shared/traces' OLMoE files (16 layers)
        ids = _random_trace(30, layers=16).ids
        path.write_text(json.dumps({"num_experts": 32, "top_k": 4,
                                    "expert_trace": {str(n): ids[n].tolist() for n in range(16)}}))
    elif case == "not a trace":
        path.write_text(json.dumps({"prompt": PROMPT}))
    else:
        write_trace(path, fits)
    argv = {"k": ("--k", "2"), "short": ("--max-tokens", "9"), "predicted": ("--routing", "predicted")}.get(case, ())
    line = _refused("--routes", str(path), *argv)
    assert line.startswith("edge0: error: --routes " if case != "predicted" else "edge0: error: --routes and"), line
    assert {"layers": "the trace routes 16 MoE layers, the model has 6",
            "k": "the trace routes 4 experts a token, this run 2 (--k)",
            "short": "the trace holds 19 tokens, shorter than the run's 20",
            "not a trace": "not a routing trace (JSON without an expert_trace)",
            "predicted": "--routing predicted"}[case] in line, line


def test_a_recorded_trace_is_never_written_over_a_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text("my notes")
    assert _refused("--record-routes", str(path)) == f"edge0: error: --record-routes {path}: exists; name a new file " \
                                                     "(no file is written over)"
    assert path.read_text() == "my notes"


def test_resident_experts_on_the_edge0_kernel_take_the_forced_routing():
    """Every expert resident on the edge0 kernel, a decode step's MoE block is one fused node that routes inside the
    extension: a traced block must leave it, or its decode steps would neither be forced nor recorded."""
    from edge0.compute import kernels

    if not kernels.available():
        pytest.skip(f"the edge0 kernels are not built: {kernels.reason()}")
    trace = _random_trace(40, seed=4)
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="resident"),
                                  kernel=KernelConfig(name="edge0"))) as engine:
        traced = TracedRouting(engine.store.model, trace=trace, record=True, what="--routes t")
        tokens = _generate(engine, 5)
        got = traced.recorded(prompt_tokens=len(PROMPT))
    rows = len(PROMPT) + len(tokens) - 1
    assert got.ids.shape == (LAYERS, rows, K) and (got.ids == trace.ids[:, :rows]).all()


def test_a_record_file_its_directory_cannot_take_is_refused_before_the_run():
    """/proc takes no new file, even from root (whom os.access would let through): refused before generating."""
    assert _refused("--record-routes", "/proc/edge0-routes.json") == (
        "edge0: error: --record-routes /proc/edge0-routes.json: its directory cannot take a file (No such file or "
        "directory)")
