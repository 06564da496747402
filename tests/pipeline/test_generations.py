"""Generation after generation on one runtime, as serve and chat run them: each is token for token what its
prompt gives first in a freshly opened store (greedy), under the default routing (the demo store ships
heads: predicted) and the others; a generation that fails mid-way leaves the next one exact."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from edge0.compute import kernels
from edge0.config import EngineConfig
from edge0.engine import open_engine
from edge0.io.reader import BundleReader
from edge0.decode.loop import generate_steps

STEPS = 8
GREEDY = make_sampler(temp=0.0)
LONG = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint("
OTHER = "import os\nimport sys\n" * 6
SHORT = "x = [1, 2"
CONFIGS = {  # EngineConfig settings by path; {} is what `edge0 run` does with no flag
    "default": {},  # predicted routing; every expert of the demo fits: resident (auto)
    "predicted-staged": {"routing.mode": "predicted", "io.executor": "staged"},
    # layers 0, 1, 5 hold their experts, the heads route 2-4: no layer syncs, decode overlaps its steps
    "predicted-staged-held": {"routing.mode": "predicted", "io.executor": "staged", "io.slots": 20},
    "prefetch": {"routing.mode": "prefetch"},
    "native": {"routing.mode": "native"},  # every expert of the demo fits: resident (auto)
    "native-staged": {"routing.mode": "native", "io.executor": "staged"},
    "native-hot": {"routing.mode": "native", "io.executor": "hot"},
    "native-exact": {"routing.mode": "native", "io.executor": "exact"},
}
_fresh: dict = {}


def open_demo(config: dict, model=None):
    return open_engine(EngineConfig.of({"model": model, **config}))


def generate(engine, ids: list[int], sampler=GREEDY, steps: int = STEPS, stop_after: int | None = None) -> list[int]:
    out = []
    with engine.kernel.active():
        for t, _ in generate_steps(engine.store.model, ids, max_tokens=steps, sampler=sampler,
                                   runtime=engine.store.runtime):
            out.append(t)
            if len(out) == stop_after:
                break
    return out


def fresh(config: dict, ids: list[int]) -> list[int]:
    """The tokens of `ids` as the first generation of a newly opened store."""
    key = (repr(sorted(config.items())), tuple(ids))
    if key not in _fresh:
        with open_demo(config) as engine:
            _fresh[key] = generate(engine, ids)
    return _fresh[key]


def prompts(engine) -> dict[str, list[int]]:
    enc = engine.encode_text
    long, other, short = enc(LONG), enc(OTHER), enc(SHORT)
    e = engine.store.manifest.num_experts
    assert len(long) > e and len(other) > e and 2 < len(short) < e  # whole-layer prefill and slotted prefill
    return {"long": long, "short": short, "other": other, "one": long[:1], "two": short[:2], "long again": long,
            "one other": other[:1]}


def caches(runtime) -> list:
    """(cache, its layer, E, shared) for every slot cache of the runtime; a shared (hot) cache's keys are
    layer * E + expert."""
    seen, out = set(), []
    for ex in runtime.executors.values():
        cache = getattr(ex, "cache", None)
        if cache is not None and id(cache) not in seen:
            seen.add(id(cache))
            out.append((cache, ex.layer, ex.num_experts, runtime.executor == "hot"))
    return out


def assert_clean(engine) -> None:
    """Nothing in flight or pending, every slot writable, and every held slot holds its whole bundle."""
    rt = engine.store.runtime
    sched = getattr(rt, "sched", None)
    if sched is not None:
        assert sched.pending == 0 and sched.plans == {} and sched.in_flight == 0
    if rt.prefill is not None:
        assert rt.prefill.pending == {}
    assert all(b.writable for b in rt.banks)
    reader = BundleReader(engine.store.path, probe=False)
    pieces = reader.manifest.pieces
    try:
        for cache, layer, e, shared in caches(rt):
            bank = cache.bank
            assert not cache.filling.any()
            held = np.flatnonzero(bank.holds >= 0)
            assert (cache.slot_of >= 0).sum() == len(held)
            assert (cache.slot_of[bank.holds[held]] == held).all()  # lookups find exactly the held slots
            for slot in held.tolist():
                key = int(bank.holds[slot])
                want = [bytearray(p.nbytes) for p in pieces]
                reader.read_into(key // e if shared else layer, key % e, want)
                assert slot_bytes(bank, slot) == [bytes(w) for w in want], (layer, key, slot)
    finally:
        reader.close()


def slot_bytes(bank, slot: int) -> list[bytes]:
    """The stored bytes a bank slot holds, per piece (bf16 pieces widened to float32 narrowed back; bf16 pieces
    kept as stored, under the edge0 kernel, read as their 16-bit words)."""
    out = []
    for p, widened in zip(bank.pieces, bank.widen):
        a = bank.arrays[p.name][slot]
        a = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
        out.append((a.view(np.uint32) >> 16).astype(np.uint16).tobytes() if widened else a.tobytes())
    return out


def raising_at(call: int):
    """A greedy sampler that raises at its call-th call (a step whose graph is built but not evaluated)."""
    calls = 0

    def sampler(logprobs):
        nonlocal calls
        calls += 1
        if calls == call:
            raise Boom(f"sampler call {call}")
        return GREEDY(logprobs)

    return sampler


class Boom(Exception):
    pass


KERNELS = ["mlx"] + (["edge0"] if kernels.available() else [])


@pytest.mark.parametrize("name", list(CONFIGS) + [f"default-{k}" for k in KERNELS if k != "mlx"])
def test_generation_after_generation_equals_a_fresh_store(name):
    config = CONFIGS.get(name, {}) | ({"kernel.name": name.split("-")[1]} if name.startswith("default-") else {})
    with open_demo(config) as engine:
        if name.startswith("default"):
            assert engine.config.routing.mode == "predicted" and engine.config.routing.predictor == "heads"
        for what, ids in prompts(engine).items():
            assert generate(engine, ids) == fresh(config, ids), what
            assert_clean(engine)
        # a generation its caller stops early (EOS, a stop string, a cancelled request), then a full one
        long = engine.encode_text(LONG)
        assert generate(engine, engine.encode_text(OTHER), stop_after=3) == fresh(config, engine.encode_text(OTHER))[:3]
        assert generate(engine, long) == fresh(config, long)
        assert_clean(engine)


@pytest.mark.parametrize("name", ["default", "predicted-staged", "prefetch", "native", "native-staged", "native-hot"])
def test_a_generation_that_raises_leaves_the_next_one_exact(name):
    config = CONFIGS[name]
    with open_demo(config) as engine:
        p = prompts(engine)
        assert generate(engine, p["long"]) == fresh(config, p["long"])
        for ids, call in ((p["other"], 3), (p["one"], 1), (p["short"], 5)):
            with pytest.raises(Boom):
                generate(engine, ids, sampler=raising_at(call))
            assert_clean(engine)
            assert generate(engine, ids) == fresh(config, ids)
        assert generate(engine, p["long"]) == fresh(config, p["long"])


def test_a_paused_generation_cannot_resume_after_another_began():
    with open_demo({}) as engine:
        p = prompts(engine)
        rt = engine.store.runtime
        with engine.kernel.active():
            first = generate_steps(engine.store.model, p["long"], max_tokens=STEPS, sampler=GREEDY, runtime=rt)
            next(first)
            assert generate(engine, p["other"]) == fresh({}, p["other"])
            with pytest.raises(RuntimeError, match="another generation began"):
                next(first)
        assert generate(engine, p["long"]) == fresh({}, p["long"])
        assert_clean(engine)
