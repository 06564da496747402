"""Prefetch reads ahead only while reads come from the disk: on a warm store its layers stop predicting
after PAUSE_AFTER steps whose reads all came from the page cache (and it still equals native), a read
from the disk (the store evicted mid-generation with posix_fadvise) brings the predictions back at the
next step, and with --io-throttle (every read costs) it never pauses. Under predicted routing only the reads
ahead pause: the heads that route keep deciding."""

import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from edge0.config import EngineConfig
from edge0.engine import open_engine
from edge0.io.pagecache import Residency, evict
from edge0.model.demo import DEMO_STORE
from edge0.pipeline.gate import CertainReads, ReadAheadGate
from edge0.pipeline.prefetch_runtime import PrefetchRuntime
from edge0.decode.loop import generate_steps

from .test_identity import real_text

TOKENS = 48
EVICT_AT = 24  # decode step at which the store leaves the page cache


@functools.cache
def private_store() -> Path:
    """A copy of the demo store that this test process alone reads. These tests pin its pages in the page cache or
    evict them; on the shared store a test running beside them (pytest-xdist's other worker) reads the pages back
    between an eviction and the reads that were to find them cold, or holds them mapped against an eviction."""
    root = Path(tempfile.mkdtemp(prefix="edge0-page-cache-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    store = Path(shutil.copytree(DEMO_STORE, root / "store"))
    for f in store.rglob("*"):  # written back: posix_fadvise cannot evict dirty pages
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return store


def private_config(settings: dict) -> EngineConfig:
    """An engine on the private copy of the demo store."""
    return EngineConfig.of({"model": str(private_store()), **settings})


def expert_files():
    return sorted((private_store() / "experts").glob("*.safetensors"))


def ahead(rt) -> int:
    """Fills the scheduler read ahead (not on demand)."""
    return rt.sched.stats.loads - rt.sched.stats.demand_loads


def warm_store():
    for f in expert_files():
        f.read_bytes()


@contextlib.contextmanager
def pinned_store():
    """The store's expert files held in the page cache (mlock on a mapping) until the block ends. With the page
    cache full of pages touched twice, the kernel reclaimed the store's once-read pages mid-run, and one read from
    the disk resumes predicting (a fresh-clone CI run failed so). Where mlock is refused (RLIMIT_MEMLOCK, not
    root) the files are only read, as before."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mlock.argtypes = libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    maps = []
    try:
        for f in expert_files():
            fd = os.open(f, os.O_RDONLY)
            try:
                maps.append(Residency(fd, os.fstat(fd).st_size))  # a read-only shared mapping of the file
            finally:
                os.close(fd)
            if libc.mlock(maps[-1].addr, maps[-1].size) != 0:
                f.read_bytes()
        yield
    finally:
        for m in maps:
            libc.munlock(m.addr, m.size)
            m.close()


def forced(engine, ids, at_step=None):
    """Forced decoding of ids as engine.forced_logprobs does it; at_step(i, runtime) runs before step i."""
    rt = engine.store.runtime
    with engine.kernel.active():
        steps = generate_steps(engine.store.model, ids[:1], max_tokens=len(ids) - 1, sampler=make_sampler(0.0),
                               runtime=rt, forced=ids[1:])
        out = []
        for i, (_, lp) in enumerate(steps):
            out.append(np.array(lp.astype(mx.float32)))
            if at_step is not None:
                at_step(i + 1, rt)
    return np.stack(out)


def native_reference(n: int):
    """n tokens of real text and native routing's log-probabilities on them (the store warm)."""
    ids = real_text(n)
    warm_store()
    with open_engine(private_config({"routing.mode": "native", "io.executor": "staged"})) as engine:
        return ids, forced(engine, ids)


@pytest.fixture(scope="module")
def text():
    return native_reference(TOKENS)


@pytest.fixture
def ahead_first(monkeypatch):
    """The read-ahead gate's first steps read ahead (its default: paused, tests/pipeline/test_gate.py), so that what
    pauses them here is the page cache's rule, which these tests are about."""
    monkeypatch.setattr(ReadAheadGate, "FIRST_AHEAD", True)


def test_warm_store_pauses_prefetch_and_still_equals_native(text, ahead_first):
    ids, want = text
    with pinned_store(), open_engine(private_config({"routing.mode": "prefetch",
                                                     "routing.predictor": "heads"})) as engine:
        rt = engine.store.runtime
        demand, calls = rt.sched.demand_begin, []
        rt.sched.demand_begin = lambda *a: calls.append(rt.sched.step) or demand(*a)
        got = forced(engine, ids)
        predicted = rt.sched.stats.routed
    assert np.array_equal(got, want)
    steps = len(ids) - 1  # step 0 takes the first token; the first PAUSE_AFTER steps predict, the others not
    assert rt.paused_steps == steps - PrefetchRuntime.PAUSE_AFTER
    assert predicted > 0
    # paused, a layer is the staged executor on the same bank: the scheduler is not asked (its Python costs more
    # than a warm read); the step after the pause began may still consume what was planned before it
    assert calls and max(calls) <= PrefetchRuntime.PAUSE_AFTER + 1


def test_paused_steps_open_no_scheduler_span(text, ahead_first):
    """A paused step predicts nothing: neither its layers nor its boundary (flush, next_step) enter the scheduler, so
    on a warm store the scheduler's spans stop with the pause (they timed empty work at every step before)."""
    ids, want = text
    with pinned_store(), open_engine(private_config({"routing.mode": "prefetch",
                                                     "routing.predictor": "heads"})) as engine:
        rt = engine.store.runtime
        spans, enter = [], type(rt).scheduling
        rt.scheduling = lambda layer: spans.append(rt.sched.step) or enter(rt, layer)
        got = forced(engine, ids)
    assert np.array_equal(got, want)
    assert spans and max(spans) <= PrefetchRuntime.PAUSE_AFTER + 1


def test_a_read_from_the_disk_resumes_predicting(text, ahead_first):
    ids, want = text
    seen = {}
    pin = contextlib.ExitStack()

    def at_step(i, rt):
        if i == EVICT_AT:
            seen["paused"], seen["ahead"] = rt.paused, ahead(rt)
            pin.close()
            for f in expert_files():
                evict(f)
        if i == EVICT_AT + 2:
            seen["after"] = rt.paused

    with pin:
        pin.enter_context(pinned_store())
        with open_engine(private_config({"routing.mode": "prefetch", "routing.predictor": "heads"})) as engine:
            got = forced(engine, ids, at_step)
            after, cold = ahead(engine.store.runtime), engine.store.reader.pool.stats.cold_bytes
    assert np.array_equal(got, want)
    assert seen["paused"] is True and seen["after"] is False  # the cold demand reads of step EVICT_AT + 1
    assert cold > 0 and after > seen["ahead"]  # it read ahead again


@pytest.mark.parametrize("read_ahead", ["measured", "always"])
def test_the_page_cache_never_pauses_where_reads_cost(text, read_ahead):
    """Under --io-throttle every read costs: the page cache's rule never pauses; a pause there is the gate's
    (reading ahead measured slower, tests/pipeline/test_gate.py), and --read-ahead always has none."""
    ids, _ = text
    warm_store()
    with open_engine(private_config({"routing.mode": "prefetch", "routing.predictor": "heads", "io.throttle_mbps": 200,
                                     "routing.read_ahead": read_ahead})) as engine:
        forced(engine, ids)
        rt = engine.store.runtime
    assert rt.paused_steps == rt.gated_steps
    if read_ahead == "always":
        assert rt.paused_steps == 0


def test_predicted_routing_pauses_only_its_reads_ahead(text, ahead_first):
    """Under predicted routing a warm store pauses the next-router reads ahead (layers without a routing head),
    never the heads that route: the output is bit for bit that of a run that never pauses, every routed set at a
    consumer layer is the one its head decided, and the heads' predictions are pulled once, at the step's end.
    Paused, a layer that routes with its own router is the staged executor, its head (if it owns one) still
    predicting: the scheduler is never asked for its reads."""
    ids, _ = text
    runs, after = {}, PrefetchRuntime.PAUSE_AFTER
    for pause, read_ahead in ((after, "measured"), (10**9, "always")):
        # held, not only read: a page reclaimed mid-run resumed the reads ahead and paused them again later (a
        # full-suite run beside a training job failed so)
        with pinned_store(), open_engine(private_config({"routing.mode": "predicted", "io.executor": "staged",
                                                         "routing.read_ahead": read_ahead})) as engine:
            rt = engine.store.runtime
            pull, pulls = rt.pull, []
            rt.pull = lambda: pulls.append(rt.sched.step) or pull()
            demand, missed, asked = rt.sched.demand_begin, [], []  # (layer, step) of every demand read; every call

            def recording(layer, cache, want):
                asked.append((layer, rt.paused, rt.sched.step))
                got = demand(layer, cache, want)
                if got is not None and got[1] is not None:
                    missed.append((layer, rt.sched.step))
                return got

            rt.sched.demand_begin = recording
            got = forced(engine, ids)
            consumers = set(rt.heads.owners)
            runs[pause] = got, rt.paused_steps, len(pulls), [m for m in missed if m[0] in consumers and m[1] > 0]
            first = min((st for _, p, st in asked if p), default=0)  # its reads planned before the pause land
            native = {layer for layer, p, st in asked if p and st > first and layer not in consumers}
            owners = set(rt.heads.owners.values()) - consumers
            if pause == after:  # (layer 1 owns layer 2's head and routes itself: it was asked every paused step)
                assert owners and not native
            else:
                assert owners <= {layer for layer, *_ in asked}
    (paused, n_paused, pulls, missed), (never, n_never, pulls_never, _) = runs.values()
    assert np.array_equal(paused, never)
    steps = len(ids) - 1
    assert 0 < n_paused <= steps - after and n_never == 0  # (a page the kernel drops mid-run resets the count)
    assert not missed  # consumer layers read what their heads decided, ahead (step 0 routes natively)
    assert pulls < pulls_never  # paused: one pull at the step's end (flush, next_step), none per layer


@pytest.mark.parametrize("cached", [True, False], ids=["warm", "evicted"])
def test_the_prompts_reads_decide_the_first_steps(text, ahead_first, cached):
    """A prompt read wholly from the page cache pauses the reads ahead from the first decode step (it read what
    PAUSE_AFTER warm steps would have shown); read from the disk, the first steps predict. Same tokens either way."""
    ids, want = text
    with contextlib.ExitStack() as pin:
        if cached:  # held, not only read: a once-read page reclaimed mid-run made a warm run read from the disk
            pin.enter_context(pinned_store())
        else:
            warm_store()
            for f in expert_files():
                evict(f)
        with open_engine(private_config({"routing.mode": "prefetch", "routing.predictor": "heads"})) as engine:
            rt = engine.store.runtime
            with engine.kernel.active():
                steps = generate_steps(engine.store.model, ids[:16], max_tokens=len(ids) - 16,
                                       sampler=make_sampler(0.0), runtime=rt, forced=ids[16:])
                got = np.stack([np.array(lp.astype(mx.float32)) for _, lp in steps])
            cold = engine.store.reader.stats.cold_bytes
    assert np.array_equal(got, want[15:])  # the same log-probabilities as native from the 16th token on
    n = len(ids) - 16
    if cached:
        assert cold == 0 and rt.paused_steps == n
    else:
        assert cold > 0 and rt.paused_steps <= n - PrefetchRuntime.PAUSE_AFTER


@pytest.mark.parametrize("big", [False, True], ids=["50KB-bundles", "bundles-over-the-bar"])
def test_a_warm_store_pauses_certain_reads_only_of_small_bundles(text, big, monkeypatch):
    """Predicted routing with every layer routed by its head or held (--slots 20: CertainReads) reads nothing it
    would not: a warm page cache pauses it (one pull a step) where a bundle is a cheap copy (the demo's 50 KB), never
    where a bundle's copy is worth hiding (the bar lowered under the demo's bundles to stand for 5 MiB ones). The same
    log-probabilities either way."""
    ids, _ = text
    if big:
        monkeypatch.setattr(CertainReads, "WARM_PAUSE_BYTES", 1024)
    with pinned_store(), open_engine(private_config({"routing.mode": "predicted", "io.executor": "staged",
                                                     "io.slots": 20})) as engine:
        rt = engine.store.runtime
        assert isinstance(rt.gate, CertainReads) and rt.gate.warm_pause == (not big)
        assert "each read ahead is one its step makes anyway" in rt.gate.summary()["why"]  # --json says why
        got = forced(engine, ids)
        n, cold = rt.paused_steps, engine.store.reader.stats.cold_bytes
    assert cold == 0
    assert (n == 0) if big else (n >= len(ids) - 1 - PrefetchRuntime.PAUSE_AFTER)
    with open_engine(private_config({"routing.mode": "predicted", "io.executor": "staged", "io.slots": 20,
                                     "routing.read_ahead": "always"})) as engine:
        assert np.array_equal(got, forced(engine, ids))
