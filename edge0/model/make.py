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
from edge0.model.tokenizer import VOCAB_SIZE, save_tokenizer, special_token_ids

ARCHS = ("qwen3_moe", "qwen3_5_moe", "bailing_moe")
PRESETS = ("tiny", "small", "paper-35b")
FORMATS = ("mlx", "hf")

GROUP_SIZE = 64  # affine quantization group, as mlx_lm.convert's default
BITS = 4
MLX_SHARD_BYTES = 5 << 30  # mlx_lm.utils.MAX_FILE_SIZE_GB
HF_SHARD_BYTES = 2 << 30  # tests lower it to get several shards
LINEAR_STD = 0.02  # weights are uniform with this std: int8 draws are 10x faster than normal ones
EXPERT_BIAS_RANGE = 0.1  # bailing expert_bias ~ U(-0.1, 0.1): moves sigmoid scores of std ~0.2
DIRECT_PRESETS = ("paper-35b",)  # presets whose routed experts skip float generation

# Shape class per preset, shared by the archs; _ARCH_DIMS overrides per arch.
_DIMS = {
    "tiny": dict(
        hidden_size=128, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    ),
    "small": dict(
        hidden_size=1024, num_hidden_layers=16, num_experts=64, num_experts_per_tok=4,
        moe_intermediate_size=512, intermediate_size=2816,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64,
    ),
    "paper-35b": dict(
        hidden_size=2048, num_hidden_layers=40, num_experts=256, num_experts_per_tok=4,
        moe_intermediate_size=512, intermediate_size=5120,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    ),
}
_ARCH_DIMS = {
    ("qwen3_5_moe", "tiny"): dict(
        head_dim=64, full_attention_interval=2, shared_expert_intermediate_size=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    ),
    ("qwen3_5_moe", "small"): dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, full_attention_interval=4,
        shared_expert_intermediate_size=512,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
    ),
    # Qwen3.5/3.6-35B-A3B text config, except K (real: 8 routed) and the vocabulary.
    ("qwen3_5_moe", "paper-35b"): dict(
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
        shared_expert_intermediate_size=512,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    ),
    ("bailing_moe", "tiny"): dict(n_group=4, topk_group=2),
    ("bailing_moe", "small"): dict(n_group=8, topk_group=4),
    ("bailing_moe", "paper-35b"): dict(num_attention_heads=16, n_group=8, topk_group=4),
}


def model_config(arch: str, preset: str) -> dict:
    """The Hugging Face style config.json (no quantization entry) of an arch at a preset."""
    _check(arch, preset, "mlx")
    d = {**_DIMS[preset], **_ARCH_DIMS.get((arch, preset), {})}
    eos = special_token_ids()["<|im_end|>"]
    common = dict(
        hidden_act="silu", hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        num_experts=d["num_experts"], num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=True,
        rms_norm_eps=1e-6, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
        initializer_range=LINEAR_STD, eos_token_id=eos, use_cache=True,
    )
    if arch == "qwen3_moe":
        return dict(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", **common,
            attention_bias=False, attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[],
            head_dim=d["head_dim"], intermediate_size=d["intermediate_size"],
            max_position_embeddings=40960, rope_theta=1000000.0,
            router_aux_loss_coef=0.001, output_router_logits=False,
            sliding_window=None, use_sliding_window=False, torch_dtype="bfloat16",
        )
    if arch == "qwen3_5_moe":
        n, every = d["num_hidden_layers"], d["full_attention_interval"]
        text = dict(
            model_type="qwen3_5_moe_text", **common,
            attention_bias=False, attention_dropout=0.0, attn_output_gate=True, dtype="bfloat16",
            full_attention_interval=every, head_dim=d["head_dim"],
            layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)],
            linear_conv_kernel_dim=4,
            **{k: d[k] for k in ("linear_key_head_dim", "linear_num_key_heads",
                                 "linear_num_value_heads", "linear_value_head_dim")},
            max_position_embeddings=262144, mtp_num_hidden_layers=0,
            shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
            router_aux_loss_coef=0.001,
            rope_parameters=dict(
                mrope_interleaved=True, mrope_section=[11, 11, 10], partial_rotary_factor=0.25,
                rope_theta=10000000, rope_type="default",
            ),
        )
        return dict(
            architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
            text_config=text, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=eos,
        )
    return dict(
        architectures=["BailingMoeForCausalLM"], model_type="bailing_moe", **common,
        head_dim=d["hidden_size"] // d["num_attention_heads"], intermediate_size=d["intermediate_size"],
        max_position_embeddings=32768, rope_theta=600000.0, partial_rotary_factor=0.5,
        first_k_dense_replace=1, num_shared_experts=1, use_bias=False, use_qkv_bias=False,
        use_qk_norm=True, norm_head=False, norm_softmax=False,
        score_function="sigmoid", n_group=d["n_group"], topk_group=d["topk_group"],
        moe_router_enable_expert_bias=True, routed_scaling_factor=2.5,
        output_router_logits=False, torch_dtype="bfloat16",
    )


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
    force: replace a non-empty `out`, once the new checkpoint is complete.
    Builds into a temporary sibling of `out` and renames it into place at the end (edge0.io.atomic).
    """
    _check(arch, preset, fmt)
    if not isinstance(seed, int) or seed < 0:
        raise Edge0Error(f"Seed must be a non-negative integer, not {seed!r}.")
    if fmt == "hf" and preset in DIRECT_PRESETS:
        gb = planned_bytes(arch, preset, "hf") / 1e9
        raise Edge0Error(f"Preset {preset} in hf format would take {gb:.0f} GB of bf16; make it with format mlx.")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise Edge0Error(f"{out} exists and is not a directory.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise Edge0Error(f"{out} exists and is not empty; pass --force to replace it.")
    with atomic_dir(out, replace=force, needed=planned_bytes(arch, preset, fmt)) as tmp:
        spec = _Spec(arch, preset, seed)
        (_write_mlx if fmt == "mlx" else _write_hf)(spec, tmp, progress)
        save_tokenizer(tmp)
    return out


def planned_tensors(arch: str, preset: str, fmt: str = "mlx") -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors make_model would write, {name: (shape, dtype)}, without generating any."""
    _check(arch, preset, fmt)
    spec = _Spec(arch, preset, 0)
    if fmt == "mlx":
        names = _quantized(spec)[0]
        return {k: (tuple(v.shape), str(v.dtype).removeprefix("mlx.core.")) for k, v in names.items()}
    return {k: (shape, str(dtype).removeprefix("mlx.core.")) for k, shape, dtype, _ in _hf_plan(spec)}


def planned_bytes(arch: str, preset: str, fmt: str = "mlx") -> int:
    """Total bytes of the weights make_model would write (safetensors headers aside)."""
    total = 0
    for shape, dtype in planned_tensors(arch, preset, fmt).values():
        total += math.prod(shape) * getattr(mx, dtype).size
    return total


def _check(arch: str, preset: str, fmt: str) -> None:
    if arch not in ARCHS:
        raise Edge0Error(f"Unknown arch {arch!r}; choose one of {', '.join(ARCHS)}.")
    if preset not in PRESETS:
        raise Edge0Error(f"Unknown preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    if fmt not in FORMATS:
        raise Edge0Error(f"Unknown format {fmt!r}; choose one of {', '.join(FORMATS)}.")


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
        self.hidden = self.config.get("text_config", self.config)["hidden_size"]
        self.direct_experts = preset in DIRECT_PRESETS

        # hf slices one stacked expert tensor E times, and fuses gate with up: keep the last two.
        self.float = functools.lru_cache(maxsize=2)(self._float)

    def _float(self, name: str) -> mx.array:
        """The float tensor `name` (an mlx parameter path), from its own seed."""
        shape, dtype = self.floats[name]
        rng = _rng(self.seed, name)
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        if name.endswith("A_log"):  # mlx-lm's init: log U(0, 16); avoid log(0)
            return mx.array(np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32))
        if name.endswith("expert_bias"):
            return mx.array(rng.uniform(-EXPERT_BIAS_RANGE, EXPERT_BIAS_RANGE, shape).astype(np.float32))
        if name.endswith("dt_bias") or module.endswith("norm"):
            return mx.ones(shape, dtype)
        if name.endswith(".bias"):
            return mx.zeros(shape, dtype)
        if name.endswith("mlp.gate.weight") or name.endswith("gate.gate_proj.weight") or module == "lm_head":
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
    shards = _shards(list(weights.items()), [v.nbytes for v in weights.values()], MLX_SHARD_BYTES)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
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

    with _bar(sum(v.nbytes for v in weights.values()), f"{spec.arch} {spec.preset} mlx", progress) as bar:
        for i, shard in enumerate(shards):
            arrays = {}
            for name, planned in shard:
                arrays[name] = a = tensor(name)
                mx.eval(a)  # one tensor at a time: peak memory is one shard
                assert a.shape == planned.shape and a.dtype == planned.dtype, name
                bar.update(a.nbytes)
            shard_name = fmt.format(i + 1, len(shards))
            mx.save_safetensors(str(out / shard_name), arrays, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(arrays, shard_name))
            del arrays
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values()), "total_parameters": n_params},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    save_config(config, config_path=out / "config.json")


# qwen3_5 sanitize adds 1 to these norms when it sees an HF (unsanitized) conv1d weight.
_QWEN3_5_SHIFTED_NORMS = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
    ".q_norm.weight", ".k_norm.weight",
)


def _hf_plan(spec: _Spec) -> list[tuple[str, tuple, mx.Dtype, object]]:
    """[(hf name, shape, dtype, producer)] in model order; producers derive from spec.float."""
    plan = []
    n_experts = spec.config.get("text_config", spec.config)["num_experts"]
    for name, (shape, dtype) in spec.floats.items():
        f = functools.partial(spec.float, name)
        if spec.arch == "qwen3_5_moe":
            hf = ("model.language_model." + name.removeprefix("language_model.model.")
                  if name.startswith("language_model.model.") else name.removeprefix("language_model."))
            if ".switch_mlp." in name:
                prefix, proj = hf.split(".switch_mlp.")
                if proj == "gate_proj.weight":
                    up = functools.partial(spec.float, name.replace("gate_proj", "up_proj"))
                    E, H, D = shape
                    plan.append((f"{prefix}.experts.gate_up_proj", (E, 2 * H, D), dtype,
                                 lambda f=f, up=up: mx.concatenate([f(), up()], axis=1)))
                elif proj == "down_proj.weight":
                    plan.append((f"{prefix}.experts.down_proj", shape, dtype, f))
            elif name.endswith("conv1d.weight"):  # mlx (C, K, 1), HF (C, 1, K)
                plan.append((hf, (shape[0], shape[2], shape[1]), dtype, lambda f=f: f().moveaxis(2, 1)))
            elif name.endswith(_QWEN3_5_SHIFTED_NORMS):  # HF stores these norms zero-centred
                plan.append((hf, shape, dtype, lambda f=f: f() - 1))
            else:
                plan.append((hf, shape, dtype, f))
        elif ".switch_mlp." in name:  # qwen3_moe, bailing_moe: one tensor per expert
            prefix, proj = name.split(".switch_mlp.")
            for e in range(n_experts):
                plan.append((f"{prefix}.experts.{e}.{proj}", shape[1:], dtype, lambda f=f, e=e: f()[e]))
        elif name.endswith("mlp.gate.gate_proj.weight"):  # bailing router; sanitize renames it back
            plan.append((name.replace("gate.gate_proj", "gate"), shape, dtype, f))
        else:
            plan.append((name, shape, dtype, f))
    return plan


def _write_hf(spec: _Spec, out: Path, progress: bool) -> None:
    plan = _hf_plan(spec)
    sizes = [math.prod(shape) * dtype.size for _, shape, dtype, _ in plan]
    shards = _shards(plan, sizes, HF_SHARD_BYTES)
    weight_map = {}
    with _bar(sum(sizes), f"{spec.arch} {spec.preset} hf", progress) as bar:
        for i, shard in enumerate(shards):
            arrays = {}
            for name, shape, dtype, produce in shard:
                arrays[name] = a = mx.contiguous(produce())
                mx.eval(a)
                assert a.shape == shape and a.dtype == dtype, name
                bar.update(a.nbytes)
            shard_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(out / shard_name), arrays, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(arrays, shard_name))
            del arrays
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(spec.config, indent=2) + "\n")


def _shards(entries: list, sizes: list[int], max_bytes: int) -> list[list]:
    """mlx_lm.utils.make_shards in bytes: consecutive runs of at most max_bytes (a larger tensor alone)."""
    shards, size = [], 0
    for entry, n in zip(entries, sizes):
        if not shards or size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
