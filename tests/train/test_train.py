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
    assert a.train.dtype == np.uint32 and a.train.max() < 512 and a.heldout.size > 0


def test_token_streams_keep_ids_past_uint16(tmp_path):
    """Vocabularies over 65536 (Qwen3: 151k) must not wrap."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from edge0.train.corpus import encode_files

    tok = Tokenizer(models.WordLevel({"a": 70000, "b": 3, "<|endoftext|>": 100000, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "f.py").write_text("a b a")
    assert encode_files(tok.to_str(), tmp_path, ["f.py"]).tolist() == [70000, 3, 70000, 100000]


def test_npy_token_ids_are_checked(tmp_path):
    from edge0.train.corpus import heldout_stream

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    (model / "tokenizer.json").write_text("{}")  # not needed for ids
    good = tmp_path / "good.npy"
    np.save(good, np.array([0, 70000, 151935], dtype=np.int64))
    assert heldout_stream(model, good).tolist() == [0, 70000, 151935]
    for name, arr, why in [
        ("big.npy", np.array([1, 151936]), "151936 is out of range"),
        ("neg.npy", np.array([3, -5]), "-5 is out of range"),
        ("float.npy", np.array([1.5, 2.0]), "integers"),
        ("obj.npy", np.array([{"a": 1}], dtype=object), "not a .npy array of token ids"),
    ]:
        path = tmp_path / name
        np.save(path, arr, allow_pickle=True)
        with pytest.raises(Edge0Error, match=name) as e:
            heldout_stream(model, path)
        assert why in str(e.value)
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not numpy")
    with pytest.raises(Edge0Error, match="junk.npy"):
        heldout_stream(model, junk)


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
    from edge0.cli import build_parser, dispatch

    args = build_parser().parse_args(["train", "base", "--out", str(tmp_path / "c"), "--preset", "tiny", "--steps", "2",
                                      "--no-export", "--json"])
    assert dispatch(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and "store" not in summary
    with pytest.raises(Edge0Error, match="preset"):
        base.train_base(tmp_path / "d", preset="huge")


def test_bad_steps_and_existing_exports_are_refused(tmp_path):
    for steps in (0, -3):
        with pytest.raises(Edge0Error, match=f"--steps {steps}"):
            base.train_base(tmp_path / "s", preset="tiny", steps=steps, progress=False)
    for name in ("fp", "store"):
        out = tmp_path / name
        (out / name).mkdir(parents=True)
        (out / name / "mine.txt").write_text("user data")
        with pytest.raises(Edge0Error, match=str(out / name)):
            base.train_base(out, preset="tiny", steps=1, progress=False)
        assert (out / name / "mine.txt").read_text() == "user data"  # nothing overwritten
        assert not (out / "ckpt").exists()  # refused before training


def test_heads_flags_checked_before_training(models, tmp_path):
    from edge0.train.head_phase import train_heads

    store = models("qwen3_moe")
    kw = dict(hidden=16, eval_windows=1, progress=False, seq_len=64)
    with pytest.raises(Edge0Error, match="does not exist"):
        train_heads(store, tmp_path / "no" / "h.safetensors", steps=1, **kw)
    with pytest.raises(Edge0Error, match="--steps 0"):
        train_heads(store, tmp_path / "h.safetensors", steps=0, **kw)
    report = tmp_path / "h.safetensors.json"
    report.write_text("mine")
    with pytest.raises(Edge0Error, match="h.safetensors.json"):
        train_heads(store, tmp_path / "h.safetensors", steps=1, **kw)
    assert report.read_text() == "mine" and not (tmp_path / "h.safetensors").exists()


def test_heads_resume_with_other_flags_is_one_message(models, tmp_path):
    from edge0.train.head_phase import train_heads

    store = models("qwen3_moe")
    out = tmp_path / "h.safetensors"
    text = tmp_path / "t.py"  # a small corpus: the stdlib split would be tokenized five times over
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    kw = dict(eval_windows=1, progress=False, seq_len=64, data=text, heldout=text)
    train_heads(store, out, steps=2, hidden=16, seed=1, **kw)
    assert json.loads(out.with_suffix(".ckpt").joinpath("state.json").read_text())["hidden"] == 16
    for flags, what in (({"hidden": 32, "seed": 1}, "--hidden 16"), ({"hidden": 16, "seed": 2}, "--seed 1"),
                        ({"hidden": 16, "seed": 1, "top_k": 1}, "--k")):
        with pytest.raises(Edge0Error, match=what):
            train_heads(store, out, steps=3, resume=True, **flags, **kw)
    assert len(train_heads(store, out, steps=3, hidden=16, seed=1, resume=True, **kw)["losses"]) == 1


def test_base_and_heads_run_data_parallel(models, tmp_path):
    """mlx.launch with two local ranks: train base takes half of each batch per rank and logs the one-process
    cross-entropy (the load-balancing term is per rank's share, so it differs a little); train heads fits one
    window per rank per step; rank 0 alone writes."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    launch = [shutil.which("mlx.launch", path=str(Path(sys.executable).parent)), "-n", "2", "--backend", "ring", "--",
              sys.executable, "-m", "edge0.cli", "train"]
    flags = ["--preset", "tiny", "--steps", "3", "--no-export", "--json"]
    subprocess.run([sys.executable, "-m", "edge0.cli", "train", "base", "--out", str(tmp_path / "one"), *flags],
                   check=True, capture_output=True, timeout=600)
    proc = subprocess.run([*launch, "base", "--out", str(tmp_path / "two"), *flags], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    one, two = base.read_log(tmp_path / "one"), base.read_log(tmp_path / "two")
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    assert np.allclose([r["ce"] for r in two], [r["ce"] for r in one], rtol=1e-4)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["ranks"] == 2
    store = models("qwen3_moe")
    text = tmp_path / "t.py"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    out = tmp_path / "h.safetensors"
    proc = subprocess.run([*launch, "heads", "--model", str(store), "--out", str(out), "--data", str(text), "--heldout",
                           str(text), "--steps", "2", "--hidden", "16"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(Path(str(out) + ".json").read_text())["ranks"] == 2
