"""Phases 2 and 3 on a tiny store: heads first, the adapter trained on teacher text and served, checkpoints and
--resume, on-policy distillation from the Phase 2 adapter, its loss, and data parallel over two processes."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from edge0.compute.machine import blas
from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig
from edge0.engine import open_engine
from edge0.errors import Edge0Error
from edge0.io.manifest import read_manifest
from edge0.model.arch import read_config
from edge0.model.heads import HeadSet
from edge0.model.lora import Adapter
from edge0.train.distill import forward_kl, reverse_kl, train_distill
from edge0.train.lora_phase import train_lora

SMALL = dict(steps=4, batch=2, seq_len=32, samples=4, eval_every=2, eval_windows=1, progress=False)


@pytest.fixture(scope="module")
def phase(models, tmp_path_factory):
    """(store with heads-k{K}, its bf16 teacher, a text file for prompts and held-out scoring)."""
    root = tmp_path_factory.mktemp("phase")
    store = root / "store"
    shutil.copytree(models("qwen3_moe", "hf"), store)
    m = read_manifest(store)
    mx.random.seed(0)
    HeadSet.create(m, read_config(store), top_k=m.top_k, hidden=16).save(store / f"heads-k{m.top_k}.safetensors")
    text = root / "text.py"
    text.write_text("".join(f"def f{i}(x, y):\n    return x * {i} + y  # sum {i}\n\n" for i in range(60)))
    return store, models("qwen3_moe", "hf", "src"), text


def lora(phase, out, **kw):
    store, teacher, text = phase
    return train_lora(store, out, teacher=str(teacher), data=str(text), heldout=str(text), **{**SMALL, **kw})


def test_heads_come_first(models, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(models("qwen3_moe", "hf"), store)
    k = read_manifest(store).top_k
    with pytest.raises(Edge0Error, match=f"train the heads first: edge0 train heads --model {store} --out "
                                         f"{store / f'heads-k{k}.safetensors'} --k {k}"):
        train_lora(store, tmp_path / "a.safetensors", teacher=str(models("qwen3_moe", "hf", "src")), **SMALL)
    assert not (tmp_path / "a.safetensors").exists()


def test_phase2_trains_an_adapter_the_engine_serves(phase):
    store, _, _ = phase
    k = read_manifest(store).top_k
    out = store / f"lora-k{k}.safetensors"
    try:
        r = lora(phase, out)
        assert r["phase"] == 2 and r["steps_done"] == 4 and len(r["losses"]) == 4 and r["top_k"] == k
        assert [s for s, _ in r["heldout_curve"]] == [2, 4] and r["heldout_ppl"] == r["heldout_curve"][-1][1]
        assert set(r["heldout_ppl_before"]) == {"native", "predicted"} and r["blas"] == blas()
        saved = json.loads(out.with_name(out.name + ".json").read_text())
        assert saved["losses"] == r["losses"]
        assert {out.name, out.name + ".json"} <= set(read_manifest(store).files)  # the manifest covers them
        a = Adapter.read(out)
        assert a.rank == 16 and json.loads(a.meta["report"])["phase"] == 2
        assert any(np.abs(np.array(b)).max() > 0 for _, b in a.weights.values())  # it moved from zero
        with open_engine(EngineConfig(model=str(store))) as e:  # the default adapter, beside the store
            assert e.describe()["lora"] == str(out) and e.config.routing.mode == "predicted"
    finally:
        out.unlink(missing_ok=True)
        out.with_name(out.name + ".json").unlink(missing_ok=True)


def test_resume_continues_the_same_run(phase, tmp_path):
    whole = lora(phase, tmp_path / "whole.safetensors")
    part = tmp_path / "part.safetensors"
    r = lora(phase, part, stop_at=2)
    assert r["steps_done"] == 2 and not part.exists()
    with pytest.raises(Edge0Error, match="--rank 16 \\(now 8\\)"):
        lora(phase, part, rank=8, resume=True)
    resumed = lora(phase, part, resume=True)
    assert np.allclose(resumed["losses"], whole["losses"], rtol=1e-4)
    assert np.allclose(resumed["heldout_ppl"], whole["heldout_ppl"], rtol=1e-4)
    with pytest.raises(Edge0Error, match="exists; pass --resume"):
        lora(phase, part)


def test_init_starts_from_another_adapter(phase, tmp_path):
    """--init: the run starts where the given adapter ended (its held-out figure is the new run's before); no file, a
    torn one, another model's adapter or another rank is one message naming --init."""
    first = lora(phase, tmp_path / "first.safetensors")
    fresh = lora(phase, tmp_path / "fresh.safetensors", seed=1)
    warm = lora(phase, tmp_path / "warm.safetensors", seed=1, init=str(tmp_path / "first.safetensors"))
    assert np.isclose(warm["heldout_ppl_before"]["predicted"], first["heldout_ppl"], rtol=1e-4)
    assert not np.isclose(fresh["heldout_ppl_before"]["predicted"], first["heldout_ppl"], rtol=1e-4)
    assert warm["init"] == str(tmp_path / "first.safetensors") and fresh["init"] is None
    with pytest.raises(Edge0Error, match="rank 16, alpha 32; this run's are 8, 32 \\(pass --rank 16 --alpha 32\\)"):
        lora(phase, tmp_path / "r8.safetensors", rank=8, init=str(tmp_path / "first.safetensors"))
    with pytest.raises(Edge0Error, match="^--init .*nothing.safetensors: no such adapter file$"):
        lora(phase, tmp_path / "x.safetensors", init=str(tmp_path / "nothing.safetensors"))
    (tmp_path / "torn.safetensors").write_bytes((tmp_path / "first.safetensors").read_bytes()[:100])
    with pytest.raises(Edge0Error, match="^--init .*torn.safetensors: not a safetensors adapter file"):
        lora(phase, tmp_path / "x.safetensors", init=str(tmp_path / "torn.safetensors"))
    other = Adapter.read(tmp_path / "first.safetensors")
    other.fingerprint = "0123456789abcdef"
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(Edge0Error, match="^--init .*other.safetensors: adapter trained for another model "
                                         "\\(fingerprint 0123456789abcdef"):
        lora(phase, tmp_path / "x.safetensors", init=str(tmp_path / "other.safetensors"))
    store, teacher, text = phase
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "train", "lora", "--model", str(store), "--teacher",
                           str(teacher), "--data", str(text), "--heldout", str(text), "--steps", "2", "--batch", "2",
                           "--seq-len", "32", "--samples", "4", "--eval-windows", "1", "--init",
                           str(tmp_path / "first.safetensors"), "--out", str(tmp_path / "cli.safetensors")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]  # the starting figures are the --init adapter's, and say so
    assert line.startswith("held-out ppl on the student path: native + the --init adapter ") and \
        f"predicted + the --init adapter {first['heldout_ppl']:.2f}," in line, line


def test_reverse_kl_over_top_k_and_tail():
    rng = np.random.default_rng(0)
    s = mx.array(rng.normal(size=(3, 50)) * 2)
    t = mx.array(rng.normal(size=(3, 50)) * 2)
    s_lp, t_lp = s - mx.logsumexp(s, -1, keepdims=True), t - mx.logsumexp(t, -1, keepdims=True)
    full = np.array((mx.exp(s_lp) * (s_lp - t_lp)).sum(-1))
    assert np.allclose(np.array(reverse_kl(s_lp, t_lp, 50)), full, atol=1e-5)  # every token: the exact KL
    part = np.array(reverse_kl(s_lp, t_lp, 8))
    assert np.all(part >= -1e-6) and np.all(part <= full + 1e-5)  # a coarser partition: a lower bound
    assert np.allclose(np.array(reverse_kl(t_lp, t_lp, 8)), 0, atol=1e-6)


def test_forward_kl_over_top_k_and_tail():
    rng = np.random.default_rng(1)
    s = mx.array(rng.normal(size=(3, 50)) * 2)
    t = mx.array(rng.normal(size=(3, 50)) * 2)
    s_lp, t_lp = s - mx.logsumexp(s, -1, keepdims=True), t - mx.logsumexp(t, -1, keepdims=True)
    full = np.array((mx.exp(t_lp) * (t_lp - s_lp)).sum(-1))  # KL(teacher || student): the teacher's weights
    assert np.allclose(np.array(forward_kl(s_lp, t_lp, 50)), full, atol=1e-5)
    assert np.allclose(np.array(forward_kl(s_lp, t_lp, 500)), full, atol=1e-5)  # top beyond V: every token
    part = np.array(forward_kl(s_lp, t_lp, 8))
    assert np.all(part >= -1e-6) and np.all(part <= full + 1e-5)
    assert not np.allclose(part, np.array(reverse_kl(s_lp, t_lp, 8)), atol=1e-3)  # not the reverse direction


def test_phase2_distills_the_teacher_with_loss_kd(phase, tmp_path):
    """--loss kd: the teacher scores each window and the adapter descends KL(teacher || student): the loss is that KL
    of the student's logits, and a small step along its gradient lowers it. Through train_lora, the run records it."""
    from mlx.utils import tree_flatten, tree_map

    from edge0.model.arch import vocab_size
    from edge0.train.lora_phase import teacher_kl_loss
    from edge0.train.student import load_student, new_adapter
    from edge0.train.teacher import load_teacher, logprobs

    store, teacher, text = phase
    student = load_student(store)
    try:
        student.adapter(new_adapter(student, rank=4, alpha=8.0, seed=0))
        with student.kernel.active():
            tutor = load_teacher(teacher, vocab_size(read_config(store)))
            with open_engine(EngineConfig(model=str(store),
                                          routing=RoutingConfig(lora="none"))) as e:  # the store's own tokenizer
                ids = e.encode_text(text.read_text())[:33]
            tokens = mx.array([ids])
            t_lp = logprobs(tutor, tokens[:, :-1])
            loss_grad = nn.value_and_grad(student.model, lambda _: teacher_kl_loss(student, t_lp, tokens, 8))
            l0, grads = loss_grad(student.model)
            s_lp = student.logits(tokens[:, :-1])
            s_lp = s_lp - mx.logsumexp(s_lp, -1, keepdims=True)
            assert np.isclose(l0.item(), forward_kl(s_lp, t_lp, 8).mean().item(), rtol=1e-5) and l0.item() > 0
            norm = sum((g * g).sum() for _, g in tree_flatten(grads)).item() ** 0.5
            assert norm > 0
            params = student.model.trainable_parameters()
            student.model.update(tree_map(lambda p, g: p - (1e-3 / norm) * g, params, grads))
            l1, _ = loss_grad(student.model)
        assert l1.item() < l0.item()
    finally:
        student.close()
    r = lora(phase, tmp_path / "kd.safetensors", loss="kd", top=8)
    assert r["loss"] == "kd" and r["top"] == 8 and all(x >= 0 for x in r["losses"])
    assert json.loads(Adapter.read(tmp_path / "kd.safetensors").meta["report"])["loss"] == "kd"
    ce = lora(phase, tmp_path / "ce.safetensors")
    assert ce["loss"] == "ce" and not np.allclose(ce["losses"], r["losses"])


def test_phase3_starts_from_the_phase2_adapter(phase, tmp_path):
    store, teacher, text = phase
    kw = dict(teacher=str(teacher), data=str(text), heldout=str(text), steps=2, batch=2, new=6, eval_every=1,
              eval_windows=1, progress=False)
    with pytest.raises(Edge0Error, match="no Phase 2 adapter to start from; train it first: edge0 train lora"):
        train_distill(store, tmp_path / "d.safetensors", **kw)
    lora(phase, tmp_path / "p2.safetensors")
    r = train_distill(store, tmp_path / "d.safetensors", init=str(tmp_path / "p2.safetensors"), **kw)
    assert r["phase"] == 3 and len(r["losses"]) == 2 and all(x >= 0 for x in r["losses"]) and r["blas"] == blas()
    for figures in (r["heldout_before"], r["heldout_after"]):
        assert set(figures) == {"ppl", "reverse_kl", "top1_agreement"} and figures["reverse_kl"] >= 0
    a = Adapter.read(tmp_path / "d.safetensors")
    p2 = Adapter.read(tmp_path / "p2.safetensors")
    assert a.heads == p2.heads and any(not np.array_equal(np.array(a.weights[k][1]), np.array(p2.weights[k][1]))
                                       for k in a.weights)


def test_two_processes_average_their_gradients(phase, tmp_path):
    """mlx.launch with two local ranks: each takes half of every batch; the adapter equals one process's."""
    store, teacher, text = phase
    flags = ["--model", str(store), "--teacher", str(teacher), "--data", str(text), "--heldout", str(text),
             "--steps", "3", "--batch", "2", "--seq-len", "32", "--samples", "4", "--eval-every", "3",
             "--eval-windows", "2"]
    one = tmp_path / "one.safetensors"
    two = tmp_path / "two.safetensors"
    subprocess.run([sys.executable, "-m", "edge0.cli", "train", "lora", *flags, "--out", str(one)], check=True,
                   capture_output=True, timeout=600)
    launch = shutil.which("mlx.launch", path=str(__import__("pathlib").Path(sys.executable).parent))
    proc = subprocess.run([launch, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "edge0.cli", "train",
                           "lora", *flags, "--out", str(two)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = Adapter.read(one), Adapter.read(two)
    for k in a.weights:
        for x, y in zip(a.weights[k], b.weights[k]):
            assert np.allclose(np.array(x), np.array(y), atol=1e-5)
    assert json.loads(two.with_name("two.safetensors.json").read_text())["ranks"] == 2
    assert not list(tmp_path.glob("*.edge0-tmp-*"))


def test_a_delta_below_the_int4_step_does_not_survive_requantization():
    """merge.survival: 1 - |U - M| / |U - B|; small deltas are mostly erased by requantizing, large ones kept."""
    import mlx.nn as nn

    from edge0.train.merge import requantized, survival

    mx.random.seed(0)
    q = nn.QuantizedLinear(256, 64, bias=False, group_size=64, bits=4)
    base = mx.dequantize(q.weight, q.scales, q.biases, group_size=64, bits=4)
    step = float(mx.mean(mx.abs(q.scales)).item())  # the int4 step of a group
    rng = np.random.default_rng(0)
    small = mx.array(rng.normal(size=base.shape).astype(np.float32) * step * 0.05)
    large = mx.array(rng.normal(size=base.shape).astype(np.float32) * step * 20)
    s_small = survival(base + small, requantized(base, small, q), base)
    s_large = survival(base + large, requantized(base, large, q), base)
    assert s_small < 0.3 and s_large > 0.85, (s_small, s_large)
    assert survival(base + large, base + large, base) == 1.0


@pytest.mark.parametrize("candidates", [None, "K"])
def test_the_student_path_routes_as_served(phase, candidates):
    """The student's logits (Phases 2 and 3 train on them) are the served path's, token for token: the head names
    the candidates a token ahead, the layer's router chooses K of them; position 0 by the layer's own router.
    Served with other candidates, they part."""
    from edge0.train.student import load_student

    store, _, text = phase
    k = read_manifest(store).top_k
    candidates = k if candidates == "K" else candidates
    m = candidates or 2 * k
    with open_engine(EngineConfig(model=str(store), routing=RoutingConfig(mode="predicted", lora="none", candidates=m),
                                  io=IOConfig(executor="resident"), kernel=KernelConfig(name="mlx"))) as engine:
        ids = engine.encode_text(text.read_text())[:40]
        served = np.array(engine.forced_logprobs(ids))  # (39, V)
    with open_engine(EngineConfig(model=str(store),
                                  routing=RoutingConfig(mode="predicted", lora="none",
                                                        candidates=k + 1 if m != k + 1 else k),
                                  io=IOConfig(executor="resident"), kernel=KernelConfig(name="mlx"))) as engine:
        other = np.array(engine.forced_logprobs(ids))
    student = load_student(store, candidates=candidates)
    try:
        with student.kernel.active():
            logits = student.logits(mx.array([ids[:-1]]))[0].astype(mx.float32)
            mine = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    finally:
        student.close()
    assert student.candidates == m and mine.shape == served.shape
    np.testing.assert_allclose(mine, served, atol=2e-3)
    assert np.abs(mine - other).max() > 1e-2


@pytest.mark.parametrize("candidates", [0, 3, 17])
def test_candidates_out_of_range_are_refused(phase, tmp_path, candidates):
    """Outside [K, E] (K = 4, E = 16 here), 0 included: one message naming the flag, nothing written."""
    with pytest.raises(Edge0Error, match=f"--candidates {candidates}: must be between K = 4 and the model's 16"):
        lora(phase, tmp_path / "a.safetensors", candidates=candidates)
    assert not (tmp_path / "a.safetensors").exists()


def test_merge_measures_the_projections_and_keeps_the_blocks_branches(phase):
    """`edge0 train merge` on an adapter with a branch beside each MoE block: the branches have no weight to
    merge into, so the weight-level figures are the projections' alone, and the merged model keeps its branches."""
    from edge0.model.heads import model_fingerprint
    from edge0.model.load import load_store
    from edge0.model.lora import heads_fingerprint
    from edge0.train.merge import merge_survival

    store, _, _ = phase
    m, config = read_manifest(store), read_config(store)
    s = load_store(store)
    try:
        a = Adapter.create(s.model, rank=4, alpha=8.0, fingerprint=model_fingerprint(m, config),
                           heads=heads_fingerprint(store / f"heads-k{m.top_k}.safetensors"), top_k=m.top_k)
    finally:
        s.close()
    layers = config["num_hidden_layers"]
    assert a.kinds() == {"attention": 4 * layers, "moe_block": layers}
    a.weights = {k: (w_a, mx.random.normal(w_b.shape, key=mx.random.key(3))) for k, (w_a, w_b) in a.weights.items()}
    a.save(store.parent / "merge.safetensors")
    r = merge_survival(store, store.parent / "merge.safetensors", windows=1, seq_len=32)
    assert set(r["weights"]) == {"attention"} and r["weights"]["attention"]["projections"] == 4 * layers
    assert -1.0 < r["logits"] < 1.0 and r["windows"] == 1
