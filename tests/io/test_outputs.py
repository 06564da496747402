"""No command writes into what it reads, and --force (or --resume, or a plot or trace drawn again) replaces
only an earlier output of the same kind: each refusal is one line naming the path, and what was there is
byte for byte what it was."""

import hashlib
import os
import shutil

import pytest

from edge0.cli import main
from edge0.io.verify import verify_store
from edge0.bench.workload import hidden_of
from edge0.io.manifest import read_manifest


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("edge0: error")]
    assert "Traceback" not in err and len(lines) == (code == 2), err
    return code, lines[0].removeprefix("edge0: error: ") if lines else ""


def digest(root):
    """Every file under root (or root itself) -> its sha256: what a refusal must leave as it was."""
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


@pytest.fixture
def store(models, tmp_path):
    """A private copy of a tiny store (the session's own is shared)."""
    return shutil.copytree(models("qwen3_moe"), tmp_path / "store")


def test_export_gguf_never_writes_into_its_store(store, tmp_path, capsys):
    before = digest(store)
    (tmp_path / "link.gguf").symlink_to(store / "config.json")
    for out, force in ((store / "resident.safetensors", ["--force"]), (store / "m.gguf", []),
                       (tmp_path / "link.gguf", ["--force"])):
        code, line = cli(capsys, "export-gguf", "--quiet", *force, store, out)
        assert (code, line) == (2, f"{out}: OUT is inside STORE {store}; write outside it")
    assert digest(store) == before and verify_store(store).problems == []


def test_convert_force_replaces_only_a_store(models, tmp_path, capsys):
    src = models("qwen3_moe", "mlx", "src")
    checkpoint = shutil.copytree(src, tmp_path / "checkpoint")  # a make-model output, not a store
    mine = tmp_path / "mine.txt"
    mine.write_text("mine")
    for out, why in ((checkpoint, "exists, is not empty and is not an Edge0 store (no edge0.json)"),
                     (mine, "exists and is not a directory")):
        before = digest(out)
        code, line = cli(capsys, "convert", "--quiet", "--force", src, out)
        assert code == 2 and line.startswith(f"{out}: {why}"), line
        assert digest(out) == before


def test_make_model_force_never_replaces_a_store(store, capsys):
    before = digest(store)
    code, line = cli(capsys, "make-model", "--arch", "qwen3_moe", "--force", store)
    assert code == 2 and line.startswith(f"{store}: exists, is not empty and is not a make-model checkpoint "
                                         "(no edge0-make-model.json)"), line
    assert digest(store) == before


def test_make_workload_never_replaces_its_base(store, tmp_path, capsys):
    before = digest(store)
    width = 2 * hidden_of(read_manifest(store))
    (tmp_path / "link").symlink_to(store)
    for out, line in ((store, f"{store}: OUT must differ from --base {store}"),
                      (tmp_path / "link", f"{tmp_path / 'link'}: OUT must differ from --base {store}"),
                      (store / "wide", f"{store / 'wide'}: OUT is inside --base {store}; write outside it")):
        code, said = cli(capsys, "make-workload", "--quiet", "--force", "--base", store, "--expert-width", width,
                         "--heads-steps", 1, out)
        assert code == 2 and said.startswith(line), said
    assert digest(store) == before


def test_train_outputs_never_overwrite_a_store_file_or_an_input(store, tmp_path, capsys):
    text = tmp_path / "text.py"
    text.write_text("def f(x):\n    return x\n" * 50)
    resident = store / "resident.safetensors"
    before = digest(store), digest(text)
    heads = ["train", "heads", "--model", store, "--steps", 1, "--resume"]
    code, line = cli(capsys, *heads, "--out", resident)
    assert code == 2 and line.startswith(f"{resident}: exists and is not an edge0-heads-1 file; --resume continues "
                                         "only this command's own output"), line
    code, line = cli(capsys, *heads, "--out", text, "--data", text)
    assert code == 2 and line.startswith(f"{text}: --out must differ from --data {text}"), line
    code, line = cli(capsys, *heads, "--out", store / "config")  # its report would be config.json
    assert code == 2 and line.startswith(f"{store / 'config.json'}: exists beside no config, so it is no report"), line
    ckpt = tmp_path / "h.ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("mine")
    code, line = cli(capsys, "train", "heads", "--model", store, "--steps", 1, "--out", tmp_path / "h.safetensors")
    assert code == 2 and line == (f"{ckpt}: holds notes.txt, which a training checkpoint does not write; move it "
                                  "away or choose another --out"), line
    adapter = tmp_path / "a.safetensors"
    adapter.write_bytes(b"an adapter")
    code, line = cli(capsys, "train", "lora", "--model", store, "--steps", 1, "--resume", "--init", adapter,
                     "--out", adapter)
    assert code == 2 and line.startswith(f"{adapter}: --out must differ from --init {adapter}"), line
    (tmp_path / "b.safetensors.data").write_text("a file where the teacher's cache goes")
    code, line = cli(capsys, "train", "lora", "--model", store, "--steps", 1, "--out", tmp_path / "b.safetensors")
    assert code == 2 and line.startswith(f"{tmp_path / 'b.safetensors.data'}: exists and is not a directory"), line
    assert (digest(store), digest(text)) == before and (ckpt / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where,name", [(".", "notes.txt"), ("data", "train.txt"), ("ckpt", "step_1.txt")])
def test_train_base_writes_only_into_a_run_directory(tmp_path, capsys, where, name):
    out = tmp_path / "run"
    (out / where).mkdir(parents=True, exist_ok=True)
    (out / where / name).write_text("mine")
    code, line = cli(capsys, "train", "base", "--preset", "tiny", "--steps", 1, "--out", out)
    assert code == 2 and line == (f"{(out / where) if where != '.' else out}: holds {name}, which `edge0 train base` "
                                  "does not write; move it away or choose another --out"), line
    assert (out / where / name).read_text() == "mine" and [p.name for p in out.iterdir()] == [
        name if where == "." else where]


def test_trace_plot_is_no_input_and_replaces_only_a_plot(tmp_path, capsys):
    trace = tmp_path / "t.png"  # a trace, whatever its name
    assert main(["run", "--prompt", "def f(x):", "--max-tokens", "4", "--json", "--trace", str(trace)]) == 0
    capsys.readouterr()
    before = digest(trace)
    code, line = cli(capsys, "trace", "summarize", trace, "--plot", trace)
    assert code == 2 and line.startswith(f"{trace}: --plot must differ from FILE {trace}"), line
    code, line = cli(capsys, "trace", "summarize", trace, "--plot", tmp_path / "p.xyz")
    assert (code, line) == (2, f"--plot {tmp_path / 'p.xyz'}: '.xyz' is not a format it draws; name a .png, .svg or "
                               ".pdf file")
    notes = tmp_path / "notes.png"
    notes.write_text("mine")
    code, line = cli(capsys, "trace", "summarize", trace, "--plot", notes)
    assert code == 2 and line.startswith(f"{notes}: exists and is not a PNG image (no PNG header)"), line
    assert notes.read_text() == "mine" and digest(trace) == before
    plot = tmp_path / "p.svg"
    for _ in range(2):  # an earlier plot is drawn again
        assert cli(capsys, "trace", "summarize", trace, "--plot", plot)[0] == 0
        assert plot.read_bytes().startswith(b"<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.png", "p.svg", "t.png"]


def test_run_trace_is_no_input_and_replaces_only_a_trace(store, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):")
    notes = tmp_path / "notes.json"
    notes.write_text("{}")
    before = digest(store), digest(prompt)
    run = ["run", "--model", store, "--max-tokens", "2", "--json"]
    for trace, flags, why in ((store / "t.json", [], f"--trace is inside --model {store}; write outside it"),
                              (prompt, ["--prompt-file", prompt], f"--trace must differ from --prompt-file {prompt}"),
                              (notes, [], "exists and is not a trace (no traceEvents)")):
        code, line = cli(capsys, *run, *flags, "--trace", trace)
        assert code == 2 and line.startswith(f"{trace}: {why}"), line
    assert (digest(store), digest(prompt)) == before and notes.read_text() == "{}"


@pytest.mark.parametrize("flags", [["--arms", "exact", "--store"], ["--serve", "--model"]])
def test_bench_results_never_go_into_the_store(store, capsys, flags):
    before = digest(store)
    code, line = cli(capsys, "bench", *flags, store, "--out", store / "results")
    assert code == 2 and line == f"{store / 'results'}: --out is inside {flags[-1]} {store}; write outside it", line
    assert digest(store) == before and not (store / "results").exists()
