"""The engine's choices, each defined once as a Literal type and the tuple of its values (what a flag offers, what
a check accepts). Below every layer: it imports nothing of Edge0, so compute/ and pipeline/ read them from here and
config.py types EngineConfig's fields with them."""

from __future__ import annotations

from typing import Literal, get_args

Routing = Literal["native", "prefetch", "predicted"]  # who decides a layer's experts
Predictor = Literal["repeat", "next-router", "heads", "affinity"]  # what prefetch reads ahead with
Executor = Literal["auto", "exact", "staged", "hot", "resident"]  # how routed experts reach the product
IoMode = Literal["pread", "mmap", "direct"]  # how bundles are read
ReadAhead = Literal["measured", "always", "never"]  # when streamed steps read ahead
Placement = Literal["auto", "even"]  # how staged banks share their slots across layers
Eviction = Literal["lfu", "lru"]  # which held expert a slot bank replaces; the first is the default
Dtype = Literal["auto", "source", "float32", "bfloat16", "float16"]  # compute dtype of non-quantized tensors
KernelChoice = Literal["auto", "mlx", "edge0"]  # what computes the quantized products

ROUTINGS: tuple[Routing, ...] = get_args(Routing)
PREDICTORS: tuple[Predictor, ...] = get_args(Predictor)
EXECUTORS: tuple[Executor, ...] = get_args(Executor)
IO_MODES: tuple[IoMode, ...] = get_args(IoMode)
READ_AHEAD: tuple[ReadAhead, ...] = get_args(ReadAhead)
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)
EVICTIONS: tuple[Eviction, ...] = get_args(Eviction)
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
KERNELS: tuple[KernelChoice, ...] = get_args(KernelChoice)
