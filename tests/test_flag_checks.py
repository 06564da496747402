"""The numeric flags of the commands beyond run/serve/chat (training, make-workload, bench) and flags given together
where one would be dropped: each refused with one line naming the flag(s), exit 2, no traceback, before any model
work. Trained files holding NaN or inf are refused at load (a NaN learning rate used to write NaN heads, then served)."""

import mlx.core as mx
import pytest

from edge0.cli import main
from edge0.errors import Edge0Error
from edge0.model.demo import DEMO_FP, DEMO_STORE

STORE = str(DEMO_STORE)


def _train(phase: str, *flags: str) -> list[str]:
    return ["train", phase, "--model", STORE, "--out", "OUT/never-written.safetensors", *flags]


BAD = [  # (argv, what the one error line must contain)
    (_train("heads", "--lr", "nan"), "--lr nan: expected a finite number"),
    (_train("heads", "--lr", "inf"), "--lr inf: expected a finite number"),
    (_train("heads", "--lr", "0"), "--lr 0.0: must be more than 0"),
    (_train("heads", "--lr", "-0.1"), "--lr -0.1: must be more than 0"),
    (_train("heads", "--k", "0"), "--k 0: must be at least 1"),
    (_train("heads", "--k", "33"), "--k 33: must be between 1 and the model's 32 experts"),
    (_train("heads", "--hidden", "-1"), "--hidden -1: must be at least 1"),
    (_train("heads", "--hidden", "0"), "--hidden 0: must be at least 1"),
    (_train("heads", "--seed", "-1"), "--seed -1: must be at least 0"),
    (_train("heads", "--steps", "0"), "--steps 0: must be at least 1"),
    (_train("lora", "--lr", "nan"), "--lr nan: expected a finite number"),
    (_train("lora", "--k", "0"), "--k 0: must be at least 1"),
    (_train("lora", "--k", "33"), "--k 33: must be between 1 and the model's 32 experts"),
    (_train("lora", "--candidates", "0"), "--candidates 0: must be at least 1"),
    (_train("lora", "--alpha", "inf"), "--alpha inf: expected a finite number"),
    (_train("lora", "--seed", "-1"), "--seed -1: must be at least 0"),
    (_train("lora", "--top", "8"), "--top and --loss ce: --top is the KL's teacher tokens"),
    (_train("distill", "--lr", "-1"), "--lr -1.0: must be more than 0"),
    (_train("distill", "--k", "0"), "--k 0: must be at least 1"),
    (_train("distill", "--k", "33"), "--k 33: must be between 1 and the model's 32 experts"),
    (_train("distill", "--seed", "-1"), "--seed -1: must be at least 0"),
    (["train", "base", "--out", "OUT/never-written", "--seed", "-1"], "--seed -1: must be at least 0"),
    (["make-workload", "OUT/never-written", "--expert-width", "-5"], "--expert-width -5: must be at least 1"),
    (["make-workload", "OUT/never-written", "--expert-width", "0"], "--expert-width 0: must be at least 1"),
    (["make-workload", "OUT/never-written", "--expert-gib", "-1"], "--expert-gib -1.0: must be more than 0"),
    (["make-workload", "OUT/never-written", "--expert-gib", "nan"], "--expert-gib nan: expected a finite"),
    (["make-workload", "OUT/never-written", "--heads-steps", "-3"], "--heads-steps -3: must be at least 1"),
    (["make-workload", "OUT/never-written", "--route-recall", "5"], "--route-recall 5.0: must be at most 1"),
    (["make-workload", "OUT/never-written", "--route-recall", "-0.5"], "--route-recall -0.5: must be at least 0"),
    (["make-workload", "OUT/never-written", "--seed", "-1"], "--seed -1: must be at least 0"),
    (["make-workload", "OUT/never-written", "--expert-width", "256", "--expert-gib", "2"],
     "--expert-width and --expert-gib: give one"),
    (["make-workload", "OUT/never-written", "--base-heads", "h.safetensors", "--heads-steps", "5"],
     "--base-heads and --heads-steps: the heads given are not trained again"),
    (["make-model", "--arch", "qwen3_moe", "--seed", "-1", "OUT/m"], "--seed -1: must be at least 0"),
    (["eval", "--model", str(DEMO_FP), "--routing", "predicted"], "--routing: used with an Edge0 store; --model"),
    (["eval", "--model", str(DEMO_FP), "--slots", "8"], "--slots: used with an Edge0 store"),
    (["run", "--replay", "r.json", "--prompt", "x"], "--replay and --prompt: the replay file holds the prompt"),
    (["run", "--replay", "r.json", "--prompt-file", "p.txt"], "--replay and --prompt-file: the replay file holds"),
    (["run", "--replay", "r.json", "--chat"], "--replay and --chat: the replay file holds the prompt"),
    (["run", "--slots", "8", "--executor", "resident"], "--slots and --executor resident: --slots arranges staged"),
    (["run", "--slots", "8", "--executor", "exact"], "--slots and --executor exact"),
    (["run", "--slots", "8", "--executor", "hot"], "--slots and --executor hot"),
    (["serve", "--slots", "8", "--executor", "resident"], "--slots and --executor resident"),
    (["run", "--placement", "even", "--executor", "resident"], "--placement and --executor resident"),
    (["run", "--evict", "lru", "--executor", "exact"], "--evict and --executor exact: --evict arranges staged and hot"),
    (["chat", "--system", "ab\udcff"], "--system: not UTF-8 text (byte 2)"),  # argv's byte 0xff, as Python keeps it
    (["bench", "--store", "/nonexistent"], "--store /nonexistent: no such model directory"),
    (["bench", "--source", "/nonexistent", "--store", STORE], "--source /nonexistent: no such model directory"),
    (["bench", "--threads", "0"], "--threads 0: must be at least 1"),
    (["bench", "--memory-budget", "-1"], "--memory-budget -1.0: must be at least 0"),
    (["bench", "--serve", "--kernels"], "--serve and --kernels: each is a benchmark of its own"),
    (["bench", "--kernels", "--kernel-threads", "two"], "--kernel-threads two: thread counts of at least 1"),
    (["bench", "--kernels", "--kernel-threads", "1,0"], "--kernel-threads 1,0: thread counts of at least 1"),
    (["bench", "--kernels", "--kernel-seconds", "0"], "--kernel-seconds 0.0: must be more than 0"),
    (["bench", "--kernels", "--kernel-prefill-rows", "-1"], "--kernel-prefill-rows -1: must be at least 0"),
    (["bench", "--clients", "4"], "--clients: only read by `edge0 bench --serve`"),
    (["bench", "--kernel-seconds", "1"], "--kernel-seconds: only read by `edge0 bench --kernels`"),
    (["bench", "--serve", "--store", STORE], "--store and --serve: the serve benchmark does not read --store"),
    (["bench", "--serve", "--kernel-json"], "--kernel-json and --serve: the serve benchmark does not read"),
    (["bench", "--kernels", "--arms", "exact"], "--arms and --kernels: the kernels benchmark does not read --arms"),
    (["bench", "--kernels", "--rounds", "5"], "--rounds and --kernels"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a[:2] + a[-2:])[:70] for a, _ in BAD])
def test_bad_flag_is_one_line(argv, message, capsys, tmp_path):
    argv = [a.replace("OUT/", f"{tmp_path}/") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("edge0: error:")]
    assert len(lines) == 1 and lines[0].startswith(f"edge0: error: {message}"), err  # said first, before any work
    assert "Traceback" not in err


def _poisoned(src, dest, name: str) -> None:
    """A copy of the safetensors file src with one value of tensor `name` set to NaN, its metadata kept."""
    arrays, meta = mx.load(str(src), return_metadata=True)
    w = arrays[name]
    arrays[name] = mx.where(mx.arange(w.size).reshape(w.shape) == 0, mx.array(float("nan"), w.dtype), w)
    mx.save_safetensors(str(dest), arrays, metadata=meta)


def test_heads_holding_nan_are_refused_at_load(tmp_path, capsys):
    """What `train heads --lr nan` wrote used to be served: every later token noise."""
    from edge0.io.manifest import read_manifest
    from edge0.model.arch import read_config
    from edge0.model.heads import HeadSet

    src = DEMO_STORE / "heads-k4.safetensors"
    name = sorted(mx.load(str(src)))[-1]
    bad = tmp_path / "heads-k4.safetensors"
    _poisoned(src, bad, name)
    with pytest.raises(Edge0Error, match=f"{bad}: {name} holds values that are not finite"):
        HeadSet.load(bad, read_manifest(DEMO_STORE), read_config(DEMO_STORE))
    assert main(["run", "--heads", str(bad), "--lora", "none", "--max-tokens", "1"]) == 2
    assert "holds values that are not finite" in capsys.readouterr().err


def test_an_adapter_holding_nan_is_refused_at_load(tmp_path):
    from edge0.model.lora import Adapter

    src = DEMO_STORE / "lora-k4.safetensors"
    name = sorted(mx.load(str(src)))[0]
    bad = tmp_path / "lora.safetensors"
    _poisoned(src, bad, name)
    with pytest.raises(Edge0Error, match=f"{bad}: {name} holds values that are not finite"):
        Adapter.read(bad)
    Adapter.read(src)  # the shipped one passes


def test_training_stops_when_its_loss_is_no_longer_a_number(models, tmp_path):
    """A learning rate that is a number but far too large: the heads blow up within a few updates; the run stops
    there instead of writing NaN heads."""
    from edge0.train.head_phase import train_heads

    text = tmp_path / "t.py"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    out = tmp_path / "h.safetensors"
    with pytest.raises(Edge0Error, match=r"step \d of the heads: the loss is nan; lower --lr"):
        train_heads(models("qwen3_moe"), out, steps=3, hidden=16, lr=1e30, eval_windows=1, progress=False, seq_len=64,
                    data=text, heldout=text)
    assert not out.exists()


def test_every_bench_flag_is_read_by_a_named_benchmark():
    """A flag added to `edge0 bench` without saying which benchmark reads it would be dropped by the others."""
    from edge0.bench.modes import USED_BY
    from edge0.cli.bench import defaults

    assert set(defaults()) - set(USED_BY) == {"serve", "kernels"}


@pytest.mark.parametrize("flags", [["--slots", "8"], ["--placement", "even"], ["--evict", "lru"]])
def test_a_bank_flag_under_the_auto_executor_streams_instead_of_being_dropped(flags):
    """The demo's experts fit, so auto keeps them resident; a flag that arranges slot banks asks for them instead."""
    from edge0.config import EngineConfig, IOConfig
    from edge0.engine import open_engine

    with open_engine(EngineConfig()) as plain:
        assert plain.store.runtime.executor == "resident"
    values = dict(zip((f.lstrip("-") for f in flags[::2]), flags[1::2]))
    config = EngineConfig(io=IOConfig(slots=int(values["slots"]) if "slots" in values else None,
                                      placement=values.get("placement", "auto"), evict=values.get("evict", "lfu")))
    with open_engine(config) as engine:
        assert engine.store.runtime.executor == "staged"
