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
                           "--arms", "mlx-lm:f32,exact,staged,prefetch:next-router,prefetch:next-router/1+never",
                           "--cache", "warm", "--rounds", "1",
                           "--max-tokens", "6", "--prompt-tokens", "24", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.iterdir()
    results = json.loads((out / "results.json").read_text())
    replay = json.loads((out / "replay.json").read_text())
    assert len(replay["prompt"]) == 24 and len(replay["tokens"]) == 6
    assert set(results["median"]) == {"mlx-lm:f32/warm", "exact/warm", "staged/warm", "prefetch:next-router/warm",
                                      "prefetch:next-router/1+never/warm"}
    for key, runs in results["runs"].items():
        assert runs[0]["tokens"] == replay["tokens"], key  # forced decoding: identical work
    never = results["runs"]["prefetch:next-router/1+never/warm"][0]  # ARM+MODE: --read-ahead MODE
    assert never["read_ahead"]["ahead"] is False and never["paused_steps"] == len(replay["tokens"])
    assert results["meta"]["cores"] >= 1 and "BLAS" in results["meta"]["blas"]  # what was measured on
    assert "| staged | float32 |" in (out / "results.md").read_text()


def test_bench_with_no_model_flags_runs_the_built_in_model(tmp_path):
    """`edge0 bench` as a user first types it: mlx-lm (in float32: MLX's CPU has no bf16 expert product) on the
    bf16 checkpoint the built-in store was converted from, against Edge0 as `edge0 run` runs that store (every
    expert resident, native and predicted routing); the default arms needed --source and --store before."""
    from edge0.model.demo import DEMO_FP, DEMO_STORE

    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "bench", "--rounds", "1", "--max-tokens", "4",
                           "--prompt-tokens", "16", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.iterdir()
    results = json.loads((out / "results.json").read_text())
    assert set(results["median"]) == {"mlx-lm:f32/warm", "resident/warm", "predicted:resident/warm"}
    assert (results["meta"]["store"], results["meta"]["source"]) == (str(DEMO_STORE), str(DEMO_FP))


def test_bench_refuses_unknown_arms(capsys, tmp_path):
    assert main(["bench", "--store", str(tmp_path), "--arms", "warp-drive"]) == 2
    assert "unknown arm 'warp-drive'" in capsys.readouterr().err
    assert main(["bench", "--store", str(tmp_path), "--arms", "staged/2"]) == 2  # guesses only on prefetch arms
    assert "unknown arm 'staged/2'" in capsys.readouterr().err
    for bad in ("prefetch:heads/0", "prefetch:heads/two"):
        assert main(["bench", "--store", str(tmp_path), "--arms", bad]) == 2
        assert f"--arms {bad}: a prefetch arm's /N" in capsys.readouterr().err
    for bad in ("staged+never", "predicted:resident+never", "prefetch:heads+sometimes"):  # +MODE: --read-ahead
        assert main(["bench", "--store", str(tmp_path), "--arms", bad]) == 2
        assert f"--arms {bad}: +MODE is --read-ahead's measured, always, never" in capsys.readouterr().err


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
    assert main(["bench", "--store", str(tmp_path), "--arms", "llama.cpp:no-mmap", "--out", str(tmp_path)]) == 2
    assert "needs --gguf FILE" in capsys.readouterr().err
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


def _cgroups_or_skip():
    from edge0.bench.cap import MemoryCap
    from edge0.errors import Edge0Error

    try:
        return MemoryCap(None)
    except Edge0Error as e:
        pytest.skip(f"no memory cgroup can be made here: {e}")


BENCH_PIDS = []  # the bench processes _bench ran (their arms' cgroups are named after them)


def _bench(store, out, *flags):
    with subprocess.Popen([sys.executable, "-m", "edge0.cli", "bench", "--store", str(store), "--arms", "staged",
                           "--rounds", "1", "--max-tokens", "4", "--prompt-tokens", "16", "--out", str(out), *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        BENCH_PIDS.append(proc.pid)
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:  # killed, as subprocess.run does (leaving the block waits for it)
            proc.kill()
            raise
    assert proc.returncode == 0, err
    (res,) = out.iterdir()
    return json.loads((res / "results.json").read_text()), (res / "results.md").read_text()


def test_bench_memory_cap_runs_every_arm_in_a_cgroup_and_a_killed_arm_is_a_row(models, tmp_path):
    """A cap the arm fits in: its cgroup peak is measured and under the cap; a cap it cannot fit in (48 MiB,
    below what Python and MLX take): the row says it was killed, and the bench still finishes."""
    cap = _cgroups_or_skip()
    store = models("qwen3_moe")
    BENCH_PIDS.clear()
    results, md = _bench(store, tmp_path / "fits", "--memory-cap", "4", "--cache", "cold,warm")
    for key in ("staged/cold", "staged/warm"):
        (run,) = results["runs"][key]
        assert "killed" not in run and 0.01 < run["peak_cgroup_gib"] < 4, key
        assert run["major_faults"] >= 0 and run["disk_read_bytes"] >= 0
    assert results["meta"]["memory_cap_gib"] == 4 and "every arm in a memory cgroup of 4 GiB" in md
    results, md = _bench(store, tmp_path / "killed", "--memory-cap", "0.046875")
    (run,) = results["runs"]["staged/warm"]
    assert run["killed"] == "out of memory at 0.046875 GiB"
    assert "| staged | - | - | - | warm | killed: out of memory at 0.046875 GiB |" in md
    # every run's cgroup removed (its own: another worker's bench may hold one now)
    assert len(BENCH_PIDS) == 2 and not [g for pid in BENCH_PIDS for g in cap.parent.glob(f"edge0-bench-{pid}-*")]


def test_a_terminated_capped_bench_leaves_no_cgroup_and_no_arm(models, tmp_path):
    """SIGTERM while an arm runs in its cgroup: the arm is killed and the cgroup removed (a killed bench left
    both behind, and the leftover cgroup then failed the test above)."""
    import signal
    import time

    cap = _cgroups_or_skip()
    store = models("qwen3_moe")
    proc = subprocess.Popen([sys.executable, "-m", "edge0.cli", "bench", "--store", str(store), "--arms", "staged",
                             "--rounds", "3", "--max-tokens", "64", "--prompt-tokens", "16", "--memory-cap", "4",
                             "--out", str(tmp_path / "out")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    mine = f"edge0-bench-{proc.pid}-*"

    def inside() -> list[str]:
        """The processes of an arm's cgroup, once one has any."""
        for group in cap.parent.glob(mine):
            try:
                pids = (group / "cgroup.procs").read_text().split()
            except FileNotFoundError:  # that arm ended and its cgroup went between the glob and the read
                continue
            if pids:
                return pids
        return []

    deadline = time.monotonic() + 120
    while not (arms := inside()):
        assert proc.poll() is None and time.monotonic() < deadline, "no arm ran in a cgroup"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and b"Traceback" not in err, err.decode()[-2000:]
    assert not list(cap.parent.glob(mine))
    assert not [pid for pid in arms if Path(f"/proc/{pid}").exists()]


def test_bench_memory_cap_refused_in_one_line(models, tmp_path, capsys, monkeypatch):
    argv = ["bench", "--store", str(models("qwen3_moe")), "--arms", "staged", "--out", str(tmp_path / "out")]
    assert main(argv + ["--memory-cap", "-1"]) == 2
    assert "--memory-cap -1: must be GiB more than 0, or none" in capsys.readouterr().err
    import edge0.bench.cap as bench_cap

    monkeypatch.setattr(bench_cap, "own_memory_cgroup", lambda: (tmp_path / "no-such-cgroup", False))
    assert main(argv + ["--memory-cap", "8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot create a memory cgroup under" in err
    assert "systemd-run" in err and not (tmp_path / "out").exists()


def test_bench_replays_a_given_file(models, tmp_path):
    replay = tmp_path / "given.json"
    replay.write_text(json.dumps({"prompt": [5, 6, 7, 8, 9, 10], "tokens": [11, 12, 13]}))
    results, _ = _bench(models("qwen3_moe"), tmp_path / "out", "--replay", str(replay))
    (run,) = results["runs"]["staged/warm"]
    assert run["tokens"] == [11, 12, 13] and run["prompt_tokens"] == 6
    assert results["meta"]["max_tokens"] == 3 and results["meta"]["prompt_tokens"] == 6


def test_bench_replays_real_text(models, tmp_path):
    """--replay-text: the prompt and the forced tokens are the text's ids, in order, in every arm."""
    from mlx_lm.utils import load_tokenizer

    store = models("qwen3_moe")
    text = tmp_path / "text.py"
    text.write_text(Path(json.__file__).read_text())
    ids = load_tokenizer(store).encode(text.read_text())
    results, _ = _bench(store, tmp_path / "out", "--replay-text", str(text), "--prompt-tokens", "12",
                        "--max-tokens", "5")
    (run,) = results["runs"]["staged/warm"]
    assert run["tokens"] == ids[12:17] and run["prompt_tokens"] == 12


def test_bench_refuses_a_short_replay_text_before_writing(models, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("x = 1")
    argv = ["bench", "--store", str(models("qwen3_moe")), "--arms", "staged", "--out", str(tmp_path / "out"),
            "--replay-text", str(text)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--replay-text {text}: " in err and "fewer than --prompt-tokens" in err and "Traceback" not in err
    assert main(argv[:-1] + [str(tmp_path / "missing.txt")]) == 2
    assert "cannot be read as text" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_memory_cap_leaves_auto_less_room(tmp_path):
    """Inside a capped cgroup (v1 or v2, as bench --memory-cap makes them) the room --executor auto sizes its
    choice by is at most the cap, whatever the machine has free."""
    from edge0.bench.cap import MemoryCap

    _cgroups_or_skip()
    probe = ("from edge0.io.cgroup import memory_room; from edge0.compute.runtime import available_memory; "
             "print(memory_room(), available_memory())")
    run = MemoryCap(0.5).run([sys.executable, "-c", probe])
    assert run.returncode == 0, run.stderr
    room, available = map(int, run.stdout.split())
    assert 0 < room < 2**29 and available <= room


def test_the_adapter_pairs_differ_only_by_the_adapter():
    """Each arm without the adapter is its partner's flags plus --lora none (what the adapter costs is their ratio)."""
    from edge0.bench.arms import ARMS, arm_flags

    for arm in ("predicted", "predicted:resident"):
        assert f"{arm}:no-lora" in ARMS
        assert arm_flags(f"{arm}:no-lora") == arm_flags(arm) + ["--lora", "none"]


def test_bench_slots_size_the_streamed_arms_banks_alone(models, tmp_path, capsys):
    """--slots S reaches the arms that stream through staged banks and no other; out of [K, E] or with no such
    arm it is refused before anything is written."""
    store = models("qwen3_moe")
    results, _ = _bench(store, tmp_path / "out", "--arms", "staged,exact", "--slots", "6")
    assert results["meta"]["slots"] == 6
    assert results["runs"]["staged/warm"][0]["slots"] == 6 and results["runs"]["exact/warm"][0]["slots"] is None
    for bad, message in (("1", "--slots 1: a staged bank holds between K = 4 and the model's 16 experts"), ("99", "--slots 99: "),
                         ("4 --arms exact", "--slots 4: no arm streams through staged banks")):
        argv = ["bench", "--store", str(store), "--arms", "staged", "--out", str(tmp_path / "bad"), "--slots", *bad.split()]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()


def test_the_pipeline_limit_takes_the_resident_floor_only_at_the_arms_threads():
    """An arm's limit is max(the resident arm's step, its reads) where the resident arm ran on its threads; without
    --threads each arm runs on its engine's default (on 2 cores the resident arm on 2, streamed arms on 1), and a floor
    of other threads gives no limit."""
    from edge0.bench.table import summarize

    def run(tok_s, threads, loads=0.0):
        return {"decode_tok_s": tok_s, "dtype": "float32", "kernel": "edge0", "threads": threads,
                "loads_per_step": loads, "load_cold_fraction": 1.0}

    cost = {"cold_ms": 1.0, "warm_ms": 0.5}
    same = summarize({"resident/cold": [run(100.0, 1)], "native/cold": [run(50.0, 1, loads=12.0)]}, cost)
    assert same["native/cold"]["limit_ms_per_step"] == 12.0 and same["native/cold"]["compute_ms_per_step"] == 10.0
    other = summarize({"resident/cold": [run(100.0, 2)], "native/cold": [run(50.0, 1, loads=4.0)]}, cost)
    assert "limit_ms_per_step" not in other["native/cold"] and other["resident/cold"]["limit_ms_per_step"] == 10.0
