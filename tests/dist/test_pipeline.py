"""Pipeline parallel over two local ranks (mlx.launch, ring backend on 127.0.0.1) against one process."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

RANKS = Path(__file__).with_name("ranks.py")
LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]  # mlx.launch
CONFIGS = ("native:staged", "predicted:staged", "predicted:auto")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(store: Path, *configs: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`mlx.launch -n 2 --backend ring` of tests/dist/ranks.py on free ports; extra env for every rank."""
    cmd = [*LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_port())]
    for k, v in (env or {}).items():
        cmd += ["--env", f"{k}={v}"]
    cmd += ["--", sys.executable, str(RANKS), str(store), *configs]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def store(models, tmp_path_factory) -> Path:
    """The tiny qwen3_moe store (4 layers: 0-1 and 2-3 on two ranks) with heads whose correction is not zero (so
    predicted routing differs from the router's), the head of layer 2 owned by layer 1: it crosses the ranks."""
    from edge0.io.manifest import read_manifest
    from edge0.model.arch import read_config
    from edge0.model.heads import HeadSet

    root = tmp_path_factory.mktemp("dist") / "store"
    shutil.copytree(models("qwen3_moe"), root)
    m = read_manifest(root)
    heads = HeadSet.create(m, read_config(root), top_k=m.top_k, hidden=16)
    mx.random.seed(1)
    for head in heads.heads.values():
        head.delta.weight = mx.random.normal(head.delta.weight.shape) * 0.5
    heads.save(root / f"heads-k{m.top_k}.safetensors")
    assert heads.owners == {2: 1}
    return root


@pytest.fixture(scope="module")
def runs(store) -> tuple[dict, dict]:
    """({config: one process's line}, {config: {rank: line}}) for CONFIGS."""
    one = subprocess.run([sys.executable, str(RANKS), str(store), *CONFIGS], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "EDGE0_KERNEL": "mlx"})
    assert one.returncode == 0, one.stderr
    two = launch(store, *CONFIGS)
    got: dict = {}
    for line in lines(two.stdout):
        got.setdefault(line["config"], {})[line["rank"]] = line
    assert all(len(got.get(c, {})) == 2 for c in CONFIGS), two.stdout + two.stderr
    return {line["config"]: line for line in lines(one.stdout)}, got


def test_tokens_match_one_process(runs):
    one, two = runs
    assert one["native:staged"]["tokens"] != one["predicted:staged"]["tokens"]  # the heads route otherwise
    for config in CONFIGS:
        assert two[config][0]["tokens"] == two[config][1]["tokens"] == one[config]["tokens"], config


def test_each_rank_reads_its_share(runs):
    one, two = runs
    for config in ("native:staged", "predicted:staged"):
        per_rank = [two[config][r]["bytes"] for r in (0, 1)]
        assert sum(per_rank) == one[config]["bytes"], config  # the same reads, split
        assert max(per_rank) <= 0.6 * one[config]["bytes"], (config, per_rank)  # about half: layers differ


def test_lost_rank_is_an_error_not_a_hang(store):
    """Rank 1 exits (code 0: the launcher does not stop the others) three tokens in: rank 0 fails at once."""
    run = launch(store, "native:staged", env={"EDGE0_TEST_DIE_RANK": "1", "EDGE0_TEST_DIE_AFTER": "3",
                                              "EDGE0_TEST_EXIT_CODE": "0"}, timeout=30)
    assert "another rank stopped" in run.stdout + run.stderr, run.stdout + run.stderr
    assert not lines(run.stdout)
