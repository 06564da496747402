"""Prerouter heads: untrained = next-router, predicted routing reads nothing on demand, files are bound
to their model and K, training improves recall and resumes."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from edge0.compute import kernels
from edge0.compute.machine import blas
from edge0.cli.flags import SETTING_FLAGS
from edge0.errors import Edge0Error, SettingError
from edge0.io.manifest import read_manifest
from edge0.model.arch import read_config
from edge0.model.heads import HeadSet, features
from edge0.train.head_phase import train_heads
from tests import helpers


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory):
    store = models("qwen3_moe")
    out = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    report = train_heads(store, out, steps=24, hidden=64, eval_windows=2, progress=False, seq_len=128)
    return store, out, report


def test_untrained_head_is_the_next_router_bit_for_bit(models):
    store = models("bailing_moe")
    m, config = read_manifest(store), read_config(store)
    heads = HeadSet.create(m, config, top_k=m.top_k, hidden=32)
    mx.random.seed(1)
    d = config["hidden_size"]
    for head in heads.heads.values():
        x = mx.random.normal((1, 1, d))
        router = mx.random.normal((1, 1, m.num_experts))
        inds = mx.array([[[1, 3, 5, 7]]], dtype=mx.uint32)
        out = head(features(x, inds, None, m.num_experts), router)
        assert np.array_equal(np.array(out), np.array(router))


def run_json(store, *flags, trace=None):
    return helpers.run_json("--model", str(store), "--max-tokens", "20", "--ignore-eos", "--prompt",
                            "def main(argv):\n    return 0\n" * 4, *flags, *(["--trace", str(trace)] if trace else []))


def test_untrained_heads_serve_as_next_router(models, tmp_path):
    store = models("qwen3_moe")
    m = read_manifest(store)
    path = tmp_path / "untrained.safetensors"
    HeadSet.create(m, read_config(store), top_k=m.top_k, hidden=16).save(path)
    # --read-ahead always: both runs read ahead at every step (the measured gate's first steps are paused, and its
    # choices follow the clock; a prompt read from the page cache would pause them too)
    a = run_json(store, "--routing", "prefetch", "--predictor", "heads", "--heads", str(path), "--read-ahead", "always")
    b = run_json(store, "--routing", "prefetch", "--predictor", "next-router", "--read-ahead", "always")
    assert a["recall"] > 0  # they predicted
    assert a["tokens"] == b["tokens"]
    assert a["recall"] == b["recall"]  # the same predictions, step for step
    # reads: a speculative read the router did not choose is taken back only if a worker has not started it yet,
    # which the scheduler's loop and the pool decide by timing; the counts agree up to those few
    for k in ("loads", "demand_loads"):
        assert abs(a[k] - b[k]) <= max(2, 0.05 * b[k]), (k, a[k], b[k])


def test_predicted_routing_reads_nothing_on_demand_at_consumers(trained, tmp_path):
    store, heads, report = trained
    assert report["blas"] == blas()  # the report names the BLAS it trained on
    trace = tmp_path / "t.json"
    res = run_json(store, "--routing", "predicted", "--executor", "staged", "--heads", str(heads), trace=trace)
    assert res["predictor"] == "heads"
    consumers = set(report["consumers"])
    events = json.loads(trace.read_text())["traceEvents"]
    reads = [e for e in events if e.get("name") == "read"]
    # From the first step a head has predicted for (step 1; the step after the prompt routes natively) on:
    assert not [e for e in reads if e["args"]["demand"] and e["args"]["layer"] in consumers and e["args"]["step"] > 0]
    assert [e for e in reads if e["args"]["layer"] in consumers and e["args"]["step"] > 0]
    preds = [e for e in events if e.get("name") == "prediction" and e["args"]["layer"] in consumers]
    assert len(preds) == 19 and all(e["args"]["misses"] == 0 for e in preds)  # the routed set is the staged set


def test_head_files_round_trip_and_are_bound(trained, models, tmp_path):
    store, path, report = trained
    m, config = read_manifest(store), read_config(store)
    loaded = HeadSet.load(path, m, config)
    assert loaded.owners == {int(c): o for c, o in report["owners"].items()} and loaded.top_k == m.top_k
    again = tmp_path / "again.safetensors"
    loaded.save(again)
    a, b = mx.load(str(path)), mx.load(str(again))
    assert a.keys() == b.keys() and all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    from edge0.model.convert import convert
    from edge0.model.make import make_model

    src = make_model("qwen3_moe", "tiny", tmp_path / "other-src", seed=1, progress=False)
    other = convert(src, tmp_path / "other", progress=False)  # same architecture and shapes, other weights
    with pytest.raises(Edge0Error, match="another model"):
        HeadSet.load(path, read_manifest(other), read_config(other))
    with pytest.raises(SettingError, match=f"heads for K={m.top_k}, but routing.top_k 3") as e:
        HeadSet.load(path, m, config, top_k=3)  # the library names its setting; the command line its flag
    assert f"heads for K={m.top_k}, but --k 3 was asked" in e.value.say(SETTING_FLAGS)
    proc = subprocess.run([sys.executable, "-m", "edge0.run", "--model", str(other), "--routing", "predicted",
                           "--heads", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "trained for another model" in proc.stderr and "Traceback" not in proc.stderr


def source_text(tmp_path) -> dict:
    """train_heads' data and heldout: one real source file, where the default tokenizes the stdlib split (seconds
    a call) for tests that check resuming and kernels, not what the heads learn."""
    import inspect
    import json.decoder

    path = tmp_path / "decoder.py"
    path.write_text(inspect.getsource(json.decoder))
    return {"data": path, "heldout": path}


def test_training_improves_recall_and_resumes(trained, tmp_path):
    store, _, report = trained
    for layer, r in report["recall"].items():
        assert r["heads"] > report["recall_before"][layer]["heads"]
        assert report["recall_before"][layer]["heads"] == report["recall_before"][layer]["next-router"]
    out = tmp_path / "h.safetensors"
    kw = dict(hidden=64, eval_windows=1, progress=False, seq_len=128, **source_text(tmp_path))
    first = train_heads(store, out, steps=6, **kw)
    with pytest.raises(Edge0Error, match="--resume"):
        train_heads(store, out, steps=6, **kw)
    resumed = train_heads(store, out, steps=8, resume=True, **kw)
    assert len(resumed["losses"]) == 2  # only the steps after the checkpoint at step 6
    straight = train_heads(store, tmp_path / "s.safetensors", steps=8, **kw)
    assert straight["losses"][:6] == first["losses"]  # same seed, same curve
    assert resumed["losses"] == pytest.approx(straight["losses"][6:], rel=1e-5)


def test_eval_scores_every_serving_mode(trained):
    from edge0.config import EngineConfig, RoutingConfig
    from edge0.bench.quality import evaluate

    store, heads, _ = trained
    native = evaluate(store, max_tokens=48, seq_len=48, config=EngineConfig(routing=RoutingConfig(mode="native")))
    prefetch = evaluate(store, max_tokens=48, seq_len=48, config=EngineConfig(routing=RoutingConfig(mode="prefetch")))
    predicted = evaluate(store, max_tokens=48, seq_len=48, config=EngineConfig(routing=RoutingConfig(mode="predicted",
                                                                                                     heads=str(heads))))
    assert prefetch["tokens"] == native["tokens"] == 48
    assert prefetch["loss"] == pytest.approx(native["loss"], rel=1e-4)  # token by token = one forward pass
    assert predicted["loss"] != native["loss"] and predicted["kind"] == "store, routing predicted"


@pytest.mark.skipif(not kernels.available(), reason="the edge0 CPU kernels are not built")
def test_heads_train_under_the_edge0_kernel(models, tmp_path, monkeypatch):
    """What a user runs: `edge0 train heads` (and make-workload) with the default kernel, edge0 on CPU, whose nodes
    have no gradients; the suite otherwise builds on MLX's (conftest), where this crashed unseen."""
    monkeypatch.setenv("EDGE0_KERNEL", "edge0")
    store = models("qwen3_moe")
    report = train_heads(store, tmp_path / "h.safetensors", steps=2, hidden=16, eval_windows=1, progress=False,
                         seq_len=64, **source_text(tmp_path))
    assert len(report["losses"]) == 2 and all(np.isfinite(report["losses"]))
    assert HeadSet.load(tmp_path / "h.safetensors", read_manifest(store), read_config(store)).top_k == report["top_k"]
