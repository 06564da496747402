"""Pipeline parallel over two local ranks (mlx.launch, ring backend on 127.0.0.1) against one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .common import HERE, free_port, launch_cmd

CONFIGS = ("native:staged", "prefetch:staged", "predicted:staged", "predicted:auto")


def launch(store: Path, *configs: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd("ranks.py", str(store), *configs, env=env), capture_output=True, text=True,
                          timeout=timeout)


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def store(dist_store) -> Path:
    return dist_store


@pytest.fixture(scope="module")
def runs(store) -> tuple[dict, dict]:
    """({config: one process's line}, {config: {rank: line}}) for CONFIGS."""
    one = subprocess.run([sys.executable, str(HERE / "ranks.py"), str(store), *CONFIGS], capture_output=True, text=True,
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
    for config in CONFIGS:  # every weight on one rank only: its layers', the embedding on rank 0, norm and head on 1
        assert two[config][0]["weights"] + two[config][1]["weights"] == one[config]["weights"], config
    for config in ("native:staged", "predicted:staged"):
        per_rank = [two[config][r]["decode_bytes"] for r in (0, 1)]
        assert sum(per_rank) == one[config]["decode_bytes"], config  # the same reads, split
        for r in (0, 1):  # the prompt: a layer's routed experts, read and freed layer by layer (one process reads
            # every expert of each layer whole, into two banks of E slots: on a rank that would not shrink)
            assert 0 < two[config][r]["prompt_bytes"] <= 0.4 * one[config]["prompt_bytes"], (config, two[config][r])
        assert max(two[config][r]["peak_mlx"] for r in (0, 1)) <= 0.5 * one[config]["peak_mlx"], config
    # a rank's closed engine frees its memory at once (its wrappers referred back to it: a cycle, freed by the
    # garbage collector only, that the next engine in the process opened beside)
    assert all(two["native:staged"][r]["left_mlx"] < 4096 for r in (0, 1)), two["native:staged"]


def test_lost_rank_is_an_error_not_a_hang(store):
    """Rank 1 exits (code 0: the launcher does not stop the others) three tokens in: rank 0 fails at once."""
    run = launch(store, "native:staged", env={"EDGE0_TEST_DIE_RANK": "1", "EDGE0_TEST_DIE_AFTER": "3",
                                              "EDGE0_TEST_EXIT_CODE": "0"}, timeout=30)
    assert "another rank stopped" in run.stdout + run.stderr, run.stdout + run.stderr
    assert not lines(run.stdout)


def test_edge0_launch_run_matches_edge0_run():
    """The command line's path on the built-in model as it runs by default (predicted routing by its heads, one
    crossing the ranks, over resident experts, and its recovery adapter, which changes these tokens): `edge0 launch
    -n 2 -- run --json` prints rank 0's one JSON line with one process's tokens."""
    argv = ["run", "--prompt", "def fib(n):", "--max-tokens", "20", "--json"]
    env = {**os.environ, "EDGE0_KERNEL": "mlx"}
    one = subprocess.run([sys.executable, "-m", "edge0.cli", *argv], capture_output=True, text=True, timeout=60,
                         env=env)
    two = subprocess.run([sys.executable, "-m", "edge0.cli", "launch", "-n", "2", "--port", str(free_port()), "--",
                          *argv], capture_output=True, text=True, timeout=60, env=env)
    assert two.returncode == 0, two.stderr
    got = lines(two.stdout)
    assert len(got) == 1, two.stdout  # rank 1 prints nothing
    want = json.loads(one.stdout)
    assert want["lora"] is not None and want["routing"] == "predicted"
    assert got[0]["tokens"] == want["tokens"] and got[0]["lora"] == want["lora"]
    assert got[0]["pipeline"]["layers"] == [[0, 2], [3, 5]]
    assert got[0]["pipeline"]["messages"] > 0


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "bailing_moe"])
def test_other_families_match_one_process(dist_stores, arch):
    """Qwen3.5's linear and full attention layers (each rank's masks from its own first layer of each kind) and
    Bailing's embedding name and dense first layer, native and predicted routing (a head crossing the ranks)."""
    store, configs = dist_stores(arch), ("native:staged", "predicted:staged")
    one = subprocess.run([sys.executable, str(HERE / "ranks.py"), str(store), *configs], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "EDGE0_KERNEL": "mlx"})
    two = launch(store, *configs)
    want = {line["config"]: line["tokens"] for line in lines(one.stdout)}
    got = [(line["config"], line["tokens"]) for line in lines(two.stdout)]
    assert len(got) == 4 and len(want) == 2, two.stdout + two.stderr
    assert want["native:staged"] != want["predicted:staged"]
    assert all(tokens == want[config] for config, tokens in got)
    # Bailing's rank 0 syncs with the host (its first MoE layer routes natively), rank 1 need not: neither overlaps
    overlaps = {(line["config"], line["rank"]): line["overlaps"] for line in lines(two.stdout)}
    assert all(overlaps[c, 0] == overlaps[c, 1] for c in configs), overlaps


def test_ranks_of_different_stores_refuse(dist_stores):
    """Rank 1 opens another model: every rank stops at once with one line naming it (no exchange of mismatched
    hidden states, no hang)."""
    run = launch(dist_stores("qwen3_moe"), "native:staged", env={"EDGE0_TEST_STORE_1": str(dist_stores("bailing_moe"))},
                 timeout=60)
    assert "rank 1's store differs from rank 0's" in run.stdout + run.stderr, run.stdout + run.stderr
    assert not lines(run.stdout)


def test_cost_split_weighs_measured_reads(store, runs):
    """--split cost: the ranks decode CALIBRATION_PROMPT over an even split, each counting its layers' reads, and
    split by them: rank 0 logs each rank's share of those reads, which are one process's own per-layer reads on
    that decode; the tokens are one process's."""
    from edge0.cli import build_parser
    from edge0.cli.flags import engine_config
    from edge0.dist.calibrate import CALIBRATION_PROMPT, CALIBRATION_TOKENS
    from edge0.dist.split import cost_split, layer_costs
    from edge0.engine import open_engine

    args = build_parser().parse_args(["run", "--model", str(store), "--routing", "native", "--executor", "staged",
                                      "--lora", "none"])  # ranks.py's native:staged
    with open_engine(engine_config(args)) as engine:
        stats, at = engine.store.reader.stats, []
        req = engine.request(engine.encode_text(CALIBRATION_PROMPT), max_tokens=CALIBRATION_TOKENS, ignore_eos=True)
        engine.generate(req, cancelled=lambda: at.append(dict(stats.by_layer)) if not at else False)
        assert sum(stats.by_layer.values()) == stats.bytes
        reads = [stats.by_layer.get(i, 0) - at[0].get(i, 0) for i in range(4)]
    split = cost_split(layer_costs(store, 4), 2, reads)
    shares = " ".join(f"{sum(reads[i] for i in r) / sum(reads):.2f}" for r in split)
    run = launch(store, "native:staged", env={"EDGE0_SPLIT": "cost"})
    got = {line["rank"]: line["tokens"] for line in lines(run.stdout)}
    assert got == {0: runs[0]["native:staged"]["tokens"], 1: runs[0]["native:staged"]["tokens"]}, run.stderr
    layers = " ".join(f"{r.start}-{r.stop - 1}" for r in split)
    assert f"layers={layers} " in run.stderr and f"reads_share={shares} " in run.stderr, run.stderr


def test_tied_head_matches_one_process(tied_store):
    """A head tied to the embedding: the last rank holds the embedding too and runs it as the head; its logits reach
    every rank, which draw alike: `edge0 launch -n 2 -- run` at temperature 1 gives one process's tokens."""
    argv = ["run", "--model", str(tied_store), "--routing", "native", "--executor", "staged", "--lora", "none",
            "--prompt", "hello world, the", "--max-tokens", "16", "--temp", "1", "--seed", "3", "--json"]
    env = {**os.environ, "EDGE0_KERNEL": "mlx"}
    one = subprocess.run([sys.executable, "-m", "edge0.cli", *argv], capture_output=True, text=True, timeout=60,
                         env=env)
    two = subprocess.run([sys.executable, "-m", "edge0.cli", "launch", "-n", "2", "--port", str(free_port()), "--",
                          *argv], capture_output=True, text=True, timeout=60, env=env)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert lines(two.stdout)[0]["tokens"] == json.loads(one.stdout)["tokens"]


def test_forced_routes_match_one_process(store, runs, tmp_path):
    """`edge0 launch -n 2 --split cost -- run --routes TRACE`: each rank forces its own layers' rows of the trace (the
    second rank's layers are the trace's later rows), so the tokens are one process's under that trace, not the
    router's; --split cost's calibration forces the trace too: its reads are all in layers 0 and 1 (2 and 3 route to
    the same experts every token), so each rank takes one of them."""
    import numpy as np

    manifest = json.loads((store / "edge0.json").read_text())
    e, k = manifest["num_experts"], manifest["top_k"]
    rng = np.random.default_rng(3)
    trace = {str(i): [rng.choice(e, k, replace=False).tolist() if i < 2 else list(range(e - k, e)) for _ in range(40)]
             for i in range(4)}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"expert_trace": trace}))
    argv = ["run", "--model", str(store), "--executor", "staged", "--lora", "none", "--prompt", "hello world, the",
            "--max-tokens", "12", "--json"]
    env = {**os.environ, "EDGE0_KERNEL": "mlx"}
    one = subprocess.run([sys.executable, "-m", "edge0.cli", *argv, "--routes", str(path)], capture_output=True,
                         text=True, timeout=60, env=env)
    two = subprocess.run([sys.executable, "-m", "edge0.cli", "launch", "-n", "2", "--port", str(free_port()),
                          "--split", "cost", "--", *argv, "--routes", str(path)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert two.returncode == 0, two.stderr
    want = json.loads(one.stdout)["tokens"]
    assert want != runs[0]["native:staged"]["tokens"][:12]  # the trace routes otherwise than the router
    assert lines(two.stdout)[0]["tokens"] == want
    assert lines(two.stdout)[0]["pipeline"]["layers"] == [[0, 0], [1, 3]], two.stderr
