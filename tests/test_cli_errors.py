"""Bad command lines: each is refused before any model work with one line naming the flag, exit 2, no
traceback. In-process through the console script's own entry point (edge0.cli.main)."""

import io
import sys

import pytest

from edge0.cli import main

STORE = None  # the built-in model (each case is refused before it is loaded, or right after its manifest)

BAD = [  # (argv, what the one error line must contain)
    (["run", "--max-tokens", "0"], "--max-tokens 0: must be at least 1"),
    (["run", "--max-tokens", "-3"], "--max-tokens -3: must be at least 1"),
    (["run", "--temp", "inf"], "--temp inf: expected a finite number"),
    (["run", "--temp", "nan"], "--temp nan: expected a finite number"),
    (["run", "--temp", "-1"], "--temp -1.0: must be at least 0"),
    (["run", "--temp", "7"], "--temp 7.0: must be at most 2"),
    (["run", "--top-p", "0"], "--top-p 0.0: must be more than 0"),
    (["run", "--top-p", "1.5"], "--top-p 1.5: must be at most 1"),
    (["run", "--seed", "-1"], "--seed -1: must be at least 0"),
    (["run", "--seed", str(2**64)], f"--seed {2**64}: must be at most"),
    (["run", "--slots", "0"], "--slots 0: must be at least 1"),
    (["run", "--slots", "100000"], "--slots 100000: at most the model's 32 experts"),
    (["run", "--k", "0"], "--k 0: must be at least 1"),
    (["run", "--k", "33"], "--k 33: must be between 1 and the model's 32 experts"),
    (["run", "--kernel-threads", "0"], "--kernel-threads 0: must be at least 1"),
    (["run", "--kernel-threads", "1000"], "--kernel-threads 1000: must be at most"),
    (["run", "--io-workers", "0"], "--io-workers 0: must be at least 1"),
    (["run", "--io-workers", "1000"], "--io-workers 1000: must be at most 64"),
    (["run", "--io-throttle", "-5"], "--io-throttle -5.0: must be more than 0"),
    (["run", "--io-throttle", "0"], "--io-throttle 0.0: must be more than 0"),
    (["run", "--io-throttle", "inf"], "--io-throttle inf: expected a finite number"),
    (["run", "--memory-budget", "-1"], "--memory-budget -1.0: must be at least 0"),
    (["run", "--memory-budget", "1e9"], "--memory-budget 1000000000.0: must be at most"),
    (["run", "--memory-budget", "nan"], "--memory-budget nan: expected a finite number"),
    (["run", "--model", "/nonexistent/store"], "/nonexistent/store: no such model directory"),
    (["run", "--replay", "/nonexistent/replay.json"], "--replay /nonexistent/replay.json: no such file"),
    (["run", "--routing", "native", "--heads", "/nowhere/h.safetensors"], "--heads: used with --routing predicted"),
    (["run", "--heads", "/nonexistent/heads.safetensors"], "/nonexistent/heads.safetensors"),
    (["run", "--executor", "hot", "--heads", "h.safetensors"], "with --executor auto, staged or resident, not hot"),
    (["run", "--routing", "native", "--predictor", "heads"], "--predictor heads: only used with --routing prefetch"),
    (["run", "--routing", "predicted", "--predictor", "repeat"], "--predictor repeat does not apply"),
    (["run", "--guesses", "0", "--routing", "prefetch"], "--guesses 0: must be at least 1"),
    (["run", "--guesses", "5", "--routing", "prefetch"], "--guesses 5: between 1 and K = 4"),
    (["run", "--guesses", "3", "--k", "2", "--routing", "prefetch"], "--guesses 3: between 1 and K = 2"),
    (["run", "--guesses", "2"], "--guesses 2: only used with --routing prefetch"),
    (["run", "--guesses", "2", "--routing", "native"], "--guesses 2: only used with --routing prefetch"),
    (["run", "--read-ahead", "always", "--routing", "native"], "--read-ahead always: only used with --routing prefetch or predicted"),
    (["run", "--routing", "prefetch", "--executor", "hot"], "--executor hot does not apply"),
    (["run", "--routing", "prefetch", "--predictor", "repeat", "--heads", "x"], "does not read heads"),
    (["run", "--trace", "/etc/hostname/sub/trace.json"], "--trace /etc/hostname/sub/trace.json: not a writable file path"),
    (["run", "--prompt", ""], "is empty"),
    (["run", "--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file /nonexistent/prompt.txt: no such file"),
    (["run", "--prompt", "x", "--prompt-file", "/etc/hostname"], "--prompt and --prompt-file: give one of them"),
    (["run", "--prompt-file", "/"], "--prompt-file /: a directory, not a file"),
    (["run", "--prompt", "ab\udcff"], "--prompt: not UTF-8 text (byte 2)"),  # argv's byte 0xff, as Python keeps it
    (["serve", "--port", "70000"], "--port 70000: must be between 0 and 65535"),
    (["serve", "--max-queue", "-1"], "--max-queue -1: must not be negative"),
    (["serve", "--temp", "inf"], "--temp inf: expected a finite number"),
    # checked once the model's context is known (the demo's 4096), as serve does (tests/serve/test_stop_and_limits.py)
    (["run", "--max-tokens", "4096"], "--max-tokens 4096: must be at most 4095"),
    (["chat", "--max-tokens", "4096"], "--max-tokens 4096: must be at most 4095"),
    (["chat", "--max-tokens", "0"], "--max-tokens 0: must be at least 1"),
    (["bench", "--store", "x", "--arms", "nonsense"], "--arms: unknown arm 'nonsense'"),
    (["bench", "--store", "x", "--arms", "prefetch:repeat/\u00b2"], "a prefetch arm's /N (guesses read ahead) is"),
    (["bench", "--store", "x", "--arms", "exact", "--rounds", "0"], "--rounds 0: must be at least 1"),
    (["bench", "--store", "x", "--arms", "exact", "--io-throttle", "0"],
     "--io-throttle 0.0: must be a finite number more than 0"),
    (["eval", "--max-tokens", "0"], "--max-tokens and --seq-len must be positive"),
    (["verify", "/nonexistent/store"], "/nonexistent/store: no such model directory"),
    (["run", "--lora", "/nonexistent/lora.safetensors"], "/nonexistent/lora.safetensors"),
]

ARGPARSE_BAD = [  # refused by argparse itself: usage and one error line, exit 2
    ["run", "--routing", "sideways"], ["run", "--executor", "fast"], ["run", "--io", "psychic"],
    ["run", "--kernel", "gpu"], ["run", "--dtype", "int3"], ["run", "--max-tokens", "many"],
    ["run", "--no-such-flag"], ["nosuchcommand"],
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_command_line_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("edge0: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", ARGPARSE_BAD, ids=[" ".join(a) for a in ARGPARSE_BAD])
def test_argparse_refusals(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err


def test_at_least_forty_bad_command_lines():
    assert len(BAD) + len(ARGPARSE_BAD) >= 40


@pytest.mark.parametrize("value", ["abc", "0", "-2", "\u00b2"])  # '²': str.isdigit() but not int()
def test_a_bad_kernel_threads_variable_is_one_line(value):
    """$EDGE0_KERNEL_THREADS is read when the edge0 kernels load (a fresh process that uses them)."""
    import os
    import subprocess
    import sys

    from edge0.compute import kernels

    if not kernels.available():
        pytest.skip(f"edge0 kernels: {kernels.reason()}")
    env = {**os.environ, "EDGE0_KERNEL": "edge0", "EDGE0_KERNEL_THREADS": value}
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "run", "--max-tokens", "1"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2 and f"EDGE0_KERNEL_THREADS={value}: expected a whole number" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_prompt_file_that_is_not_text_is_one_line(tmp_path, capsys):
    path = tmp_path / "prompt.bin"
    path.write_bytes(b"def f():\n\xff\xfe")
    assert main(["run", "--prompt-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"edge0: error: --prompt-file {path}: not UTF-8 text (byte 9)", err


def test_standard_input_that_is_not_text_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xc3\xa9 \xff")))
    assert main(["run", "--prompt", "-"]) == 2
    assert capsys.readouterr().err.strip() == "edge0: error: --prompt - (standard input): not UTF-8 text (byte 6)"



def test_the_library_names_settings_and_the_command_line_says_its_flags(capsys):
    """A combination EngineConfig refuses names its settings (the library knows no flags); `edge0 run` says the same
    line with the flags that give them."""
    from edge0.config import EngineConfig, IOConfig, RoutingConfig
    from edge0.engine import resolve
    from edge0.errors import SettingError

    with pytest.raises(SettingError) as e:
        resolve(EngineConfig(routing=RoutingConfig(mode="prefetch"), io=IOConfig(executor="hot")))
    assert str(e.value) == "routing.mode prefetch fills staged slot banks; io.executor hot does not apply"
    with pytest.raises(SettingError, match=r"^routing.top_k 0: must be at least 1$"):
        EngineConfig(routing=RoutingConfig(top_k=0)).check()
    assert main(["run", "--routing", "prefetch", "--executor", "hot"]) == 2
    assert capsys.readouterr().err == ("edge0: error: --routing prefetch fills staged slot banks; --executor hot does "
                                       "not apply\n")


def test_every_setting_has_its_flag():
    """SETTING_FLAGS (how the command line says a setting) covers every EngineConfig setting, by its path through the
    nested sections (routing.mode, io.slots), each a flag of run's or serve's."""
    import argparse
    import dataclasses

    from edge0.cli import run, serve
    from edge0.cli.flags import SETTING_FLAGS
    from edge0.config import EngineConfig

    flags = set()
    for command in (run, serve):
        p = argparse.ArgumentParser()
        command.add_args(p)
        flags |= {o for a in p._actions for o in a.option_strings}
    def paths(value, prefix=""):
        return {p for f in dataclasses.fields(value) for p in (
            paths(getattr(value, f.name), f"{prefix}{f.name}.") if dataclasses.is_dataclass(getattr(value, f.name))
            else [prefix + f.name])}

    assert set(SETTING_FLAGS) == paths(EngineConfig()) and len(SETTING_FLAGS) == 26
    assert {"model", "routing.mode", "io.slots", "kernel.threads", "serving.max_batch"} <= set(SETTING_FLAGS)
    assert set(SETTING_FLAGS.values()) <= flags


def test_every_flag_reaches_its_setting():
    """serve's flags, each given a value other than its default, land in the nested settings they name (the CLI reads
    them through SETTING_FLAGS and EngineConfig.of)."""
    import argparse

    from edge0.cli import serve
    from edge0.cli.flags import engine_config
    from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig, ServingConfig

    p = argparse.ArgumentParser()
    serve.add_args(p)
    args = p.parse_args(
        "--model m --routing prefetch --predictor heads --heads h --guesses 2 --candidates 3 --read-ahead always "
        "--lora none --k 2 --executor staged --slots 5 --placement even --evict lru --memory-budget 0.5 --io mmap "
        "--io-workers 3 --io-throttle 50 --verify --cold --dtype float32 --kernel mlx --kernel-threads 1 "
        "--model-id x --prompt-cache-gib 0 --max-batch 2".split())
    assert engine_config(args) == EngineConfig(
        model="m", routing=RoutingConfig(mode="prefetch", predictor="heads", heads="h", guesses=2, candidates=3,
                                         read_ahead="always", lora="none", top_k=2),
        io=IOConfig(executor="staged", slots=5, placement="even", evict="lru", memory_budget_gib=0.5, mode="mmap",
                    workers=3, throttle_mbps=50.0, verify=True, cold=True),
        kernel=KernelConfig(name="mlx", threads=1, dtype="float32"),
        serving=ServingConfig(model_id="x", prompt_cache_gib=0.0, max_batch=2))


def test_a_config_of_setting_paths_is_the_nested_one():
    """EngineConfig.of takes settings by path, the rest defaults; a path outside the sections is refused by name."""
    from edge0.config import EngineConfig, IOConfig, RoutingConfig

    assert EngineConfig.of({"model": "m", "routing.mode": "native", "io.slots": 4}) == EngineConfig(
        model="m", routing=RoutingConfig(mode="native"), io=IOConfig(slots=4))
    assert EngineConfig.of({}) == EngineConfig()
    with pytest.raises(TypeError, match="no settings section 'memory'"):
        EngineConfig.of({"memory.slots": 4})
    with pytest.raises(TypeError, match="slot"):
        EngineConfig.of({"io.slot": 4})
    with pytest.raises(TypeError, match=r"^EngineConfig routing='predicted': expected RoutingConfig\(\.\.\.\)"):
        EngineConfig(routing="predicted")  # the flat spelling
