"""Expert parallel over two local ranks: every layer on both, each rank its half of every layer's experts."""

import json
import os
import subprocess
import sys

from .common import HERE, launch_cmd


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_tokens_match_one_process_and_reads_split(dist_store):
    env = {**os.environ, "EDGE0_KERNEL": "mlx"}
    one = subprocess.run([sys.executable, str(HERE / "ranks.py"), str(dist_store), "native:staged"],
                         capture_output=True, text=True, timeout=60, env=env)
    two = subprocess.run(launch_cmd("ranks.py", str(dist_store), "native:staged", env={"EDGE0_PARALLEL": "experts"}),
                         capture_output=True, text=True, timeout=60)
    want, got = lines(one.stdout)[0], {line["rank"]: line for line in lines(two.stdout)}
    assert set(got) == {0, 1}, two.stdout + two.stderr
    assert got[0]["tokens"] == got[1]["tokens"] == want["tokens"]
    for rank in (0, 1):  # prompt and decode: each reads its own experts alone, into banks of half the slots
        assert 0 < got[rank]["decode_bytes"] <= 0.65 * want["decode_bytes"], (got[rank], want)
        assert 0 < got[rank]["prompt_bytes"] <= 0.6 * want["prompt_bytes"], (got[rank], want)
        assert got[rank]["peak_mlx"] <= 0.65 * want["peak_mlx"], (got[rank], want)
