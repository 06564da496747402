"""Why the adapter stays unmerged: how much of its delta survives merge-and-requantize.

    edge0 train merge --model edge0/model/demo/store --lora edge0/model/demo/store/lora-k4.safetensors

B is the int4 base, U the base with the adapter unmerged (W_int4 + delta), M the merge requantized
(quantize(W_int4 + delta) at the store's bits and group size). The surviving fraction is
1 - |U - M| / |U - B| (Frobenius norms): per projection kind at the weight level, and at the logits of
held-out windows on the student path (routing predicted by the heads, as served). A branch beside an MoE
block (kind moe_block) has no weight to merge into: it is left out of both, and stays in the merged model.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..model.lora import Adapter, adapted, kind_of


def survival(u: mx.array, m: mx.array, b: mx.array) -> float:
    """1 - |U - M| / |U - B|: the share of the step from B to U that the merged M keeps."""
    return 1.0 - mx.linalg.norm((u - m).reshape(-1)).item() / mx.linalg.norm((u - b).reshape(-1)).item()


def requantized(base: mx.array, delta: mx.array, q: nn.QuantizedLinear) -> mx.array:
    """dequantize(quantize(base + delta)) at q's bits, group size and mode."""
    w, scales, biases = mx.quantize(base + delta, group_size=q.group_size, bits=q.bits, mode=q.mode)
    return mx.dequantize(w, scales, biases, group_size=q.group_size, bits=q.bits, mode=q.mode)


def merge_survival(model_dir, lora, *, heads=None, windows: int = 4, seq_len: int = 256) -> dict:
    """Per projection kind the mean (min, max) weight-level survival, and the logit-level survival."""
    from ..model.load import load_store
    from .loop import heldout_windows
    from .student import load_student

    adapter = Adapter.read(lora)
    store = load_store(model_dir, executor="resident")
    kinds: dict[str, list] = {}
    merged = {}  # adapted projection -> its requantized merge, dequantized (out, in)
    try:
        for name, (a, b) in adapter.weights.items():
            _, i, *path = name.split(".")
            if kind_of(".".join(path)) == "moe_block":
                continue
            q = store.model.layers[int(i)]
            for p in path:
                q = q[p]
            base = mx.dequantize(q["weight"], q["scales"], q.get("biases"), group_size=q.group_size, bits=q.bits,
                                 mode=q.mode)
            delta = (adapter.scale * (a @ b)).T.astype(base.dtype)  # (out, in)
            merged[name] = requantized(base, delta, q)
            kinds.setdefault(kind_of(".".join(path)), []).append(survival(base + delta, merged[name], base))
    finally:
        store.close()
    held, _ = heldout_windows(Path(model_dir), None, seq_len, windows)
    tokens = mx.array(held[:, :-1])
    student = load_student(model_dir, heads, adapter.top_k)
    try:
        base_logits = student.logits(tokens)
        student.adapter(adapter)
        unmerged = student.logits(tokens)
        for name, m in adapted(student.model).items():
            if name in merged:  # the merge, served without a branch
                m.base.weight, m.lora_b = merged[name], mx.zeros_like(m.lora_b)
        merged_logits = student.logits(tokens)
    finally:
        student.close()
    return {"weights": {k: {"mean": float(np.mean(v)), "min": float(np.min(v)), "max": float(np.max(v)),
                            "projections": len(v)} for k, v in kinds.items()},
            "logits": survival(unmerged, merged_logits, base_logits), "windows": len(held)}
