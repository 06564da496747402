"""edge0 train base: the corpus split, the training forward, end to end on the tiny preset, resume, determinism."""

import json

import mlx.core as mx
import numpy as np
import pytest

from edge0.errors import Edge0Error
from edge0.train import base
from edge0.train.corpus import is_heldout, prepare_corpus, split_files, stdlib_files

STEPS = 6


def test_corpus_split_is_deterministic_and_excludes_tests(tmp_path):
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any(part in ("test", "tests", "idle_test", "site-packages") for f in files for part in f.split("/"))
    train, heldout = split_files(files)
    assert set(train).isdisjoint(heldout) and len(train) + len(heldout) == len(files)
    assert 0.01 < len(heldout) / len(files) < 0.15
    assert all(is_heldout(f) for f in heldout)
    a = prepare_corpus(tmp_path / "d", vocab_size=512, max_files=8)
    b = prepare_corpus(tmp_path / "d", vocab_size=512, max_files=8)  # from the cache
    assert np.array_equal(a.train, b.train) and np.array_equal(a.heldout, b.heldout)
    assert a.train.dtype == np.uint16 and a.train.max() < 512 and a.heldout.size > 0


def test_training_forward_is_mlx_lms_forward():
    """forward_with_aux walks the modules as mlx-lm's __call__ does: same logits; aux is 1 when balanced."""
    p = base.PRESETS["tiny"]
    model = base.build_model(base.model_config(p), seed=0)
    x = mx.array(np.random.default_rng(0).integers(0, p.vocab, (2, 16)))
    logits, aux = base.forward_with_aux(model, x)
    assert np.allclose(np.array(logits), np.array(model(x)), atol=1e-5)
    assert 1.0 <= aux.item() < p.experts / p.top_k


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "full"
    summary = base.train_base(out, preset="tiny", steps=STEPS, seed=3, progress=False)
    return out, summary


def test_end_to_end_exports_loadable_fp_and_store(full_run):
    from mlx_lm import load

    from edge0.model.load import load_store

    out, summary = full_run
    assert summary["steps"] == STEPS and summary["tokens"] == STEPS * 4 * 32
    assert np.isfinite(summary["heldout_loss"])
    model, tok = load(str(out / "fp"))
    assert model.args.num_experts == base.PRESETS["tiny"].experts
    s = load_store(out / "store")
    ids = tok.encode("def f(x):\n    return x")
    a, b = s.model(mx.array([ids])), model(mx.array([ids]))
    assert a.shape == b.shape
    s.close()
    log = base.read_log(out)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert log[-1]["loss"] < log[0]["loss"] + 0.5


def test_resume_reproduces_the_uninterrupted_curve(full_run, tmp_path):
    out, _ = full_run
    want = [(r["step"], r["loss"], r.get("heldout_loss")) for r in base.read_log(out)]
    part = tmp_path / "part"
    base.train_base(part, preset="tiny", steps=STEPS, seed=3, stop_at=4, progress=False)
    assert base.latest_checkpoint(part / "ckpt") == 4 and not (part / "store").exists()
    with pytest.raises(Edge0Error, match="--resume"):
        base.train_base(part, preset="tiny", steps=STEPS, seed=3, progress=False)
    with pytest.raises(Edge0Error, match="seed"):
        base.train_base(part, preset="tiny", steps=STEPS, seed=4, resume=True, progress=False)
    base.train_base(part, preset="tiny", steps=STEPS, seed=3, resume=True, export=False, progress=False)
    got = [(r["step"], r["loss"], r.get("heldout_loss")) for r in base.read_log(part)]
    assert got == want
    ckpt = json.loads((part / "ckpt" / f"step_{STEPS}.json").read_text())
    assert ckpt["step"] == STEPS and ckpt["tokens"] == STEPS * 4 * 32


def test_same_seed_same_curve_other_seed_not(full_run, tmp_path):
    out, _ = full_run
    want = [r["loss"] for r in base.read_log(out)][:3]
    base.train_base(tmp_path / "a", preset="tiny", steps=STEPS, seed=3, stop_at=3, progress=False)
    base.train_base(tmp_path / "b", preset="tiny", steps=STEPS, seed=5, stop_at=3, progress=False)
    assert [r["loss"] for r in base.read_log(tmp_path / "a")] == want
    assert [r["loss"] for r in base.read_log(tmp_path / "b")] != want


def test_cli_flags_and_bad_preset(tmp_path, capsys):
    import argparse

    p = argparse.ArgumentParser()
    base.add_train_base_flags(p)
    args = p.parse_args(["--out", str(tmp_path / "c"), "--preset", "tiny", "--steps", "2", "--no-export", "--json"])
    assert base.train_base_cli(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and "store" not in summary
    with pytest.raises(Edge0Error, match="preset"):
        base.train_base(tmp_path / "d", preset="huge")
