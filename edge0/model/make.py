"""Write random-weight MoE checkpoints that mlx-lm loads offline, for tests and benchmarks.

    edge0 make-model --arch qwen3_moe --preset tiny /tmp/m
    edge0 make-model --arch qwen3_5_moe --preset small --format hf --seed 1 /tmp/m-hf

    from edge0.model.make import make_model
    make_model("bailing_moe", "tiny", "/tmp/ling-tiny")

Formats: "mlx" is what `mlx_lm.convert(..., quantize=True)` writes (4-bit, group 64, routers
8-bit as the model's quant_predicate says, bf16 scales and non-quantized tensors); "hf" is an
unquantized bf16 checkpoint with the Hugging Face names that mlx-lm's `sanitize` expects.
Both derive from the same float weights: mlx == quantize(hf), tensor for tensor, for a given
(arch, preset, seed). Every tensor is generated from its own seed (seed, name), one at a time,
and written shard by shard, so memory stays at about one shard whatever the model size.
paper-35b (about 19 GB) writes its routed experts as random packed 4-bit words directly.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0.errors import Edge0Error
from edge0.io.atomic import atomic_dir
from edge0.io.outputs import MADE_MODEL_KIND, check_dir_out
from edge0.model.make_configs import ARCHS, BESPOKE, FORMATS, LINEAR_STD, PRESETS, check, model_config  # noqa: F401
from edge0.model.make_hf import bar, hf_plan, shards, write_hf
from edge0.model.tokenizer import save_tokenizer

GROUP_SIZE = 64  # affine quantization group, as mlx_lm.convert's default
BITS = 4
MLX_SHARD_BYTES = 5 << 30  # mlx_lm.utils.MAX_FILE_SIZE_GB
HF_SHARD_BYTES = 2 << 30  # tests lower it to get several shards
EXPERT_BIAS_RANGE = 0.1  # bailing expert_bias ~ U(-0.1, 0.1): moves sigmoid scores of std ~0.2
DIRECT_PRESETS = ("paper-35b", "olmoe-1b-7b", "qwen3-30b-a3b")  # presets whose routed experts skip float generation

def make_model(
    arch: str,
    preset: str,
    out: str | Path,
    *,
    fmt: str = "mlx",
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Write a random-weight checkpoint of `arch` at `preset` into the directory `out`.

    fmt: "mlx" (4-bit, as mlx_lm.convert -q writes it) or "hf" (bf16, Hugging Face names).
    seed: the same (arch, preset, fmt, seed) gives byte-identical files.
    force: replace an earlier make-model output at `out` (never other files), once the new one is complete.
    Builds into a temporary sibling of `out` and renames it into place at the end (edge0.io.atomic).
    """
    check(arch, preset, fmt)
    if not isinstance(seed, int) or seed < 0:
        raise Edge0Error(f"Seed must be a non-negative integer, not {seed!r}.")
    if fmt == "hf" and preset in DIRECT_PRESETS:
        gb = planned_bytes(arch, preset, "hf") / 1e9
        raise Edge0Error(f"Preset {preset} in hf format would take {gb:.0f} GB of bf16; make it with format mlx.")
    out = Path(out)
    check_dir_out(out, force, MADE_MODEL_KIND)
    with atomic_dir(out, replace=force, needed=planned_bytes(arch, preset, fmt)) as tmp:
        spec = _Spec(arch, preset, seed)
        _write_mlx(spec, tmp, progress) if fmt == "mlx" else write_hf(spec, tmp, progress, HF_SHARD_BYTES)
        save_tokenizer(tmp)
        # the marker --force looks for: only an earlier make-model output is ever replaced
        marker = {"arch": arch, "preset": preset, "format": fmt, "seed": seed}
        (tmp / MADE_MODEL_KIND.sign).write_text(json.dumps(marker, indent=1) + "\n")
    return out


def planned_tensors(arch: str, preset: str, fmt: str = "mlx") -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors make_model would write, {name: (shape, dtype)}, without generating any."""
    check(arch, preset, fmt)
    spec = _Spec(arch, preset, 0)
    if fmt == "mlx":
        names = _quantized(spec)[0]
        return {k: (tuple(v.shape), str(v.dtype).removeprefix("mlx.core.")) for k, v in names.items()}
    return {k: (shape, str(dtype).removeprefix("mlx.core.")) for k, shape, dtype, _ in hf_plan(spec)}


def planned_bytes(arch: str, preset: str, fmt: str = "mlx") -> int:
    """Total bytes of the weights make_model would write (safetensors headers aside)."""
    total = 0
    for shape, dtype in planned_tensors(arch, preset, fmt).values():
        total += math.prod(shape) * getattr(mx, dtype).size
    return total


class _Spec:
    """The model class instantiated lazily (its own random init is never evaluated) plus our init rules."""

    def __init__(self, arch: str, preset: str, seed: int):
        from mlx.utils import tree_flatten, tree_map_with_path
        from mlx_lm.utils import _get_classes

        self.arch, self.preset, self.seed = arch, preset, seed
        self.config = model_config(arch, preset)
        model_class, args_class = _get_classes(self.config)
        # from_dict may edit nested dicts (qwen3_5 renames rope_type): give it a copy.
        self.model = model_class(args_class.from_dict(copy.deepcopy(self.config)))
        cast = getattr(self.model, "cast_predicate", lambda _: True)
        # As mlx_lm.convert with torch_dtype bfloat16 (lazy: only the dtypes of the plan change).
        self.model.update(tree_map_with_path(lambda k, v: v.astype(mx.bfloat16) if cast(k) else v,
                                             self.model.parameters()))
        # The float tensors, mlx names after sanitize, in the model's order: {name: (shape, dtype)}.
        self.floats = {k: (tuple(v.shape), v.dtype) for k, v in tree_flatten(self.model.parameters())}
        fields = self.config.get("text_config", self.config)
        self.hidden = fields.get("hidden_size") or fields["model_dim"]
        self.direct_experts = preset in DIRECT_PRESETS
        self.routers, self.selection_biases, self.experts = _router_names(self.model, arch)

        # hf slices one stacked expert tensor E times, and fuses gate with up: keep the last two.
        self.float = functools.lru_cache(maxsize=2)(self._float)

    def _float(self, name: str) -> mx.array:
        """The float tensor `name` (an mlx parameter path), from its own seed."""
        shape, dtype = self.floats[name]
        rng = _rng(self.seed, name)
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        if name.endswith("A_log"):  # mlx-lm's init: log U(0, 16); avoid log(0)
            return mx.array(np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)).astype(dtype)
        if name.endswith("expert_bias") or name in self.selection_biases:
            return mx.array(rng.uniform(-EXPERT_BIAS_RANGE, EXPERT_BIAS_RANGE, shape).astype(np.float32)).astype(dtype)
        if name.endswith("dt_bias") or module.endswith("norm") or name.endswith(".D"):
            return mx.ones(shape, dtype)
        if name.endswith(".bias") and not name.startswith(self.experts):  # expert biases stay random: tested
            return mx.zeros(shape, dtype)
        if (name.endswith("mlp.gate.weight") or name.endswith("gate.gate_proj.weight") or module == "lm_head"
                or name in self.routers):
            std = self.hidden**-0.5  # router and head logits of std ~1: routing differs per token
        elif module == "conv1d":
            std = shape[1] ** -0.5 / math.sqrt(3)  # torch's default conv init, U(+-1/sqrt(kernel))
        else:
            std = LINEAR_STD
        r = rng.integers(-127, 128, size=shape, dtype=np.int8)
        return mx.array(r).astype(dtype) * mx.array(std * math.sqrt(3) / 127, dtype)

    def packed_experts(self, path: str, shape, group_size: int, bits: int) -> tuple[mx.array, ...]:
        """Random packed words and scales for a SwitchLinear of float `shape` (E, out, in)."""
        E, n_out, n_in = shape
        rng = _rng(self.seed, path)
        w = mx.array(rng.integers(0, 1 << 32, size=(E, n_out, n_in * bits // 32), dtype=np.uint32))
        levels = 1 << bits
        scale = LINEAR_STD / math.sqrt((levels * levels - 1) / 12)  # uniform levels: std LINEAR_STD
        jitter = mx.array(rng.integers(-127, 128, size=(E, n_out, n_in // group_size), dtype=np.int8))
        scales = (jitter.astype(mx.bfloat16) * (0.25 * scale / 127) + scale).astype(mx.bfloat16)
        biases = (scales * (-(levels - 1) / 2)).astype(mx.bfloat16)
        return w, scales, biases


def _router_names(model, arch: str) -> tuple[set, set, tuple]:
    """Parameter names of the routers and their selection biases (from the family's router description), and
    the prefixes of the expert modules."""
    from .adapter import expert_slots, get_path
    from .routers import ROUTERS

    slots = expert_slots(model)
    router = ROUTERS.get(arch)
    routers, biases = set(), set()
    for path, block, _ in slots.values() if router is not None else ():
        target = get_path(block, router.logits)
        routers.add(f"{path}.{router.logits}" + ("" if isinstance(target, mx.array) else ".weight"))
        if router.bias is not None:
            biases.add(f"{path}.{router.bias}")
    return routers, biases, tuple(f"{path}.{attr}." for path, _, attr in slots.values())


def _rng(seed: int, name: str) -> np.random.Generator:
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng([seed, h])


def _quantized(spec: _Spec):
    """Quantize the lazy model with mlx-lm: final {name: lazy array}, {module: params}, config, parameter count."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import get_total_parameters, quantize_model

    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
        model, config = quantize_model(spec.model, copy.deepcopy(spec.config), GROUP_SIZE, BITS)
    qparams = {
        p: (m.group_size, m.bits, m.mode)
        for p, m in model.named_modules()
        if hasattr(m, "bits") and "scales" in m
    }
    weights = dict(tree_flatten(model.parameters()))
    return weights, qparams, config, get_total_parameters(model)


def _write_mlx(spec: _Spec, out: Path, progress: bool) -> None:
    from mlx_lm.utils import save_config

    weights, qparams, config, n_params = _quantized(spec)
    parts = shards(list(weights.items()), [v.nbytes for v in weights.values()], MLX_SHARD_BYTES)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if len(parts) > 1 else "model.safetensors"
    weight_map = {}
    done = {}  # quantized triples waiting for their other two names

    def tensor(name: str) -> mx.array:
        path, leaf = name.rsplit(".", 1)
        if path not in qparams or leaf not in ("weight", "scales", "biases"):
            return spec.float(name)
        if name not in done:
            group_size, bits, mode = qparams[path]
            shape = spec.floats[f"{path}.weight"][0]
            if spec.direct_experts and ".switch_mlp." in path and mode == "affine":
                triple = spec.packed_experts(path, shape, group_size, bits)
            else:
                triple = mx.quantize(spec.float(f"{path}.weight"), group_size, bits, mode=mode)
            done.update(zip((f"{path}.weight", f"{path}.scales", f"{path}.biases"), triple))
        return done.pop(name)

    with bar(sum(v.nbytes for v in weights.values()), f"{spec.arch} {spec.preset} mlx", progress) as progress_bar:
        for i, shard in enumerate(parts):
            arrays = {}
            for name, planned in shard:
                arrays[name] = a = tensor(name)
                mx.eval(a)  # one tensor at a time: peak memory is one shard
                assert a.shape == planned.shape and a.dtype == planned.dtype, name
                progress_bar.update(a.nbytes)
            shard_name = fmt.format(i + 1, len(parts))
            mx.save_safetensors(str(out / shard_name), arrays, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(arrays, shard_name))
            del arrays
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values()), "total_parameters": n_params},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    save_config(config, config_path=out / "config.json")
