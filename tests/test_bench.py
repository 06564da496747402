"""edge0 bench: every arm replays the same tokens, results are written, bad arms are refused."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge0.cli import main


def test_bench_replays_the_same_work_in_every_arm(models, tmp_path):
    src, store = models("qwen3_moe", "mlx", "src"), models("qwen3_moe")
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "bench", "--source", str(src), "--store", str(store),
                           "--arms", "mlx-lm:f32,exact,staged,prefetch:next-router", "--cache", "warm", "--rounds", "1",
                           "--max-tokens", "6", "--prompt-tokens", "24", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.iterdir()
    results = json.loads((out / "results.json").read_text())
    replay = json.loads((out / "replay.json").read_text())
    assert len(replay["prompt"]) == 24 and len(replay["tokens"]) == 6
    assert set(results["median"]) == {"mlx-lm:f32/warm", "exact/warm", "staged/warm", "prefetch:next-router/warm"}
    for key, runs in results["runs"].items():
        assert runs[0]["tokens"] == replay["tokens"], key  # forced decoding: identical work
    assert results["meta"]["cores"] >= 1 and "BLAS" in results["meta"]["blas"]  # what was measured on
    assert "| staged | float32 |" in (out / "results.md").read_text()


def test_bench_refuses_unknown_arms(capsys, tmp_path):
    assert main(["bench", "--store", str(tmp_path), "--arms", "warp-drive"]) == 2
    assert "unknown arm 'warp-drive'" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--arms", ","], "name at least one each"),  # was a ZeroDivisionError after the replay was recorded
    (["--prompt-tokens", "0"], "--prompt-tokens 0: must be at least 1"),
    (["--rounds", "0"], "--rounds 0: must be at least 1"),
    (["--store", "NOSTORE"], "no such model directory"),  # was a tokenizer traceback and an empty results dir
])
def test_bench_refuses_bad_flags_before_writing(capsys, tmp_path, models, flags, message):
    argv = ["bench", "--store", str(models("qwen3_moe")), "--arms", "exact", "--out", str(tmp_path / "out"), *flags]
    assert main([str(tmp_path / "none") if a == "NOSTORE" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_bench_refuses_the_llama_arm_without_a_gguf(capsys, tmp_path):
    assert main(["bench", "--store", str(tmp_path), "--arms", "staged,llama.cpp", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--arms llama.cpp: needs --gguf FILE" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "--store", str(tmp_path), "--arms", "llama.cpp", "--gguf", str(tmp_path / "none.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["bench", "--store", str(tmp_path), "--arms", "llama.cpp@edge0"]) == 2
    assert "unknown arm 'llama.cpp@edge0'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_bench_refuses_the_llama_arm_without_llama_cpp(capsys, tmp_path):
    """A --llama-python that cannot import llama_cpp (here one that says so; in CI also the default)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'llama_cpp'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    argv = ["bench", "--store", str(tmp_path), "--arms", "llama.cpp", "--gguf", str(gguf), "--out", str(tmp_path / "o")]
    assert main(argv + ["--llama-python", str(fake)]) == 2
    err = capsys.readouterr().err
    assert f"{fake} cannot import llama_cpp (ModuleNotFoundError: No module named 'llama_cpp')" in err
    assert "tools/llama_cpp_setup.py" in err and len(err.strip().splitlines()) == 1
    assert main(argv + ["--llama-python", str(tmp_path / "nowhere")]) == 2
    assert "--llama-python" in capsys.readouterr().err
    if importlib.util.find_spec("llama_cpp") is None:  # the default interpreter: this one
        assert main(argv) == 2
        assert f"{sys.executable} cannot import llama_cpp" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not os.environ.get("EDGE0_LLAMA_PYTHON") or not os.environ.get("EDGE0_LLAMA_SDIST"),
                    reason="set EDGE0_LLAMA_PYTHON (a venv python with llama_cpp) and EDGE0_LLAMA_SDIST "
                           "(the llama-cpp-python sdist) to run the llama.cpp arm")
def test_bench_llama_arm_replays_the_same_tokens(models, tmp_path):
    """The real arm on the tiny model, converted by tools/llama_cpp_setup.py (needs its venv; never in CI)."""
    src, store = models("qwen3_moe", "hf", "src"), models("qwen3_moe", "hf")
    py = os.environ["EDGE0_LLAMA_PYTHON"]
    tool = Path(__file__).parents[1] / "tools" / "llama_cpp_setup.py"
    subprocess.run([sys.executable, str(tool), str(src), "--sdist", os.environ["EDGE0_LLAMA_SDIST"],
                    "--venv", str(Path(py).parents[1]), "--out", str(tmp_path / "gguf"), "--outtype", "f32",
                    "--quant", "Q4_0"], check=True, capture_output=True, timeout=600)
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "bench", "--store", str(store), "--arms",
                           "exact,llama.cpp", "--gguf", str(tmp_path / "gguf" / "model-Q4_0.gguf"), "--llama-python",
                           py, "--threads", "1", "--rounds", "1", "--max-tokens", "6", "--prompt-tokens", "24",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (out,) = (tmp_path / "out").iterdir()
    results = json.loads((out / "results.json").read_text())
    replay = json.loads((out / "replay.json").read_text())
    (run,) = results["runs"]["llama.cpp/warm"]
    assert run["tokens"] == replay["tokens"] and run["threads"] == 1 and run["decode_tok_s"] > 0
    assert "| llama.cpp | float32 | llama.cpp Q4_0 | 1 | warm |" in (out / "results.md").read_text()
