"""`edge0 make-workload`: a trained store widened with zero neurons computes the base's logits exactly, its
bundles grow by width / H, it verifies, and its heads (every MoE layer) route as the base's."""

import json
import subprocess
import sys

import numpy as np
import pytest

from edge0.config import EngineConfig, IOConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.errors import Edge0Error
from edge0.io.manifest import read_manifest
from edge0.bench.workload import hidden_of, make_workload


@pytest.fixture(scope="module")
def made(models, tmp_path_factory):
    base = models("qwen3_moe")
    out = tmp_path_factory.mktemp("w") / "wide"
    h = hidden_of(read_manifest(base))
    info = make_workload(str(out), base=str(base), width=3 * h, heads_steps=2, progress=False)
    return base, out, info


def test_widened_store_is_the_base_with_larger_bundles(made):
    base, out, info = made
    mb, mw = read_manifest(base), read_manifest(out)
    h = hidden_of(mb)
    assert hidden_of(mw) == 3 * h and info["expert_width"] == 3 * h
    assert mw.bundle_bytes == 3 * mb.bundle_bytes and mw.num_experts == mb.num_experts
    assert info["logits_max_abs_diff"] == 0.0  # zero neurons add exactly zero
    assert info["consumers"] == [e.layer for e in mb.layers]  # every MoE layer consumes a head
    assert info["owners"][str(mb.layers[0].layer)] == mb.layers[-1].layer  # the first one's, owned by the last
    replay = json.loads((out / "workload" / "replay.json").read_text())
    assert len(replay["prompt"]) == 128 and len(replay["tokens"]) == 256
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "verify", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_predicted_routing_on_the_workload_is_the_base_with_its_heads(made):
    """Heads route where their held-out recall reaches --route-recall, and only read ahead elsewhere."""
    base, out, info = made
    want = sorted(int(c) for c, r in info["recall"].items() if r["heads"] >= info["route_recall"])
    assert info["routes"] == want
    replay = json.loads((out / "workload" / "replay.json").read_text())
    ids = replay["prompt"][:6] + replay["tokens"][:10]
    got = []
    for config in (EngineConfig(model=str(out), io=IOConfig(executor="staged")),  # predicted by default: the heads next to it
                   EngineConfig(model=str(base), io=IOConfig(executor="staged"), routing=RoutingConfig(
                       mode="predicted", heads=str(next((out / "workload").glob("heads-k*-base.safetensors")))))):
        with open_engine(config) as engine:
            assert engine.config.routing.mode == "predicted"
            rt = engine.store.runtime
            assert sorted(c for c, ex in rt.executors.items() if ex.predicted_routing) == want
            assert all(len(ex.heads) == 1 for ex in rt.executors.values())  # every layer owns one head
            got.append(np.array(engine.forced_logprobs(ids)))
    assert np.array_equal(got[0], got[1])


def test_a_base_with_an_adapter_gives_a_workload_that_runs_by_default(models, tmp_path):
    """The built-in model ships recovery adapters bound to its own bytes and heads: the workload must not carry
    them, or its default (predicted routing, the adapter next to the store) refuses to load."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(models("qwen3_moe"), base)
    (base / "lora-k2.safetensors").write_bytes(b"an adapter of the base")
    out = tmp_path / "wide"
    make_workload(str(out), base=str(base), width=2 * hidden_of(read_manifest(base)), heads_steps=2, progress=False)
    assert not list(out.glob("lora-*"))
    with open_engine(EngineConfig(model=str(out))) as engine:
        r = engine.config.routing
        assert r.mode == "predicted" and r.lora == "none"  # no adapter next to it
        assert len(engine.generate(engine.request([1, 2, 3], max_tokens=2)).tokens) == 2


def test_heads_route_only_where_told(made, tmp_path):
    """A head file's `routes`: predicted routing routes those consumers; the others keep their router."""
    from edge0.model.arch import read_config
    from edge0.model.heads import HeadSet

    _, out, _ = made
    m, config = read_manifest(out), read_config(out)
    heads = HeadSet.load(next(out.glob("heads-k*.safetensors")), m, config)
    layers = [e.layer for e in m.layers]
    heads.routes = layers[1:2]
    path = tmp_path / "one.safetensors"
    heads.save(path)
    assert HeadSet.load(path, m, config).routes == layers[1:2]
    with open_engine(EngineConfig(model=str(out), routing=RoutingConfig(mode="predicted", heads=str(path)),
                                  io=IOConfig(executor="staged"))) as engine:
        flags = {c: ex.predicted_routing for c, ex in engine.store.runtime.executors.items()}
    assert flags == {c: c == layers[1] for c in layers}


def test_bad_requests_are_one_line(made, tmp_path):
    base, out, _ = made
    h = hidden_of(read_manifest(base))
    with pytest.raises(Edge0Error, match="exists and is not empty; pass --force"):
        make_workload(str(out), base=str(base), width=2 * h, heads_steps=1, progress=False)
    with pytest.raises(Edge0Error, match=f"--expert-width {h + 1}: must be at least the base's {h} and a multiple of"):
        make_workload(str(tmp_path / "x"), base=str(base), width=h + 1, heads_steps=1, progress=False)
    with pytest.raises(Edge0Error, match="not every MoE layer"):
        default_heads = base / f"heads-k{read_manifest(base).top_k}.safetensors"
        make_workload(str(tmp_path / "y"), base=str(base), width=2 * h, progress=False,
                      base_heads_file=str(default_heads) if default_heads.exists() else str(_default_layout(base, tmp_path)))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def _default_layout(base, tmp_path):
    """Heads in the default layout (not the first layers): what --base-heads must refuse."""
    from edge0.model.arch import read_config
    from edge0.model.heads import HeadSet

    path = tmp_path / "default.safetensors"
    HeadSet.create(read_manifest(base), read_config(base), top_k=read_manifest(base).top_k).save(path)
    return path
