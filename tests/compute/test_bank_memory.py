"""Banks' memory: it starts where O_DIRECT can read into it, and a decode bank's is allocated while the prompt
computes (on the allocation stream), then taken by its first use."""

import mlx.core as mx
import numpy as np
import pytest

from edge0.compute.banks import Bank, Fence
from edge0.io.manifest import read_manifest
from edge0.io.reader import DIRECT_ALIGN, aligned
from edge0.model.demo import DEMO_STORE as DEMO


def test_bank_memory_starts_where_o_direct_can_read_into_it():
    m = read_manifest(DEMO)
    for dtype in (None, mx.float32):  # float32 under MLX's kernels (the tests'): bf16 scales staged, then widened
        bank = Bank(m.pieces, 3, Fence(), dtype)
        assert all(bank.address(p.name) % DIRECT_ALIGN == 0 for p in m.pieces)
    assert any(bank.widen) and all(aligned(bank.write_buffers(s)) for s in range(3))  # every slot's pieces, staged too


def test_a_prepared_bank_takes_the_memory_queued_for_it():
    m = read_manifest(DEMO)
    bank = Bank(m.pieces, 4, Fence())
    bank.prepare()  # queued on the allocation stream: not yet the bank's
    assert bank.prepared and not bank.allocated
    queued = {name: np.frombuffer(memoryview(mx.eval(b) or b), np.uint8).ctypes.data for name, b in bank._bases.items()}
    assert set(queued) == {p.name for p in m.pieces}
    bank.prepare()  # again: nothing more queued
    arrays = bank.arrays
    for p in m.pieces:
        at = bank.address(p.name)
        assert at % DIRECT_ALIGN == 0 and queued[p.name] <= at < queued[p.name] + DIRECT_ALIGN
        assert arrays[p.name].shape == (4, *p.shape) and not np.array(mx.view(arrays[p.name], mx.uint8)).any()
    assert bank.allocated and not bank._bases


def test_the_decode_banks_are_allocated_while_the_prompt_computes(monkeypatch):
    """A prompt read whole layer by layer queues the decode banks' memory after its own banks (build_runtime hands them
    to WholeLayer): by its end every decode bank has its memory, and decode gives the tokens of banks allocated late."""
    from edge0.compute.executors import WholeLayer
    from edge0.config import EngineConfig, IOConfig, RoutingConfig, ServingConfig
    from edge0.engine import open_engine
    from edge0.decode.loop import generate
    from edge0.decode.request import GenRequest

    seen, release = [], WholeLayer.release

    def recorded(self):
        seen.append([b.prepared for b in runtime.banks])
        release(self)

    monkeypatch.setattr(WholeLayer, "release", recorded)
    tokens = {}
    for early in (True, False):
        if not early:
            monkeypatch.setattr(Bank, "prepare", lambda self: None)
        with open_engine(EngineConfig(routing=RoutingConfig(mode="native", lora="none"), io=IOConfig(executor="staged"),
                                      serving=ServingConfig(prompt_cache_gib=0))) as e:
            runtime = e.store.runtime
            assert runtime.banks and not any(b.prepared for b in runtime.banks)
            req = GenRequest(prompt=list(range(100, 164)), max_tokens=12, ignore_eos=True)
            tokens[early] = generate(e, req, lambda _: None, lambda: False).tokens
        assert seen == [[early] * len(runtime.banks)]
        seen.clear()
    assert tokens[True] == tokens[False] and len(tokens[True]) == 12


def test_banks_are_allocated_on_any_thread():
    """MLX's streams belong to the thread that made them: a server allocates its banks on its worker thread, after
    this one made its own allocation stream (the whole serve suite failed with "There is no Stream(cpu, 1) in current
    thread" when one stream was shared); a bank prepared on one thread and first used on another takes fresh memory."""
    from concurrent.futures import ThreadPoolExecutor

    m = read_manifest(DEMO)
    Bank(m.pieces, 2, Fence()).arrays  # this thread's allocation stream exists
    prepared_here = Bank(m.pieces, 2, Fence())
    prepared_here.prepare()

    def on_worker():
        fresh, prepared = Bank(m.pieces, 2, Fence()), Bank(m.pieces, 2, Fence())
        prepared.prepare()
        banks = [fresh, prepared, prepared_here]
        return [all(b.address(p.name) % DIRECT_ALIGN == 0 for p in m.pieces) and
                not any(np.array(mx.view(a, mx.uint8)).any() for a in b.arrays.values()) for b in banks]

    with ThreadPoolExecutor(1) as worker:
        assert worker.submit(on_worker).result() == [True, True, True]


def test_a_prepared_bank_takes_its_packed_copies_made_ahead():
    """A decode bank prepared during the prompt also starts its packed copies' zero memory (the extension's
    reserve_pack, on threads of its own), and its first use takes them: the pages are mapped in while the prompt
    computes, not at that first use. Its products then run on those copies."""
    from tests.helpers import use_kernel

    k = use_kernel("edge0")
    m = read_manifest(DEMO)
    gs = m.quantization["group_size"]
    if k.ext is None or k.ext.reserve_pack(4, 128, 256, gs, False) is None:
        pytest.skip("no packed layout in this build (the VNNI path's)")
    bank = Bank(m.pieces, 4, Fence(), None, pack_group_size=gs)
    bank.prepare()
    made = {proj: r.address() for proj, r in bank._reserved.items()}
    assert set(made) == {"gate_proj", "up_proj", "down_proj"} and all(made.values())
    reserved = dict(bank._reserved)
    bank.prepare()  # again (each prompt layer asks): nothing more started
    assert bank._reserved == reserved
    arrays = bank.arrays
    assert bank.packed == 3 and not bank._reserved
    for proj, at in made.items():
        triple = [arrays[f"{proj}.{part}"] for part in ("weight", "scales", "biases")]
        assert k.ext.packed_address(*triple, gs) == at


def test_a_bank_with_no_memory_to_queue_starts_its_packed_copies_once(monkeypatch):
    """Where no piece's slot is a whole number of O_DIRECT blocks, prepare queues no memory: it still starts the
    packed copies once, not again at every prompt layer that asks (each start is a thread and a copy)."""
    from edge0.compute import banks
    from tests.helpers import use_kernel

    k = use_kernel("edge0")
    m = read_manifest(DEMO)
    gs = m.quantization["group_size"]
    if k.ext is None or k.ext.reserve_pack(4, 128, 256, gs, False) is None:
        pytest.skip("no packed layout in this build (the VNNI path's)")
    monkeypatch.setattr(banks, "alignable", lambda shape, dtype: False)
    bank = Bank(m.pieces, 4, Fence(), None, pack_group_size=gs)
    bank.prepare()
    reserved = dict(bank._reserved)
    assert reserved and not bank._bases
    bank.prepare()
    assert bank._reserved == reserved
    assert bank.packed == 0 and bank.arrays and bank.packed == 3 and not bank._reserved
