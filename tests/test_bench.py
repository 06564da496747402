"""edge0 bench: every arm replays the same tokens, results are written, bad arms are refused."""

import json
import subprocess
import sys

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
