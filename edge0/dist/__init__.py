"""One model across several processes or machines on MLX's distributed layer (`mlx.launch`).

    edge0 launch -n 2 -- run --prompt "def fib(n):"          # two local ranks, ring backend over 127.0.0.1
    mlx.launch --hostfile hosts.json --backend ring -- edge0 run --model STORE ...

Pipeline parallel (dist/pipeline.py): the decoder layers split into contiguous ranges, one per rank; each rank loads
only its layers' resident weights and streams only its layers' experts (its own banks, scheduler and I/O pool).
Every rank runs the same decode loop on the same logits; rank 0 prints.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import structlog

from ..engine import open_engine as open_one
from ..errors import Edge0Error


MODE_ENV = "EDGE0_PARALLEL"  # set by `edge0 launch --parallel` for every rank
MODES = ("pipeline", "experts")


def world():
    """MLX's distributed group when started by mlx.launch (size > 1), else None."""
    if not any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "MLX_HOSTFILE")):
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def same_seed(group) -> None:
    """Every rank's random state from one seed drawn on rank 0: sampling at temperature draws alike everywhere."""
    seed = int.from_bytes(os.urandom(4), "little") >> 1 if group.rank() == 0 else 0
    seed = mx.distributed.all_sum(mx.array(seed, dtype=mx.int64), group=group, stream=mx.cpu).item()
    mx.random.seed(seed)


def open_engine(config, *, trace=None, quiet_others: bool = True, serving: bool = False, routes=None,
                routes_file: str | None = None):
    """engine.open_engine, or under mlx.launch this rank's share of the pipeline (same interface: the engine
    generates on every rank). quiet_others: ranks other than 0 write nothing to stdout. serving: rank 0 posts each
    generation to the other ranks, which follow it (dist/serve.py). routes: the run's --routes trace (read from
    routes_file), which --split cost's calibration forces too."""
    from ..sched.trace import NULL

    trace = NULL if trace is None else trace
    group = world()
    if group is None:
        return open_one(config, trace=trace)
    from .rank import open_expert_rank, open_rank

    if quiet_others and group.rank() != 0:
        sys.stdout = open(os.devnull, "w")
    if group.rank() != 0:  # its log lines say whose they are (rank 0's are the service's)
        structlog.contextvars.bind_contextvars(rank=group.rank())
    mode = os.environ.get(MODE_ENV, "pipeline")
    if mode not in MODES:
        raise Edge0Error(f"{MODE_ENV}={mode}: choose {' or '.join(MODES)}")
    if mode == "experts":  # no calibration: every rank holds every layer
        return open_expert_rank(config, group, trace=trace, serving=serving)
    return open_rank(config, group, trace=trace, serving=serving, routes=routes, routes_file=routes_file)


def serving_engine(config):
    """The engine `edge0 serve` opens: rank 0's of a served pipeline under mlx.launch, else engine.open_engine."""
    return open_engine(config, serving=True)


def follow_served(config) -> bool:
    """On a rank > 0 under mlx.launch: open this rank's share, generate what rank 0 posts until it stops; True.
    Elsewhere nothing (False): the caller serves."""
    group = world()
    if group is None or group.rank() == 0:
        return False
    from .serve import follow

    with open_engine(config, serving=True) as engine:
        follow(engine, group)
    return True
