"""Load an Edge0 store as mlx-lm's own model class, with every MoE block streaming its experts."""

from __future__ import annotations

import dataclasses
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm.utils import _get_classes, infer_quant_config, load_tokenizer

from ..compute.banks import scales_as_stored
from ..compute.dense import use_kernel_ops
from ..compute.qmm import pack_at_load, use_kernel_products
from ..compute.runtime import Runtime, build_runtime
from ..errors import Edge0Error, SettingError
from ..io.manifest import MANIFEST, Manifest, read_manifest
from ..io.reader import BundleReader
from ..io.verify import check_at_load
from ..log import log
from .arch import arch_for, read_config, text_config
from .adapter import attach_streamed, check_predictor
from .blocks import is_moe_block, make_block
from .consistency import config_problems
from .routers import ROUTERS

RESIDENT = "resident.safetensors"
# A pipeline rank's share of the model (edge0/dist): the decoder layers it holds, and its hook on the runtime.
_PART: ContextVar = ContextVar("edge0_part", default=None)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class Store:
    """A loaded store: the model, its tokenizer and the reader its experts stream through."""

    path: Path
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    manifest: Manifest
    reader: BundleReader
    dtype: mx.Dtype | None  # compute dtype of non-quantized tensors (None: as stored)
    runtime: Runtime  # the expert executors and what they share
    heads_file: Path | None = None  # prerouter heads in use, if any

    def close(self) -> None:
        self.runtime.close()
        self.reader.close()


def compute_dtype(name: str) -> mx.Dtype | None:
    """'auto' is float32 on CPU (bf16 is far slower there, docs/DESIGN.md §15), the stored dtype elsewhere."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    if name == "source":
        return None
    if name not in DTYPES:
        raise SettingError(f"{{kernel.dtype}} {name}: choose auto, source, {', '.join(DTYPES)}")
    return DTYPES[name]


def cast_floats(model: nn.Module, dtype: mx.Dtype | None, *, scales_as_stored: bool = False) -> None:
    """Cast floating parameters (quantization scales and biases included) to dtype, as mlx-lm's convert does;
    with scales_as_stored, quantized linears' scales and biases keep their stored dtype (the edge0 kernel reads
    bf16 ones as they are: half the bytes to stream of a float32 copy, the same products)."""
    if dtype is None:
        return
    keep = getattr(model, "cast_predicate", lambda _: True)
    stored = {f"{path}.{name}" for path, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)
              for name in ("scales", "biases")} if scales_as_stored else set()
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dtype) if keep(k) and k not in stored and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))


def quantize_like_config(model: nn.Module, config: dict, weights: dict) -> None:
    """Turn Linear layers into QuantizedLinear where the checkpoint holds packed weights (as mlx_lm.load does)."""
    quantization = config.get("quantization")
    if quantization is None:
        return

    def predicate(path, module):
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                mode=quantization.get("mode", "affine"), class_predicate=predicate)


def _resident_weights(root: Path) -> dict:
    resident = root / RESIDENT
    if not resident.exists():
        raise Edge0Error(f"{resident}: missing")
    try:
        return mx.load(str(resident))
    except (RuntimeError, ValueError) as e:
        raise Edge0Error(f"{resident}: cannot be read as safetensors ({e})") from None


def _attach(model: nn.Module, runtime, arch, manifest: Manifest, config: dict, root: Path) -> None:
    """Edge0's MoE block (or, for families run by their own block, Edge0's expert call) over the runtime's
    executor, in every MoE layer the manifest lists."""
    where = root / "edge0.json"
    if arch.family == "mlx-lm":
        hidden = text_config(config).get("hidden_size") or text_config(config)["model_dim"]
        blocks = attach_streamed(model, runtime.executors, ROUTERS.get(arch.module), manifest.num_experts, hidden,
                                 where)
        check_predictor(blocks, runtime, arch)
    else:
        for i, layer in enumerate(model.layers):
            if layer is None:  # another rank's layer (edge0/dist)
                continue
            if i in runtime.executors:
                if not is_moe_block(layer.mlp):
                    raise Edge0Error(f"{where}: layer {i} holds experts but the model's layer {i} is dense")
                layer.mlp = make_block(arch.model_type, layer.mlp, runtime.executors[i])
            elif is_moe_block(layer.mlp):
                raise Edge0Error(f"{where}: MoE layer {i} has no expert file in the manifest")
        blocks = {i: model.layers[i].mlp for i in runtime.executors}
    runtime.link(blocks)
    model.eval()


def _checked_manifest(root: Path, using) -> Manifest:
    """The store's manifest, once its small files are checked (a checkpoint directory is told to convert)."""
    if not (root / MANIFEST).exists() and root.is_dir() and list(root.glob("model*.safetensors")):
        config = read_config(root)
        raise Edge0Error(f"{root}: a {config['model_type']} checkpoint, not an Edge0 store; convert it first: "
                         f"edge0 convert {root} OUT")
    manifest = read_manifest(root)
    for warning in check_at_load(root, manifest, using):
        log.warning(warning)
    return manifest


def _tokenizer(root: Path, config: dict):
    if not any((root / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise Edge0Error(f"{root}: no tokenizer (tokenizer.json); copy the source checkpoint's tokenizer files here")
    try:
        return load_tokenizer(root, eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Edge0Error(f"{root}: no usable tokenizer (tokenizer.json / tokenizer_config.json): {e}") from None


def load_store(path: str | os.PathLike, *, dtype: str = "auto", verify: bool = False, executor: str = "exact",
               memory_budget: float | None = None, io: str = "pread", io_throttle: float | None = None,
               slots: int | None = None, build=None, using=()) -> Store:
    """Build mlx-lm's model for the store's architecture, load resident.safetensors, stream the experts.

    Every load checks the small files' checksums and the layer files' sizes and headers (io/verify.py
    check_at_load); verify also checks each expert bundle as it is read.
    executor: exact | staged | hot | resident | auto (resident when every expert fits, else staged);
    memory_budget: GiB of resident expert bytes;
    io: pread | mmap | direct; io_throttle: cap on read bandwidth in MB/s (experiments).
    build: (reader, compute dtype) -> Runtime, for executors made elsewhere (the scheduler's); overrides executor.
    using: the heads and adapter files the run reads (checked with the store's files when the store lists them).
    """
    root = Path(path)
    manifest = _checked_manifest(root, using)
    config = read_config(root)
    arch = arch_for(config, root / "config.json")
    weights = _resident_weights(root)
    cdtype = compute_dtype(dtype)
    model_class, args_class = _get_classes(config)
    try:
        model = model_class(args_class.from_dict(config))
        quantize_like_config(model, config, weights)
    except (TypeError, ValueError, KeyError) as e:
        raise Edge0Error(f"{root / 'config.json'}: does not describe a {arch.model_type} model ({e})") from None
    problems = config_problems(manifest, config, where=root / MANIFEST, model=model)
    if problems:  # before any executor sizes itself by the manifest
        raise Edge0Error(problems[0])
    part = _PART.get()
    if part is not None:
        manifest, weights = _keep_layers(model, manifest, weights, part.layers)
        weights = _drop_ends(model, weights, first=part.layers.start == 0, last=part.last)
    reader = BundleReader(root, manifest, verify=verify, io=io, throttle_mbps=io_throttle)
    runtime = None
    try:
        if build is not None:
            runtime = build(reader, cdtype)
        else:
            runtime = build_runtime(reader, executor, cdtype, memory_budget_gib=memory_budget, slots=slots)
        if part is not None:
            part.adopt(runtime)
        _attach(model, runtime, arch, manifest, config, root)
        try:
            model.load_weights(list(weights.items()), strict=True)
        except ValueError as e:
            raise Edge0Error(f"{root / RESIDENT}: does not match the {arch.model_type} model of config.json ({e})") from None
        cast_floats(model, cdtype, scales_as_stored=scales_as_stored(cdtype))
        use_kernel_products(model)  # dense quantized linears through compute.qmm too (the one call site)
        use_kernel_ops(model)  # norms, RoPE, decode attention on the edge0 kernels when in use
        mx.eval(model.parameters())
        pack_at_load(model, runtime.executors, cdtype)
        tokenizer = _tokenizer(root, config)
    except BaseException:
        if runtime is not None:
            runtime.close()
        reader.close()
        raise
    return Store(root, model, tokenizer, config, manifest, reader, cdtype, runtime)


@dataclass
class PartManifest(Manifest):
    """A manifest of some of a store's MoE layers (a pipeline rank's); `whole` is the store's."""

    whole: Manifest | None = None


@contextmanager
def only_layers(part):
    """Within the block, load_store loads decoder layers `part.layers` only (their resident weights and experts) and
    calls part.adopt(runtime) once the runtime is built (edge0/dist: one pipeline rank's share)."""
    token = _PART.set(part)
    try:
        yield
    finally:
        _PART.reset(token)


_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _keep_layers(model: nn.Module, manifest: Manifest, weights: dict, keep: range) -> tuple[Manifest, dict]:
    """Drop the decoder layers outside `keep` from the model (None in their place: the others keep their numbers),
    their weights and their manifest entries."""
    inner = decoder(model)
    inner.layers = [layer if i in keep else None for i, layer in enumerate(inner.layers)][:keep.stop]
    kept = {k: v for k, v in weights.items()
            if (m := _LAYER_KEY.search(k)) is None or int(m.group(1)) in keep}
    fields = {f.name: getattr(manifest, f.name) for f in dataclasses.fields(Manifest)}
    fields["layers"] = [e for e in manifest.layers if e.layer in keep]
    return PartManifest(**fields, whole=manifest), kept


def _drop_ends(model: nn.Module, weights: dict, *, first: bool, last: bool) -> dict:
    """A pipeline rank runs the embedding if first, the final norm and output head if last (and the embedding too if
    the head is tied to it): an empty module in place of each other one, its weights never read."""
    inner, owner = decoder(model), head_owner(model)
    keep = {"embed"} if first or (last and owner is None) else set()
    keep |= {"norm", "head"} if last else set()
    ends = {"embed": (inner, embed_name(inner)), "norm": (inner, "norm"), "head": (owner, "lm_head")}
    paths = {id(m): path for path, m in model.named_modules()}
    for what, (parent, name) in ends.items():
        if what in keep or parent is None or name not in parent:
            continue
        prefix = paths[id(parent[name])] + "."
        weights = {k: v for k, v in weights.items() if not k.startswith(prefix)}
        parent[name] = nn.Module()
    return weights


def embed_name(inner: nn.Module) -> str:
    """The decoder's embedding's name (mlx-lm's: embed_tokens, or Bailing's word_embeddings)."""
    return "embed_tokens" if "embed_tokens" in inner else "word_embeddings"


def head_owner(model: nn.Module) -> nn.Module | None:
    """The module holding the output head (lm_head) beside the decoder; None where the head is tied to the
    embedding."""
    for owner in (model, getattr(model, "language_model", None)):
        if owner is not None and "lm_head" in owner:
            return owner
    return None


def decoder(model: nn.Module) -> nn.Module:
    """The module holding the decoder layers (mlx-lm's `model.model`, or the language model's)."""
    for path in ("model", "language_model.model"):
        inner = model
        for name in path.split("."):
            inner = getattr(inner, name, None) if inner is not None else None
        if inner is not None and isinstance(getattr(inner, "layers", None), list):
            return inner
    raise Edge0Error(f"{type(model).__module__}: no decoder layer list to split across ranks")
