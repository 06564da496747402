"""Open one rank's share of a pipeline: its layers loaded (model/load.py only_layers), its model wrapped."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import mlx.core as mx

from ..engine import open_engine, resolve
from ..errors import Edge0Error
from ..log import log
from . import same_seed
from .boundary import Boundary, Part
from .experts import layer_at_a_time
from .pipeline import PipelineModel, Stage, decoder, make_stage
from .serve import lead, lost_while_idle, stop_when_lost
from .split import SPLIT_ENV, choose_split, even_split, layer_costs


def open_rank(config, group, *, trace, split: list[range] | None = None, serving: bool = False, routes=None,
              routes_file: str | None = None):
    """This rank's engine: layers split[rank] (default an even split) of the store `config` names. serving: rank 0
    posts each generation to the others (dist/serve.py). routes: the run's trace, forced by --split cost's
    calibration (read from routes_file)."""
    from ..io.manifest import read_manifest
    from ..model.arch import read_config, text_config
    from ..model.load import only_layers

    c = resolve(config)
    if c.serving.max_batch > 1:
        log.info(f"pipeline: one sequence at a time (--max-batch {c.serving.max_batch} -> 1)")
    # every rank decides alike: no prompt cache (each rank's holds other bytes, so its evictions would differ)
    c = dataclasses.replace(c, serving=dataclasses.replace(c.serving, max_batch=1, prompt_cache_gib=0))
    root = Path(c.model)
    same_store(group, root)
    layers = text_config(read_config(root))["num_hidden_layers"]
    moe = [e.layer for e in read_manifest(root).layers]
    reads = None
    if split is None:
        split, costs, reads = _chosen(config, group, root, layers, routes, routes_file)
    else:
        costs = layer_costs(root, layers)
    mine = split[group.rank()]
    part = Part(mine, moe, last=mine.stop == layers)
    lora = c.routing.lora
    with only_layers(part):
        engine = open_engine(dataclasses.replace(c, routing=dataclasses.replace(c.routing, lora="none")), trace=trace)
    try:
        store = engine.store
        if lora not in (None, "none"):
            attach_adapter(store, lora, c.routing.heads, mine)
            served = engine.config
            engine.config = dataclasses.replace(served, routing=dataclasses.replace(served.routing, lora=lora))
        boundary = None
        if part.outgoing or part.incoming:
            boundary = Boundary(part, store.runtime, store.manifest.num_experts)
        layer_at_a_time(engine)  # a prompt read layer by layer: a rank's memory shrinks with the ranks
        stage = make_stage(store.model, group, mine, engine.top_k, boundary)
        store.model = PipelineModel(store.model, stage)
        engine.stage = stage
        engine.describe = _described(engine.describe, stage, split)
        join(engine, group, serving)
    except BaseException:
        engine.close()
        raise
    if group.rank() == 0:
        mib = " ".join(f"{sum(costs[i] for i in r) / 2**20:.1f}" for r in split)
        shares = {} if reads is None or not sum(reads) else {"reads_share": " ".join(
            f"{sum(reads[i] for i in r) / sum(reads):.2f}" for r in split)}
        log.info("pipeline", ranks=group.size(), layers=" ".join(f"{r.start}-{r.stop - 1}" for r in split),
                 mib_per_rank=mib, **shares, crossing_heads=len(part.outgoing))
    return engine


def _chosen(config, group, root: Path, layers: int, routes, routes_file: str | None):
    """(EDGE0_SPLIT's ranges, each layer's bytes held, each layer's reads measured where --split cost, else None)."""
    spec, reads = os.environ.get(SPLIT_ENV, "even"), None
    if spec == "cost":  # each layer's expert reads, measured by a short decode over an even split (routed as the run)
        from ..sched.trace import NULL
        from .calibrate import measured_reads

        even = even_split(layers, group.size())
        reads = measured_reads(lambda: open_rank(config, group, trace=NULL, split=even), group, layers, routes,
                               routes_file)
    return *choose_split(spec, root, layers, group.size(), reads), reads


def same_store(group, root: Path) -> None:
    """Every rank opens the same model: its edge0.json and config.json alike on every host (a copy per host may differ,
    and ranks of different models would exchange hidden states of other shapes)."""
    import zlib

    try:
        crc = zlib.crc32((root / "edge0.json").read_bytes() + (root / "config.json").read_bytes())
    except OSError:
        crc = 0  # no store here: load_store says so
    got = mx.distributed.all_gather(mx.array([crc], dtype=mx.uint32), group=group, stream=mx.cpu).tolist()
    other = next((r for r, c in enumerate(got) if c != got[0]), None)
    if other is not None:
        raise Edge0Error(f"{root}: rank {other}'s store differs from rank 0's (edge0.json or config.json); every rank "
                         "needs the same store (a copy on each host, or one shared path)")


def join(engine, group, serving: bool) -> None:
    """What every mode's rank does once its engine is open: rank 0 of a served one posts each request (dist/serve.py),
    a lost rank is one clear error, every rank samples from one seed."""
    lifeline = None
    if serving:  # every rank: rank 0 hears at once of a rank that ends, even while idle
        from .lifeline import Lifeline

        lifeline = Lifeline(group, lost_while_idle(engine) if group.rank() == 0 else None)
        engine.lifeline = lifeline  # a rank > 0's connection stays open while it runs
    if serving and group.rank() == 0:
        lead(engine, group, lifeline)
    engine.generate = _peers_kept(engine.generate, group.rank())
    if serving and group.rank() == 0:
        stop_when_lost(engine, group.rank())
    same_seed(group)
    same_overlap(engine.store.runtime, group)
    engine.close = _closing(engine, engine.close)


def _closing(engine, close):
    """close, then the wrappers above dropped: they refer back to the engine, a cycle that kept its banks and weights
    until the garbage collector ran (the next engine in this process, as after --split cost's calibration, beside)."""
    def call(*args, **kwargs):
        try:
            close(*args, **kwargs)
        finally:
            for name in ("generate", "describe", "reset", "close"):
                vars(engine).pop(name, None)
    return call


def same_overlap(runtime, group) -> None:
    """Decode steps overlap on every rank or on none. The ranks run one loop in step; where only some overlap (a rank
    whose layers all predict their routing beside one that syncs with the host), those run a step ahead at the end
    whose messages the others never send."""
    mine = bool(runtime.overlaps_steps)
    others = mx.distributed.all_sum(mx.array(int(not mine)), group=group, stream=mx.cpu).item()
    if not mine or others == 0:
        return
    if "overlaps_steps" in vars(runtime):  # the staged runtime's, set when it linked its heads
        runtime.overlaps_steps = False
    else:  # a runtime's property
        runtime.__class__ = type(type(runtime).__name__, (type(runtime),), {"overlaps_steps": False})


def open_expert_rank(config, group, *, trace, serving: bool = False):
    """This rank's engine in expert parallel (dist/experts.py): every layer, its share of every layer's experts."""
    from .experts import shard_experts

    c = resolve(config)
    if c.routing.mode != "native":
        raise Edge0Error(f"expert parallel routes with the model's router: --routing {c.routing.mode} does not apply "
                         "(pass --routing native)")
    if c.serving.max_batch > 1:
        log.info(f"expert parallel: one sequence at a time (--max-batch {c.serving.max_batch} -> 1)")
    # staged banks: resident experts would read every expert into every rank
    executor = "staged" if c.io.executor == "auto" else c.io.executor
    slots = c.io.slots
    if executor == "staged" and slots is None:  # a rank's bank holds its own experts: one process's 2K slots shared
        from ..io.manifest import read_manifest

        k = c.routing.top_k or read_manifest(Path(c.model)).top_k
        slots = max(k, -(-2 * k // group.size()))
    c = dataclasses.replace(c, serving=dataclasses.replace(c.serving, max_batch=1, prompt_cache_gib=0),
                            io=dataclasses.replace(c.io, executor=executor, slots=slots))
    same_store(group, Path(c.model))
    engine = open_engine(c, trace=trace)
    try:
        traffic = shard_experts(engine, group)
        describe = engine.describe
        engine.describe = lambda: {**describe(), "experts_parallel": {
            "ranks": group.size(), "rank": group.rank(), "sent_bytes": traffic.bytes_sent,
            "messages": traffic.messages}}
        engine.traffic = traffic
        join(engine, group, serving)
    except BaseException:
        engine.close()
        raise
    if group.rank() == 0:
        log.info("expert parallel", ranks=group.size(), experts="id % ranks == rank", executor=executor,
                 **({"slots": slots} if slots is not None else {}))
    return engine


def _peers_kept(generate, rank: int):
    """generate, a lost connection to another rank (it stopped or failed) one clear error instead of MLX's."""
    def call(*args, **kwargs):
        try:
            return generate(*args, **kwargs)
        except RuntimeError as e:
            if "[ring]" not in str(e) and "[jaccl]" not in str(e):
                raise
            raise Edge0Error(f"rank {rank}: another rank stopped or failed, the pipeline stops ({e})") from None
    return call


def _described(describe, stage: Stage, split: list[range]):
    """describe() with the pipeline's figures: ranks, each one's layers, what this rank sent since it loaded."""
    def call() -> dict:
        return {**describe(), "pipeline": {
            "ranks": stage.size, "rank": stage.rank, "layers": [[r.start, r.stop - 1] for r in split],
            "sent_bytes": stage.bytes_sent, "received_bytes": stage.bytes_received, "messages": stage.messages}}
    return call


def attach_adapter(store, path: str, heads, layers: range) -> None:
    """The recovery adapter's branches of this rank's layers (engine.open_engine attaches all of them)."""
    import re
    from types import SimpleNamespace

    import mlx.nn as nn

    from ..model.lora import Adapter

    adapter = Adapter.load(path, store.manifest.whole, store.config, heads_file=heads)
    layer = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    adapter.weights = {k: v for k, v in adapter.weights.items()
                       if (m := layer.search(k)) is None or int(m.group(1)) in layers}
    # the model's layers by their numbers, another rank's an empty module: no projection to adapt
    layers_of = SimpleNamespace(layers=[m if m is not None else nn.Module() for m in decoder(store.model).layers])
    adapter.attach(layers_of, Adapter.served_dtype(store.dtype))
