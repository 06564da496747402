"""What the graph-building thread leaves to the scheduler's loop: where steps overlap (predicted routing) a step's end
(its last fills planned, its plans not consumed dropped) and the pulled predictions made numpy; one step at a time,
the fills planned at a step's end (the settle after its evaluation waits for the step's end only, the fence moves
after the fills); and a closed engine freed by refcount alone (no cycle through the runtime)."""

import gc
import threading
import weakref

import pytest

from edge0.config import EngineConfig
from edge0.decode.request import GenRequest
from edge0.engine import open_engine
from edge0.model.demo import DEMO_STORE
from edge0.pipeline.prefetch_runtime import PrefetchRuntime
from edge0.sched.loop import SchedLoop
from edge0.sched.scheduler import Scheduler

PROMPT = [5, 17, 42, 7, 99, 3, 12, 64]


def config(mode: str, **more) -> EngineConfig:
    return EngineConfig.of({"model": str(DEMO_STORE), "routing.mode": mode, "io.executor": "staged",
                            "serving.prompt_cache_gib": 0, "io.slots": 24, **more})  # 24: the layers no head
    # routes hold every expert, so predicted routing overlaps steps


def test_an_overlapped_steps_end_and_its_host_ids_are_left_to_the_loop(monkeypatch):
    """The loop never woken: only the graph-building thread's settles run what it was handed, so the order is fixed.
    A step built ahead returns before its end has run (the next layer's settle runs it); the decided routings it
    pulled are not made numpy on its way."""
    monkeypatch.setattr(SchedLoop, "wake", lambda self: None)
    events = []
    built, ended, pulled = PrefetchRuntime.step_built, Scheduler.end_step, PrefetchRuntime._take_pending

    def step_built(rt):
        s = rt.sched.step
        built(rt)
        events.append(("built", s))

    def end_step(sched, step):
        events.append(("end", step))
        ended(sched, step)

    def take_pending(rt):
        ready = pulled(rt)
        fresh = [d for ex in rt.executors.values() for d in ex.decided.values() if d.host is None]
        events.append(("pulled, not on the host", len(fresh)))
        return ready

    monkeypatch.setattr(PrefetchRuntime, "step_built", step_built)
    monkeypatch.setattr(Scheduler, "end_step", end_step)
    monkeypatch.setattr(PrefetchRuntime, "_take_pending", take_pending)
    with open_engine(config("predicted")) as engine:
        engine.generate(GenRequest(prompt=PROMPT, max_tokens=8, ignore_eos=True))
        assert engine.store.runtime.overlaps_steps
    ends = [e for e in events if e[0] in ("built", "end")]
    overlapped = [s for kind, s in ends if kind == "built"]
    assert len(overlapped) >= 4
    for s in overlapped:
        assert ends.index(("built", s)) < ends.index(("end", s))  # ended after step_built returned
    assert any(n for kind, n in events if kind.startswith("pulled"))  # ids made numpy later, on the loop's side


def late_heads(tmp_path):
    """The demo's heads and one for layer 0 owned by the last layer: its prediction is pulled at the step's end."""
    import mlx.core as mx

    from edge0.io.manifest import read_manifest
    from edge0.model.arch import read_config
    from edge0.model.heads import Head, HeadSet

    manifest, cfg = read_manifest(DEMO_STORE), read_config(DEMO_STORE)
    heads = HeadSet.load(DEMO_STORE / "heads-k4.safetensors", manifest, cfg)
    heads.heads[0] = Head(cfg["hidden_size"], manifest.num_experts, manifest.num_experts, heads.hidden)
    heads.owners[0] = manifest.layers[-1].layer
    mx.eval(heads.module().parameters())
    heads.save(tmp_path / "heads-late.safetensors")
    return str(tmp_path / "heads-late.safetensors")


def test_a_flushed_steps_fills_are_left_to_the_loop_and_planned_before_the_fence_moves(monkeypatch, tmp_path):
    """Prefetch routing, one step at a time, a head owned by the last layer (its fills planned at the step's end). The
    loop's thread held up, so every item runs where a settle runs it: the settle after a step's evaluation runs its
    end only, leaving its fills queued; those fills see the fence where it was at the flush (the step's slots still
    protected: the fence moves after them)."""
    heads = late_heads(tmp_path)
    flushing, seen, partial = [False], [], []
    flush, post, settle = PrefetchRuntime.flush, SchedLoop.post, SchedLoop.settle

    def spy_flush(rt):
        flushing[0], at = True, rt.fence.completed
        flush(rt)
        flushing[0] = False
        seen.append(("flush", at))

    def spy_post(loop, what, fn, *args, **kw):
        if flushing[0] and what == "plan":
            fence = rt_box[0].fence
            inner = fn
            fn = lambda *a: (seen.append(("fills", fence.completed)), inner(*a))  # noqa: E731
        post(loop, what, fn, *args, **kw)

    def spy_settle(loop, step=-1, upto=None):
        settle(loop, step, upto)
        if upto is not None:
            partial.append(loop.idle)

    monkeypatch.setattr(PrefetchRuntime, "flush", spy_flush)
    monkeypatch.setattr(SchedLoop, "post", spy_post)
    monkeypatch.setattr(SchedLoop, "settle", spy_settle)
    rt_box = [None]
    held = threading.Event()
    with open_engine(config("prefetch", **{"routing.predictor": "heads", "routing.heads": heads,
                                          "routing.read_ahead": "always", "io.slots": 8})) as engine:
        rt_box[0] = rt = engine.store.runtime
        rt.loop.loop.call_soon_threadsafe(held.wait)  # (a busy machine: the loop's thread not scheduled)
        try:
            engine.generate(GenRequest(prompt=PROMPT, max_tokens=8, ignore_eos=True))
        finally:
            held.set()
    fills = [(seen[i - 1][1], at) for i, (kind, at) in enumerate(seen) if kind == "fills" and seen[i - 1][0] == "flush"]
    assert len(fills) >= 4 and all(at == flushed for flushed, at in fills)  # planned before the fence moved
    assert partial and not any(partial)  # the fills were still queued after the evaluation's settle


@pytest.mark.parametrize("mode", ["prefetch", "predicted"])
def test_a_closed_engine_is_freed_by_refcount_alone(mode):
    engine = open_engine(config(mode))
    try:
        engine.generate(GenRequest(prompt=PROMPT, max_tokens=6, ignore_eos=True))
        rt = engine.store.runtime
        assert isinstance(rt, PrefetchRuntime)
        alive = weakref.ref(rt), weakref.ref(rt.executors[min(rt.executors)]), weakref.ref(engine)
    finally:
        engine.close()
    gc.disable()
    try:
        del engine, rt
        assert [r() is None for r in alive] == [True, True, True]
    finally:
        gc.enable()
