"""Every executor path keeps the math contract, and the banks behave: in place, guarded, within budget."""


import mlx.core as mx
import numpy as np
import pytest

from edge0.compute import kernels
from edge0.compute.banks import Bank, Fence
from edge0.compute.executors import SlotCache, SlotStats, fill_slots
from edge0.compute.experts import switch_glu
from edge0.errors import BankBusy
from edge0.io.reader import BundleReader
from edge0.model.load import load_store

from tests.conftest import ARCHS
from tests.helpers import run_json, use_kernel

PATHS = ("exact", "staged", "hot")


def dequantized_reference(store, layer, x, inds, scores, combine):
    """float32: down(silu(gate x) * up x) with dequantized weights, experts looped one by one."""
    m = store.manifest
    reader = BundleReader(store.path, m)
    q = m.quantization
    out = np.zeros((*inds.shape, x.shape[-1]), dtype=np.float32)
    xs = np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1])
    flat_inds = np.array(inds).reshape(-1, inds.shape[-1])
    weights = {}
    for e in np.unique(flat_inds):
        bufs = [bytearray(p.nbytes) for p in m.pieces]
        reader.read_into(layer, int(e), bufs)
        arr = {p.name: mx.array(np.frombuffer(b, dtype=np.uint32 if p.dtype == "U32" else np.uint16).reshape(p.shape))
               for p, b in zip(m.pieces, bufs)}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            s = arr[f"{proj}.scales"].view(mx.bfloat16).astype(mx.float32)
            b = arr[f"{proj}.biases"].view(mx.bfloat16).astype(mx.float32)
            weights[(int(e), proj)] = np.array(mx.dequantize(arr[f"{proj}.weight"], s, b, q["group_size"], q["bits"]))
    reader.close()
    out = out.reshape(-1, inds.shape[-1], x.shape[-1])
    for t in range(xs.shape[0]):
        for j, e in enumerate(flat_inds[t]):
            g = weights[(int(e), "gate_proj")] @ xs[t]
            u = weights[(int(e), "up_proj")] @ xs[t]
            out[t, j] = weights[(int(e), "down_proj")] @ (g / (1 + np.exp(-g)) * u)
    return combine(mx.array(out.reshape(*inds.shape, -1)), scores)


KERNELS = ["mlx"] + (["edge0"] if kernels.available() else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tokens", [1, 40])
@pytest.mark.parametrize("arch", ARCHS)
def test_paths_bitwise_equal_and_within_1pct_of_dequantized(models, arch, tokens, kernel):
    """Every executor gives the same bits under one kernel; MLX's within 1% of a float32 dequantized
    reference, edge0's within 3% (int8 activations at two products in a row)."""
    use_kernel(kernel)
    outputs = {}
    for path in PATHS:
        store = load_store(models(arch), dtype="float32", executor=path)
        layer = store.manifest.layers[-1].layer
        block = store.model.layers[layer].mlp
        mx.random.seed(3)
        x = mx.random.normal((1, tokens, store.model.args.hidden_size if hasattr(store.model.args, "hidden_size")
                              else store.config["text_config"]["hidden_size"]))
        inds, scores = block.route(x)
        outputs[path] = np.array(block.executor(x, inds))
        if tokens > 1 and path != "exact":
            assert store.runtime.prefill is not None and store.runtime.prefill.wants(inds), "whole-layer path not taken"
        if path == "exact":
            from edge0.compute.routing import combine
            ref = dequantized_reference(store, layer, x, inds, scores, lambda y, s: combine(y, s, cast_back=False))
            got = combine(mx.array(outputs[path]), scores, cast_back=False)
            err = np.linalg.norm(np.array(got) - np.array(ref)) / np.linalg.norm(np.array(ref))
            assert err < (0.01 if kernel == "mlx" else 0.03)
        store.close()
    for path in PATHS:
        assert np.array_equal(outputs[path], outputs["exact"]), path


def cli_tokens(store, *flags):
    return run_json("--model", str(store), "--max-tokens", "32", "--ignore-eos", "--prompt",
                    "import os\nimport sys\n" * 20, *flags)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_executor_decodes_the_same_tokens(models, arch):
    want = cli_tokens(models(arch), "--executor", "exact")
    for path in ("staged", "hot"):
        got = cli_tokens(models(arch), "--executor", path)
        assert got["tokens"] == want["tokens"], path
        assert got["executor"] == path
    assert got["hit_rate"] > 0  # a warm LRU serves some experts without reading


def tiny_bank(models, slots):
    store = models("qwen3_moe")
    reader = BundleReader(store)
    fence = Fence()
    return reader, fence, Bank(reader.manifest.pieces, slots, fence, mx.float32)


def test_fills_happen_in_place_without_mlx_ops(models):
    reader, fence, bank = tiny_bank(models, 4)
    layer = reader.manifest.layers[0].layer
    cache = SlotCache(bank, SlotStats(), reader.manifest.num_experts)
    arrays = dict(bank.arrays)
    addresses = {name: bank.address(name) for name in arrays}
    active = mx.get_active_memory()
    for ids in ([0, 1, 2, 3], [2, 5, 6, 3], [7, 8, 9, 10]):
        slots, fills = cache.assign(np.array(ids))
        fill_slots(reader, layer, bank, fills)
        for expert, slot in zip(ids, slots):
            want = [bytearray(p.nbytes) for p in reader.manifest.pieces]
            reader.read_into(layer, expert, want)
            assert bytes(memoryview(bank.arrays["gate_proj.weight"][slot])) == bytes(want[0])
            scales = np.frombuffer(want[1], dtype=np.uint16).astype(np.uint32) << 16  # bf16 widened exactly
            assert np.array_equal(np.array(bank.arrays["gate_proj.scales"][slot]).view(np.uint32).ravel(), scales)
    assert len(fills) == 4
    assert {n: bank.address(n) for n in arrays} == addresses  # same buffers
    assert all(bank.arrays[n] is arrays[n] for n in arrays)  # same arrays, no new graph nodes
    assert mx.get_active_memory() == active  # nothing allocated by MLX
    assert cache.stats.hits == 2 and cache.stats.lookups == 12  # [2, 3] were kept across the second fill
    reader.close()


def test_bank_refuses_writes_while_a_graph_may_read_it(models):
    reader, fence, bank = tiny_bank(models, 2)
    layer = reader.manifest.layers[0].layer
    fill_slots(reader, layer, bank, [(0, 0), (1, 1)])
    from edge0.compute.experts import Quant
    x = mx.ones((1, 1, bank.arrays["down_proj.weight"].shape[1]))
    y = switch_glu(x, mx.array([[[0, 1]]], dtype=mx.uint32), bank.read(), Quant(4, 64, "affine"))  # built, not run
    with pytest.raises(BankBusy):
        bank.write_buffers(0)
    mx.eval(y)
    fence.sync()
    assert bank.write_buffers(0)  # evaluated: writable again
    reader.close()


def test_budget_below_one_layer_streams_and_is_honoured(models):
    store_dir = models("qwen3_moe")
    want = cli_tokens(store_dir, "--executor", "exact")
    s = load_store(store_dir, dtype="float32", executor="exact")
    layer_bytes = s.manifest.num_experts * s.manifest.bundle_stride
    k = s.manifest.top_k
    s.close()
    budget_bytes = (k + 2) * s.manifest.bundle_stride  # room for one token's experts, far below a layer
    assert budget_bytes < layer_bytes
    got = cli_tokens(store_dir, "--executor", "hot", "--memory-budget", str(budget_bytes / 2**30))
    assert got["tokens"] == want["tokens"]
    assert 0 < got["resident_expert_bytes"] <= budget_bytes
    tight = cli_tokens(store_dir, "--executor", "hot", "--memory-budget", str(s.manifest.bundle_stride / 2**30))
    assert tight["tokens"] == want["tokens"] and tight["resident_expert_bytes"] <= s.manifest.bundle_stride


@pytest.mark.parametrize("mode", ["mmap", "direct"])
def test_io_modes_read_the_same_bytes_as_pread(models, mode):
    store = models("bailing_moe")
    plain, other = BundleReader(store), BundleReader(store, io=mode)
    m = plain.manifest
    for entry in m.layers:
        for e in range(m.num_experts):
            a = [bytearray(p.nbytes) for p in m.pieces]
            b = [bytearray(p.nbytes) for p in m.pieces]
            plain.read_into(entry.layer, e, a)
            other.read_into(entry.layer, e, b)
            assert a == b
    assert other.stats.bytes == plain.stats.bytes > 0
    plain.close()
    other.close()


def test_a_failed_fill_leaves_its_slots_empty(models):
    from edge0.compute.executors import SlottedExperts
    from edge0.compute.experts import ExactExperts
    from edge0.errors import Edge0Error
    from edge0.io import faults

    reader, fence, bank = tiny_bank(models, 4)
    layer = reader.manifest.layers[0].layer
    cache = SlotCache(bank, SlotStats(), reader.manifest.num_experts)
    exact = ExactExperts(reader, layer, mx.float32)
    slotted = SlottedExperts(reader, layer, cache, fence, exact, None, shared=False)
    x = mx.random.normal((1, 1, bank.arrays["down_proj.weight"].shape[1]), key=mx.random.key(0))
    inds = mx.array([[[0, 1]]], dtype=mx.uint32)
    fill_slots(reader, layer, bank, cache.assign(np.array([0]))[1])  # expert 0 held before the failure
    faults.inject(reader, "short@1")  # the step's one read (expert 1: 0 is held) lands half
    with pytest.raises(Edge0Error, match="short read of expert 1"):
        slotted(x, inds)
    assert cache.slot_of[1] == -1 and 1 not in bank.holds.tolist()  # not found by a lookup: read again
    assert bank.holds[cache.slot_of[0]] == 0
    fence.sync()
    assert np.array_equal(np.array(slotted(x, inds)), np.array(exact(x, inds)))
    reader.close()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_commit_widens_the_staged_bf16_pieces_of_exactly_the_slots_named(n):
    """bf16 scales and biases staged for a few slots (one at a time) or many (at once) land in the float32 bank
    as their exact float32 values; other slots are untouched."""
    from edge0.io.manifest import Piece

    pieces = [Piece(name="s", dtype="BF16", shape=[3, 4], offset=0, nbytes=24),
              Piece(name="w", dtype="U32", shape=[2], offset=24, nbytes=8),
              Piece(name="b", dtype="BF16", shape=[5], offset=32, nbytes=10)]
    bank = Bank(pieces, 6, Fence(), mx.float32)
    bank.arrays
    rng = np.random.default_rng(n)
    values = {p.name: rng.standard_normal((6, *p.shape)).astype(np.float32) for p in pieces if p.dtype == "BF16"}
    for slot in range(6):
        views = bank.write_buffers(slot)
        for p, view in zip(pieces, views):
            if p.dtype == "BF16":  # bf16: the high half of the float32 word
                bits = (values[p.name][slot].view(np.uint32) >> 16).astype(np.uint16)
                np.frombuffer(view, dtype=np.uint16)[:] = bits.reshape(-1)
    slots = [5, 0, 3, 1, 4][:n]
    bank.commit(slots)
    for name, v in values.items():
        got = np.array(bank.arrays[name])
        want = (v.view(np.uint32) & 0xFFFF0000).view(np.float32)
        assert np.array_equal(got[slots], want[slots])
        assert not np.any(got[[s for s in range(6) if s not in slots]])  # never committed: still zero


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_held_experts_compute_before_reads_from_the_disk_and_the_rows_come_back_in_order(models, monkeypatch, kernel,
                                                                                         tokens, cache):
    """A step with some routed experts held and some read: when a read comes from the disk (the store's pages
    evicted), the held ones' rows are built and started first (hits_first), the rest after their reads; from the
    page cache the step is one gather. Either way the output is bitwise the exact path's, row for row."""
    from edge0.compute import executors
    from edge0.compute.executors import SlottedExperts
    from edge0.compute.experts import ExactExperts
    from edge0.io.pagecache import evict

    use_kernel(kernel)
    reader, fence, bank = tiny_bank(models, 8)
    layer = reader.manifest.layers[0].layer
    cache_ = SlotCache(bank, SlotStats(), reader.manifest.num_experts)
    exact = ExactExperts(reader, layer, mx.float32)
    slotted = SlottedExperts(reader, layer, cache_, fence, exact, None, shared=False)
    started = []
    first = executors.hits_first
    monkeypatch.setattr(executors, "hits_first", lambda *a, **k: started.append(a[1].copy()) or first(*a, **k))
    d = bank.arrays["down_proj.weight"].shape[1]
    x = mx.random.normal((tokens, 1, d), key=mx.random.key(1))
    last = reader.manifest.num_experts - 1  # never routed before the last step
    assert last > 8
    steps = ([[0, 1, 2, 3]] * tokens, [[3, 5, 1, 6], [6, 0, 2, 7], [5, 3, 4, 1]][:tokens], [[7, 2, last, 0]] * tokens)
    for routed in steps:
        inds = mx.array(np.array(routed, dtype=np.uint32)[:, None, :])
        for f in reader.root.rglob("*.safetensors"):
            (evict if cache == "cold" else lambda f: f.read_bytes())(f)
        got = np.array(slotted(x, inds))
        fence.sync()
        assert np.array_equal(got, np.array(exact(x, inds))), routed
    # the first step held nothing; the next two held some of their experts
    assert len(started) == (2 if cache == "cold" else 0)
    reader.close()


@pytest.mark.parametrize("policy,window", [("lfu", 0), ("lfu", 3), ("lru", 0)])
def test_small_bank_assign_chooses_the_slots_the_array_version_chooses(policy, window, monkeypatch):
    """A staged layer's bank (a few slots) assigns on Python lists: over a long random run of lookups, with slots
    filling, reserved and read by pending graphs, scores with ties and lfu's window, it returns the same slots and
    fills, and leaves the same maps, clocks and counts, as the array version (forced by SMALL_BANK = 0)."""
    from edge0.compute import executors
    from edge0.io.manifest import Piece

    pieces = [Piece(name="w", dtype="U32", shape=[2], offset=0, nbytes=8)]
    runs = []
    for small in (64, 0):
        monkeypatch.setattr(executors, "SMALL_BANK", small)
        fence = Fence()
        cache = SlotCache(Bank(pieces, 8, fence, None), SlotStats(), 32, policy=policy, window=window)
        r = np.random.default_rng(7)
        out = []
        for step in range(400):
            keys = np.unique(r.integers(0, 32, size=int(r.integers(1, 7))))
            cache.filling[:] = r.random(8) < 0.15
            cache.reserved[:] = r.random(8) < 0.15
            rank = (r.normal(size=32) if step % 4 == 1 else r.integers(0, 3, size=32).astype(np.float32)) \
                if step % 2 else None  # a guess's scores (some tied), or the policy's
            got = cache.assign(keys, count=bool(step % 3), rank=rank)
            out.append(None if got is None else (got[0].tolist(), got[1]))
            if got is not None:
                cache.bank.read(got[0])
            if r.random() < 0.5:
                fence.sync()
        out.append((cache.slot_of.tolist(), cache.bank.holds.tolist(), cache.used.tolist(), cache.stats.lookups,
                    cache.stats.hits, None if cache.freq is None else cache.freq.counts.tolist()))
        runs.append(out)
    assert runs[0] == runs[1]
    assert sum(o is None for o in runs[0][:-1]) > 10 and sum(bool(o and o[1]) for o in runs[0][:-1]) > 100


@pytest.mark.parametrize("small", [64, 0])
def test_a_ranked_fill_replaces_the_held_experts_scored_lowest(small, monkeypatch):
    """A guess's fill (prefetch routing) replaces an empty slot first, then the held expert its predictor scores
    lowest, ties the least recently used; without scores the least recently used, and never a key outside the
    bank's own (a bank of several layers' keys ignores one layer's scores)."""
    from edge0.compute import executors
    from edge0.io.manifest import Piece

    monkeypatch.setattr(executors, "SMALL_BANK", small)
    pieces = [Piece(name="w", dtype="U32", shape=[2], offset=0, nbytes=8)]
    fence = Fence()
    cache = SlotCache(Bank(pieces, 4, fence, None), SlotStats(), 8)
    slots, _ = cache.assign(np.array([0, 1, 2]))  # held in slots 0-2 (in that order of use), slot 3 empty
    fence.sync()
    rank = np.array([5.0, 1.0, 3.0, 0, 0, 9.0, 8.0, 0])
    got = cache.assign(np.array([5]), count=False, rank=rank)
    assert got[1] == [(3, 5)]  # the empty slot first
    fence.sync()
    got = cache.assign(np.array([6]), count=False, rank=rank)
    assert got[1] == [(1, 6)]  # expert 1 scores lowest of those held (LRU would take expert 0's slot)
    fence.sync()
    assert cache.assign(np.array([0]))[1] == []  # expert 0 used again: slot 2 (expert 2) is now the least recent
    fence.sync()
    tied = np.zeros(8)
    assert cache.assign(np.array([7]), count=False, rank=tied)[1] == [(2, 7)]  # ties: the least recently used
    fence.sync()
    assert cache.assign(np.array([1]))[1] == [(3, 1)]  # no scores: the least recently used (expert 5, slot 3)
    shared = SlotCache(Bank(pieces, 2, Fence(), None), SlotStats(), 16)
    shared.assign(np.array([9, 3]))
    shared.bank.fence.sync()
    assert shared.assign(np.array([4]), rank=np.arange(8.0))[1] == [(0, 4)]  # scores of 8 keys, 16 in the bank: LRU


@pytest.mark.parametrize("slots", ["K", "E"])
def test_a_bank_keeps_its_packed_copy_in_step_with_its_fills(slots, monkeypatch):
    """Staged banks of 4-bit experts keep the edge0 kernel's packed copy (faster products), rewritten slot by slot as
    fills land: on the built-in model (every projection packable; its bundles are under PACK_BANK_BYTES, so the
    threshold is lowered here) native routing through a bank of K slots (refilled at every token) or of every expert
    gives the resident experts' log-probabilities bit for bit, and so does the row layout (packed copies off); a copy
    left stale by a refill would not."""
    from edge0.compute import runtime
    from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig
    from edge0.engine import open_engine
    from edge0.io.manifest import read_manifest
    from edge0.model.demo import DEMO_STORE

    ext = kernels.load()
    if ext is None or not ext.packed_on():
        pytest.skip("no edge0 kernels")
    m = read_manifest(DEMO_STORE)
    monkeypatch.setattr(runtime, "PACK_BANK_BYTES", m.bundle_bytes - 1)
    tokens = list(range(100, 160))
    n = m.top_k if slots == "K" else m.num_experts
    out = {}
    for name, ex in (("resident", "resident"), ("staged", "staged")):
        c = EngineConfig(routing=RoutingConfig(mode="native", lora="none"),
                         io=IOConfig(executor=ex, slots=n if ex == "staged" else None),
                         kernel=KernelConfig(name="edge0"))
        with open_engine(c) as e:
            out[name] = np.array(e.forced_logprobs(tokens))
            if ex == "staged":
                banks = e.store.runtime.banks
                copies = 3 if ext.impl() == "avx512" else 0  # the packed layout is the VNNI path's
                assert all(b.packed == copies for b in banks if b.allocated) and any(b.allocated for b in banks)
                ext.set_packed(False)
                try:
                    out["rows"] = np.array(e.forced_logprobs(tokens))
                finally:
                    ext.set_packed(True)
    assert np.array_equal(out["staged"], out["resident"])
    assert np.array_equal(out["rows"], out["resident"])


def test_whole_layer_prefill_packs_its_banks_where_bundles_are_large(monkeypatch):
    """Prefill reads each MoE layer whole into one of two banks; where bundles are over PACK_BANK_BYTES (the workload's
    5 MiB; lowered here under the built-in model's) those banks keep the kernel's packed copy too, made as each read
    lands: a prompt's log-probabilities bit for bit those of the banks without it (a copy left stale, or packed
    before the bytes landed, would not)."""
    from mlx_lm.sample_utils import make_sampler

    from edge0.compute import runtime
    from edge0.compute.executors import WholeLayer
    from edge0.config import EngineConfig, IOConfig, KernelConfig, RoutingConfig, ServingConfig
    from edge0.engine import open_engine
    from edge0.io.manifest import read_manifest
    from edge0.model.demo import DEMO_STORE
    from edge0.decode.loop import generate_steps

    ext = kernels.load()
    if ext is None or not ext.packed_on() or ext.impl() != "avx512":
        pytest.skip("the packed layout is the edge0 kernels' AVX-512 VNNI path's")
    ids = list(range(100, 164))
    packed, release = [], WholeLayer.release

    def recorded(self):
        packed.extend(b.packed for b in self.banks)
        release(self)

    monkeypatch.setattr(WholeLayer, "release", recorded)
    out = {}
    for big in (False, True):
        if big:
            monkeypatch.setattr(runtime, "PACK_BANK_BYTES", read_manifest(DEMO_STORE).bundle_bytes - 1)
        c = EngineConfig(routing=RoutingConfig(mode="native", lora="none"), io=IOConfig(executor="staged"),
                         kernel=KernelConfig(name="edge0"), serving=ServingConfig(prompt_cache_gib=0))
        with open_engine(c) as e:
            assert (e.store.runtime.prefill.pack_group_size is not None) == big
            with e.kernel.active():
                steps = generate_steps(e.store.model, ids[:48], max_tokens=16, sampler=make_sampler(0.0),
                                       runtime=e.store.runtime, forced=ids[48:])
                out[big] = np.stack([np.array(lp.astype(mx.float32)) for _, lp in steps])
        assert packed and all(n == (3 if big else 0) for n in packed), packed
        packed.clear()
    assert np.array_equal(out[True], out[False])
    with open_engine(EngineConfig(routing=RoutingConfig(mode="native"), io=IOConfig(executor="staged"),
                                  kernel=KernelConfig(name="edge0", dtype="bfloat16"))) as e:
        assert e.store.runtime.prefill.pack_group_size is None  # MLX's products run bfloat16: a copy none would use
