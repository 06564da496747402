"""tools/lab/adapter_ab.py alternates the served adapter, a float32 one and none in one process, and leaves the served one."""

import importlib.util
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from edge0.compute import kernels

pytestmark = pytest.mark.lab  # a finished study's tool: run with -m lab
LAB = Path(__file__).parents[2] / "tools" / "lab"
spec = importlib.util.spec_from_file_location("adapter_ab", LAB / "adapter_ab.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.skipif(not kernels.available(), reason=f"edge0 CPU kernels {kernels.reason()}")
def test_adapter_ab_prints_the_three_arms_and_leaves_the_served_adapter(monkeypatch, capsys):
    from edge0.engine import resolve
    from edge0.config import EngineConfig
    from edge0.model.lora import Adapter, LoRABranch, LoRALinear, adapted

    import edge0.model.lora as lora

    swaps, real_set = [], lora.put_projection

    def spy(model, key, module):  # what each swap puts in: an adapter's dtype, or "bare" (no adapter)
        swaps.append(str(module["lora_a"].dtype) if isinstance(module, (LoRALinear, LoRABranch)) else "bare")
        real_set(model, key, module)
        spy.model = model

    monkeypatch.setattr(lora, "put_projection", spy)
    monkeypatch.setattr(sys, "argv", ["adapter_ab.py", "--rounds", "1", "--prompt-tokens", "24", "--max-tokens", "4"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    for what in ("prefill", "decode"):
        assert re.search(rf"{what}: bfloat16 [\d.]+ tok/s \([\d.]+x none\), float32 [\d.]+ tok/s \([\d.]+x none\), "
                         rf"none [\d.]+ tok/s \(1.000x none\)", out), out
    assert set(swaps) == {"mlx.core.bfloat16", "mlx.core.float32", "bare"}, swaps
    left = adapted(spy.model)
    served = Adapter.read(resolve(EngineConfig()).routing.lora).weights  # the built-in model's default adapter
    assert set(left) == set(served) and {m["lora_a"].dtype for m in left.values()} == {mx.bfloat16}  # put back


def test_adapter_ab_refuses_zero_rounds(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["adapter_ab.py", "--rounds", "0"])
    with pytest.raises(SystemExit):
        tool.main()
