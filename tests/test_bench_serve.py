"""`edge0 bench --serve`: the load benchmark run as users run it (a subprocess, the built-in model), small."""

import json
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("openai")

from edge0.bench import serve as bench_serve  # noqa: E402
from edge0.engine import demo_store  # noqa: E402

CLIENTS, REQUESTS, TOKENS = 2, 2, 4


def edge0_bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge0.cli", "bench", "--serve", *argv], capture_output=True,
                          text=True, timeout=900)


def test_two_clients_two_requests(tmp_path):
    proc = edge0_bench("--clients", str(CLIENTS), "--requests", str(REQUESTS), "--max-tokens", str(TOKENS),
                       "--prompt-tokens", "16", "--rounds", "1", "--out", str(tmp_path),
                       "--memory-budget", "0.008")  # below the demo's 12 MiB of experts: they stream, bytes are read
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.iterdir()
    res = json.loads((out / "results.json").read_text())
    arms = set(res["median"])
    assert arms == ({"batched", "fifo"} if bench_serve.has_max_batch() else {"fifo"})
    for arm, runs in res["runs"].items():
        (run,) = runs  # one round
        assert run["requests"] == CLIENTS * REQUESTS
        assert run["tokens"] == CLIENTS * REQUESTS * TOKENS  # EOS ignored: every request generates TOKENS
        assert 0 < run["ttft_p50_ms"] <= run["ttft_p95_ms"] and 0 < run["tpot_p50_ms"] <= run["tpot_p95_ms"]
        assert run["tok_s"] > 0 and run["bytes_per_token"] > 0 and run["idle_ttft_ms"] > 0
        assert run["tok_s"] == pytest.approx(run["tokens"] / run["wall_s"])
        assert res["median"][arm]["tok_s"] == run["tok_s"]
        assert run["server_cpu_ms_per_token"] > 0 and run["client_cpu_ms_per_token"] > 0  # both do work per token
    assert res["runs"]["fifo"][0]["max_batch"] in (1, None)
    if "batched" in arms:
        assert res["runs"]["batched"][0]["max_batch"] == CLIENTS  # the default: --clients
        assert res["ratios"]["tok_s_vs_fifo"] == pytest.approx(res["median"]["batched"]["tok_s"]
                                                               / res["median"]["fifo"]["tok_s"])
    table = (out / "results.md").read_text()
    assert table.strip() in proc.stdout and "| fifo |" in table
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".log")) == ["results.json", "results.md"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, says", [
    (["--clients", "0"], "--clients 0: must be at least 1"),
    (["--requests", "-1"], "--requests -1: must be at least 1"),
    (["--max-batch", "0"], "--max-batch 0: must be at least 1"),
    (["--model", "/nonexistent/store"], "/nonexistent/store"),
])
def test_bad_flags_are_one_line(argv, says, tmp_path):
    proc = edge0_bench(*argv, "--out", str(tmp_path))
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_fifo_only_until_serve_has_max_batch(monkeypatch):
    args = SimpleNamespace(max_batch=None, clients=8)
    monkeypatch.setattr(bench_serve, "has_max_batch", lambda: False)
    arms, note = bench_serve.arms_to_run(args)
    assert arms == {"fifo": None} and "no --max-batch" in note
    monkeypatch.setattr(bench_serve, "has_max_batch", lambda: True)
    assert bench_serve.arms_to_run(args) == ({"batched": 8, "fifo": 1}, None)
    assert bench_serve.arms_to_run(SimpleNamespace(max_batch=4, clients=8)) == ({"batched": 4, "fifo": 1}, None)
    assert bench_serve.arms_to_run(SimpleNamespace(max_batch=1, clients=8))[0] == {"fifo": 1}


def test_percentile_is_numpys():
    rng = random.Random(0)
    for n in (1, 2, 5, 17):
        xs = [rng.random() for _ in range(n)]
        for q in (50, 95):
            assert bench_serve.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_prompts_are_distinct_chunks_of_the_asked_length():
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(demo_store())
    texts = bench_serve.prompts(demo_store(), 40, 64)
    assert len(texts) == 40 and len({t[:40] for t in texts}) == 40  # no shared prefix for the prompt cache
    assert all(abs(len(tok.encode(t)) - 64) <= 4 for t in texts)  # re-encoding may merge a token at the cuts
