"""Injected read faults (edge0/io/faults.py): EIO, a short read, a layer file vanishing. `edge0 run` fails
with one line; inside a runtime, the failed generation leaves no half-written slot and nothing pending,
and the next generation is the one a clean store gives."""

import os
import shutil
import subprocess
import sys

import pytest

from edge0.errors import Edge0Error
from edge0.io import faults
from edge0.io.reader import BundleReader
from edge0.model.demo import DEMO_STORE

from tests.pipeline.test_generations import CONFIGS, assert_clean, caches, fresh, generate, open_demo, prompts

BUNDLE = 55296  # the demo store's bundle bytes


def test_the_hook_costs_nothing_when_unset_and_rejects_bad_specs(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    reader = BundleReader(DEMO_STORE, probe=False)
    assert "_transfer" not in vars(reader)  # the plain read, nothing wrapped
    reader.close()
    assert faults.parse("eio@5,short@9, vanish@1") == {5: "eio", 9: "short", 1: "vanish"}
    for bad in ("eio", "eio@0", "crash@3", "eio@x", "", "eio@\u00b2", "eio@" + "9" * 5000):  # isdigit, not int()
        with pytest.raises(Edge0Error, match=f"{faults.ENV}={bad}: expected KIND@N"):
            faults.parse(bad)
    monkeypatch.setenv(faults.ENV, "short@2")
    reader = BundleReader(DEMO_STORE, probe=False)
    buf = [bytearray(BUNDLE)]
    reader.read_into(0, 3, buf)
    with pytest.raises(Edge0Error) as err:
        reader.read_into(0, 4, buf)
    assert str(err.value) == (f"{DEMO_STORE}/experts/layer_000.safetensors: short read of expert 4: expected {BUNDLE} "
                              f"bytes, got {BUNDLE // 2} (the file is {reader.manifest.layers[0].file_size} bytes now, "
                              f"the manifest says {reader.manifest.layers[0].file_size})")
    reader.read_into(0, 4, buf)  # each fault fires once
    reader.close()


def failed_key(engine, fault) -> tuple[object, int] | None:
    """The slot cache and key a fired fault's read was filling, if it was a slot fill."""
    _, _, layer, offset = fault.fired[0]
    entry = next(e for e in engine.store.manifest.layers if e.layer == layer)
    expert = (offset - entry.data_offset) // engine.store.manifest.bundle_stride
    for cache, at, e, shared in caches(engine.store.runtime):
        if at == layer or shared:
            return cache, layer * e + expert if shared else expert
    return None


@pytest.mark.parametrize("name", ["predicted-staged", "predicted-staged-held", "prefetch", "native-staged",
                                  "native-hot", "native-exact"])
@pytest.mark.parametrize("spec", ["eio@2", "short@2", "eio@3"])
def test_a_fault_inside_a_generation_leaves_the_next_one_exact(name, spec):
    """eio@2, short@2: a slot fill of a one-token prompt (decode reads); eio@3: a whole-layer prefill read
    of a long prompt (or a slot/exact read where there is none)."""
    config = CONFIGS[name]
    with open_demo(config) as engine:
        p = prompts(engine)
        assert generate(engine, p["long"]) == fresh(config, p["long"])
        ids = p["one other"] if spec.endswith("@2") else p["other"]
        fault = faults.inject(engine.store.reader, spec)
        with pytest.raises(Edge0Error) as err:
            generate(engine, ids)
        assert fault.fired and fault.fired[0][1] == spec.split("@")[0]
        layer = fault.fired[0][2]
        assert str(err.value).startswith(f"{engine.store.path}/experts/layer_{layer:03d}.safetensors: ")
        assert ("failed (Input/output error)" if spec.startswith("eio") else
                f"expected {BUNDLE} bytes, got {BUNDLE // 2}") in str(err.value)
        assert "expert" in str(err.value)
        assert_clean(engine)  # nothing pending; every held slot holds its whole bundle
        held = failed_key(engine, fault)
        if held is not None and spec.endswith("@2"):
            cache, key = held
            assert cache.slot_of[key] == -1 and key not in cache.bank.holds  # the half-written slot is empty
        assert generate(engine, ids) == fresh(config, ids)
        assert generate(engine, p["long"]) == fresh(config, p["long"])


def test_a_vanished_layer_file_is_one_error_each_time(tmp_path):
    store = shutil.copytree(DEMO_STORE, tmp_path / "store")
    with open_demo(CONFIGS["predicted-staged"], model=str(store)) as engine:
        p = prompts(engine)
        fault = faults.inject(engine.store.reader, "vanish@2")
        with pytest.raises(Edge0Error, match=r"short read of expert \d+: expected 55296 bytes, got 0 \(the file is "
                                             r"0 bytes now"):
            generate(engine, p["one"])
        layer = fault.fired[0][2]
        assert not (store / "experts" / f"layer_{layer:03d}.safetensors").exists()
        assert_clean_but_vanished(engine, layer)
        with pytest.raises(Edge0Error, match=f"layer_{layer:03d}.safetensors: "):  # the same line, not a jam
            generate(engine, p["long"])


def assert_clean_but_vanished(engine, layer: int) -> None:
    rt = engine.store.runtime
    assert rt.sched.pending == 0 and rt.sched.plans == {} and rt.prefill.pending == {}
    assert all(b.writable for b in rt.banks)
    assert not any(c.filling.any() for c, *_ in caches(rt))


def run_cli(*flags, fault: str, model=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{faults.ENV: fault})
    cmd = [sys.executable, "-m", "edge0.run", "--max-tokens", "8", *flags] + (["--model", str(model)] if model else [])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("flags,fault", [
    ((), "eio@2"),  # the default: predicted routing, every expert resident (the demo's fit): a read at open
    (("--routing", "predicted", "--executor", "staged"), "eio@3"),  # a whole-layer prefill read on the worker thread
    (("--routing", "predicted", "--executor", "staged"), "short@9"),  # a slot fill
    (("--routing", "native"), "eio@2"),  # every expert resident (the demo's fit): a read while the store opens
    (("--routing", "native", "--executor", "staged"), "eio@9"),
    (("--routing", "native", "--executor", "exact"), "short@5"),
    (("--routing", "native", "--executor", "hot"), "eio@9"),
    (("--routing", "prefetch"), "vanish@9"),
])
def test_run_fails_with_one_line(tmp_path, flags, fault):
    model = shutil.copytree(DEMO_STORE, tmp_path / "store") if fault.startswith("vanish") else None
    proc = run_cli(*flags, fault=fault, model=model)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("edge0: error: ")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception" not in proc.stderr, proc.stderr
    assert "/experts/layer_00" in errors[0] and ".safetensors: " in errors[0] and "expert" in errors[0]
    kind = fault.split("@")[0]
    assert {"eio": "failed (Input/output error)", "short": f"got {BUNDLE // 2} ", "vanish": "got 0 "}[kind] in errors[0]
