"""A batch forced from one trace per row (model/traced.py admit; bench/route_batch.py): each row computes exactly its
own trace's experts, and the rule that sizes a batch over streamed banks (batch_rows) keeps it from reading more per
token than its sequences alone, on a case whose reads are known in advance."""

from pathlib import Path

import numpy as np

from edge0.bench.route_batch import prompts, run_batch, run_serial
from edge0.compute.runtime import batch_rows
from edge0.config import EngineConfig, IOConfig, RoutingConfig, ServingConfig
from edge0.engine import open_engine
from edge0.io.routetrace import RouteTrace, write_trace
from edge0.model.route_stats import moe_blocks
from edge0.model.traced import TracedRouting

LAYERS, EXPERTS, K = 6, 32, 4  # the demo store's


def _trace(tokens: int, seed: int) -> RouteTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.permutation(EXPERTS)[:K] for _ in range(tokens)] for _ in range(LAYERS)]).astype(np.int32)
    return RouteTrace(ids, None, list(range(LAYERS)), num_experts=EXPERTS)


def _config(rows: int, slots: int = 32) -> EngineConfig:
    return EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="staged", slots=slots),
                        serving=ServingConfig(max_batch=rows))


def test_each_row_of_a_batch_computes_its_own_traces_experts():
    """Two sequences admitted one by one (prompt 3, 5 tokens each), then batched: row r's experts at every layer are
    trace r's rows in order (its prompt's and first step's alone, the batched steps' as row r)."""
    from edge0.decode.batch import BatchDecoder

    traces = [_trace(20, 1), _trace(20, 2)]
    with open_engine(_config(2)) as engine:
        engine.prompt_cache = None
        blocks = moe_blocks(engine.store.model)
        seen = {i: [] for i in blocks}
        for i, blk in blocks.items():
            def spy(x, inds, _run=blk.executor, _seen=seen[i]):
                _seen.append(np.array(inds))
                return _run(x, inds)

            blk.executor = spy
        traced = TracedRouting(engine.store.model, traces=traces, what="--routes t")
        batch = BatchDecoder(engine, 2)
        for r, p in enumerate(prompts(2, 3)):
            traced.admit(r)
            batch.admit(engine.request(p, max_tokens=5, ignore_eos=True), lambda s: None, lambda: False)
        while batch.seqs:
            batch.step()
        batch.settle()
    for j, i in enumerate(blocks):
        rows = {0: [], 1: []}
        calls = seen[i]
        for call, r in zip(calls[:4], (0, 0, 1, 1)):  # prefill (2 tokens) and first step of each, alone
            rows[r].append(call.reshape(-1, K))
        for call in calls[4:]:  # batched steps (2, 1, K)
            assert call.shape[0] == 2
            rows[0].append(call[0].reshape(-1, K))
            rows[1].append(call[1].reshape(-1, K))
        for r in (0, 1):
            got = np.concatenate(rows[r])
            assert (got == traces[r].ids[j, :len(got)]).all() and len(got) == 3 + 5 - 1, (i, r)


def test_batch_rows_is_the_most_rows_whose_expected_union_fits():
    """OLMoE's 64 experts, K 8: 2 rows' expected union is 15.0, 3 rows' 21.9 (E (1 - (1 - K/E)^B), by hand)."""
    assert batch_rows(8, slots=16, experts=64, top_k=8) == 2
    assert batch_rows(8, slots=32, experts=64, top_k=8) == 5  # 31.2 at 5 rows, 35.3 at 6
    assert batch_rows(3, slots=64, experts=64, top_k=8) == 3
    assert batch_rows(8, slots=8, experts=64, top_k=8) == 1


def open_bundle_bytes() -> int:
    with open_engine(_config(1)) as engine:
        return engine.store.manifest.bundle_bytes


def _fixed(row: int, tokens: int) -> RouteTrace:
    """Row `row` routes experts 4 row .. 4 row + 3 at every token and layer: rows share none."""
    ids = np.broadcast_to(np.arange(K * row, K * row + K, dtype=np.int32), (LAYERS, tokens, K)).copy()
    return RouteTrace(ids, None, list(range(LAYERS)), num_experts=EXPERTS)


def test_a_batch_the_banks_cannot_hold_reads_more_than_its_rows_and_the_chosen_size_does_not():
    """8 slots, 4 rows of disjoint experts: alone or 2 at a time (batch_rows' choice) every expert is read at admission
    and the batched steps read at most one row's experts again (lfu evicted the newest row's at the last admission);
    4 rows at once route 16 experts a layer into 8 slots: every step reads all 16 (the exact way)."""
    rows = [_fixed(r, 12) for r in range(4)]
    prompt = prompts(4, 3)
    g = batch_rows(4, slots=8, experts=EXPERTS, top_k=K)
    assert g == 2
    whole = run_batch(_config(4, 8), rows, prompt, 6, 4)
    chosen = run_batch(_config(g, 8), rows, prompt, 6, g)
    alone = run_serial(_config(1, 8), rows, prompt, 6)
    bundle = whole["bytes"] / (LAYERS * 4 * K * 5)  # whole: every row's K experts at every layer and step, read
    assert bundle == open_bundle_bytes()
    assert chosen["bytes"] <= LAYERS * K * bundle  # at most one row's experts again (lfu keeps the first pair's)
    assert whole["tokens"] == chosen["tokens"] == sum(s["tokens"] for s in alone) == 4 * 5


def test_bench_refuses_batch_and_affinity_flags_that_cannot_run_by_name(tmp_path, capsys):
    """--batch without a store, routes or slots; --affinity with no arm reading it; the affinity arm without a table:
    one line each, exit 2, nothing written."""
    from edge0.cli import main

    store = str(Path(__file__).resolve().parents[1] / "edge0" / "model" / "demo" / "store")
    out = str(tmp_path / "out")
    cases = [(["--batch", "2,4", "--routes", "t.json"], "--batch 2,4: sizes of 2 or more"),
             (["--batch", "1", "--store", store, "--arms", "staged", "--routes", "t.json", "--slots", "8"],
              "--batch 1: sizes of 2 or more"),
             (["--store", store, "--arms", "staged", "--affinity", "a.npz"], "--affinity a.npz: no arm reads it"),
             (["--store", store, "--arms", "prefetch:affinity"], "--arms prefetch:affinity reads a co-activation table")]
    for argv, said in cases:
        assert main(["bench", *argv, "--max-tokens", "2", "--out", out]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_bench_batch_refuses_a_trace_of_another_model_by_name(tmp_path, capsys):
    """A trace of 3 MoE layers x 8 experts on the demo store (6 x 32): one line naming it (was an IndexError)."""
    from edge0.cli import main

    store = str(Path(__file__).resolve().parents[1] / "edge0" / "model" / "demo" / "store")
    other = tmp_path / "other.npz"
    ids = np.stack([[np.roll(np.arange(8), t)[:K] for t in range(64)] for _ in range(3)]).astype(np.int32)
    write_trace(other, RouteTrace(ids, None, [0, 1, 2], num_experts=8))
    assert main(["bench", "--batch", "2", "--store", store, "--arms", "staged", "--routes", f"{other},{other}",
                 "--slots", "8", "--prompt-tokens", "4", "--max-tokens", "2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--routes {other}: the trace routes 3 MoE layers, the model has {LAYERS}" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
