"""The generic attachment: Edge0 replaces only the routed-expert call of an mlx-lm MoE block.

Every mlx-lm MoE family computes its routing and then calls its SwitchGLU / SwitchMLP with
(x, indices). `StreamedExperts` stands where that module was and answers the same call from Edge0's
executor (the store's bytes, read as the executor decides), so the family's own router, weights,
shared experts and everything else run untouched: native routing is exact by construction.

Where the family has a router description (routers.py), the block's class is also given
`FamilyBlock`'s interface, the one Edge0's pipeline uses on every MoE block: logits(x), select(logits),
route(x), top_k, and `planned` (routing decided ahead by a prerouter head).
Shapes: T tokens, E experts, K routed, D hidden.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU, SwitchMLP

from ..compute import expert_math
from ..compute.expert_math import ExpertFn
from ..compute.routing import topk_routing
from ..errors import Edge0Error
from .routers import A, Router

SWITCH_TYPES = (SwitchGLU, SwitchMLP)


def expert_slots(model: nn.Module) -> dict[int, tuple[str, nn.Module, str]]:
    """{decoder layer: (block path, block, attribute)} of every routed-expert module (SwitchGLU / SwitchMLP,
    or Edge0's StreamedExperts in their place); the layer is the first integer of the module's path."""
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, (*SWITCH_TYPES, StreamedExperts)):
            continue
        parts = path.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), None)
        if layer is None or layer in out:
            raise Edge0Error(f"routed experts at {path}: Edge0 needs one expert module per numbered decoder layer")
        block_path = ".".join(parts[:-1])
        out[layer] = (block_path, get_path(model, block_path), parts[-1])
    return dict(sorted(out.items()))


def expert_fn(switch: nn.Module) -> ExpertFn | None:
    """How a SwitchGLU / SwitchMLP combines its projections; None for Edge0's plain SwiGLU path."""
    if switch.parameters().get("activation"):
        raise Edge0Error(f"{type(switch.activation).__name__}: expert activations with parameters are not supported")
    if isinstance(switch, SwitchMLP):
        return ExpertFn("mlp", switch.activation)
    projs = [switch[p] for p in ("gate_proj", "up_proj", "down_proj")]
    biased = any("bias" in p for p in projs)
    mixed = len({getattr(p, "bits", None) for p in projs}) > 1  # e.g. an 8-bit down projection
    if type(switch.activation) is SwiGLU and not biased and not mixed:
        return None
    return ExpertFn("glu", switch.activation)


class StreamedExperts(nn.Module):
    """In place of a block's SwitchGLU / SwitchMLP: (x (..., D), indices (..., K)) -> (..., K, D) from the
    executor. Holds no parameters (the experts live in the store)."""

    def __init__(self, executor, fn: ExpertFn | None):
        super().__init__()
        self.executor, self.fn = executor, fn

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.fn is None:
            return self.executor(x, indices)
        with expert_math.using(self.fn):
            return self.executor(x, indices)


class FamilyBlock:
    """Mixed into an mlx-lm MoE block's class: the router interface, over the family's own code."""

    edge0_router: Router  # set by with_router (the family's own attributes keep their names)
    edge0_experts: int  # routed experts held by the store
    edge0_slot: str  # the attribute holding the block's experts
    edge0_hidden: int  # the block's input width
    planned = None  # () -> (inds, plan) | None: routing decided ahead by `decide` (predicted routing)
    observe = None  # (x) -> None: called with the block's input (routing records)

    def logits(self, x: mx.array) -> mx.array:
        r = self.edge0_router
        src = get_path(self, r.logits)
        if isinstance(src, mx.array):  # an (E, D) weight: x @ w.T
            return x.astype(mx.float32) @ src.astype(mx.float32).T if r.f32 else x @ src.T
        return src(x.astype(mx.float32) if r.f32 else x)  # (T, E)

    def select(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        r = self.edge0_router
        if r.own is not None:  # the family's own selection function, with its gate's settings
            gate = get_path(self, r.gate)
            fn = getattr(sys.modules[type(gate).__module__], r.own[0])
            inds, weights = fn(logits, *(get_path(gate, name) for name in r.own[1:]))
        else:
            groups = None
            if r.groups is not None and (r.groups_if is None or get_path(self, r.groups_if[0]) == r.groups_if[1]):
                groups = tuple(_value(self, g) for g in r.groups)
                groups = None if None in groups else groups
            inds, weights = topk_routing(logits, self.top_k, score=_value(self, r.score),
                                         bias=get_path(self, r.bias) if r.bias else None, groups=groups,
                                         group_rule=r.group_rule, norm=bool(_value(self, r.norm)),
                                         scale=_value(self, r.scale), softcap=_value(self, r.softcap) or 0.0)
        if r.zero_experts:
            inds = mx.where(inds >= self.edge0_experts, 0, inds)
        return inds, weights  # (T, K), (T, K)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.select(self.logits(x))

    def decide(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """What predicted routing decides ahead from a head's logits: (inds, plan), `plan` being what the
        block's `planned` hook gives back. A weight router's plan is its weights (the block uses both as its
        gate's answer). A logits router's plan is the logits: the block then selects and weighs them with
        its own code, and `inds` are those its code picks, in its order (a dry run of the block, below)."""
        if self.edge0_router.gate is not None:
            return self.select(logits)
        return self._own_inds(logits), logits

    def _own_inds(self, logits: mx.array) -> mx.array:
        """The ids the family's own code picks from `logits`, in its order: its block run on zeros with the
        router answering `logits` and the experts recording their indices. Only that node is evaluated; the
        rest of the lazy graph is never computed."""
        parent, name = _split(self, self.edge0_router.logits)
        router, experts = parent[name], self[self.edge0_slot]
        capture = _Capture()
        parent[name], self[self.edge0_slot] = _Answer(logits), capture
        rows = (1,) * (3 - logits.ndim) + tuple(logits.shape[:-1])  # (B, L): a block's input is (B, L, D)
        try:
            super().__call__(mx.zeros((*rows, self.edge0_hidden), logits.dtype))
        finally:
            parent[name], self[self.edge0_slot] = router, experts
        return capture.inds.reshape(*logits.shape[:-1], -1)  # (T, K)

    @property
    def top_k(self) -> int:
        return get_path(self, self.edge0_router.k)

    @top_k.setter
    def top_k(self, k: int) -> None:
        _set(self, self.edge0_router.k, k)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        if self.observe is not None:
            self.observe(x)
        decided = self.planned() if self.planned is not None else None
        if decided is None:
            return super().__call__(x, *args, **kwargs)
        with self._answering(decided):
            return super().__call__(x, *args, **kwargs)

    @contextmanager
    def _answering(self, decided):
        """The router module answers the decided routing for this call: the logits (the family selects and
        weighs them) or, for a weight router, the (inds, weights) its own function gave them."""
        r = self.edge0_router
        inds, plan = decided
        parent, name = _split(self, r.gate if r.gate is not None else r.logits)
        module = parent[name]
        parent[name] = _Answer((inds, plan) if r.gate is not None else plan)
        try:
            yield
        finally:
            parent[name] = module


class _Capture(nn.Module):
    """In place of the experts during a dry run: records the indices, answers zeros."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        object.__setattr__(self, "inds", indices)
        return mx.zeros((*indices.shape, x.shape[-1]), x.dtype)


class _Answer(nn.Module):
    def __init__(self, value):
        super().__init__()
        object.__setattr__(self, "value", value)  # not a parameter

    def __call__(self, x: mx.array):
        if isinstance(self.value, tuple):
            return self.value
        return self.value.reshape(*x.shape[:-1], -1).astype(x.dtype)


_classes: dict[type, type] = {}


def with_router(block: nn.Module, router: Router, num_experts: int, slot: str, hidden: int) -> nn.Module:
    """Give `block` (an mlx-lm MoE block) FamilyBlock's interface; its parameters and call are unchanged."""
    cls = type(block)
    if cls not in _classes:
        _classes[cls] = type(cls.__name__, (FamilyBlock, cls), {"__module__": cls.__module__})
    block.__class__ = _classes[cls]
    block.edge0_router, block.edge0_experts, block.edge0_slot, block.edge0_hidden = router, num_experts, slot, hidden
    return block


def _split(block, path: str):
    head, _, name = path.rpartition(".")
    return (get_path(block, head) if head else block), name


def get_path(obj, path: str):
    """obj.a.b for path 'a.b' (module children, dataclass fields, plain attributes)."""
    for name in path.split(".") if path else []:
        obj = _attr(obj, name)
    return obj


def _attr(obj, name: str):
    """obj.name, reading an instance's own value first (FamilyBlock's top_k property shadows the block's)."""
    if isinstance(obj, (list, tuple)):
        return obj[int(name)]
    if name in getattr(obj, "__dict__", {}):
        return obj.__dict__[name]
    if isinstance(obj, dict) and name in obj:
        return obj[name]
    return getattr(obj, name)


def _set(obj, path: str, value) -> None:
    parent, name = _split(obj, path)
    if isinstance(parent, nn.Module):
        parent.__dict__[name] = value
    else:
        setattr(parent, name, value)


def _value(block, v):
    return get_path(block, v.path) if isinstance(v, A) else v


def attach_streamed(model: nn.Module, executors: dict, router: Router | None, num_experts: int, hidden: int,
                    where) -> dict[int, nn.Module]:
    """Replace every expert module of `model` by StreamedExperts over the layer's executor; returns
    {layer: block}, the blocks given the router interface when the family has a description."""
    slots = expert_slots(model)
    for layer in executors:
        if layer not in slots:
            raise Edge0Error(f"{where}: layer {layer} holds experts but the model's layer {layer} has no expert module")
    blocks = {}
    for layer, (_, block, attr) in slots.items():
        if layer not in executors:
            raise Edge0Error(f"{where}: MoE layer {layer} has no expert file in the manifest")
        block[attr] = StreamedExperts(executors[layer], expert_fn(block[attr]))
        blocks[layer] = with_router(block, router, num_experts, attr, hidden) if router is not None else block
    return blocks


def check_predictor(blocks: dict, runtime, arch) -> None:
    """Prefetch with next-router or heads needs the family's router description; heads need router logits
    over exactly the stored experts."""
    predictors = {getattr(ex, "predictor", None) for ex in runtime.executors.values()}
    router = getattr(next(iter(blocks.values()), None), "edge0_router", None)
    if predictors & {"next-router", "heads"} and router is None:
        raise Edge0Error(f"{arch.model_type}: Edge0 has no router description for this family (model/routers.py), "
                         "so it cannot predict from its router; use --predictor repeat, or --routing native")
    if getattr(runtime, "heads", None) is not None and router.zero_experts:
        raise Edge0Error(f"{arch.model_type}: its router also scores identity experts, which prerouter heads do "
                         "not predict; use --predictor next-router or repeat")
