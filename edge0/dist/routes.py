"""`edge0 run --routes` on a pipeline rank: the trace's rows of this rank's MoE layers only (a rank's model holds
its own layers, model/traced.py forces them in order). An expert-parallel rank holds every layer: the whole trace."""

from __future__ import annotations

import dataclasses


def rank_routes(engine, trace):
    """`trace` (io/routetrace.py RouteTrace, or None) as this rank's model routes: on a pipeline rank, the rows of
    the MoE layers it runs (the store's i-th MoE layer is the trace's i-th row); elsewhere `trace` unchanged."""
    stage = getattr(engine, "stage", None)
    whole = getattr(engine.store.manifest, "whole", None)
    if trace is None or stage is None or whole is None or len(trace.layers) != len(whole.layers):
        return trace  # one process, expert parallel, or a trace of another shape (check_fits says so)
    rows = [i for i, e in enumerate(whole.layers) if e.layer in stage.layers]
    weights = trace.weights[rows] if trace.weights is not None else None
    return dataclasses.replace(trace, ids=trace.ids[rows], weights=weights, layers=[trace.layers[i] for i in rows])


def refuse_record(record: str | None) -> None:
    """--record-routes under mlx.launch: refused (each rank routes only its own layers, and every rank would write the
    same path)."""
    from . import world
    from ..errors import Edge0Error

    if record is not None and world() is not None:
        raise Edge0Error(f"--record-routes {record}: not under edge0 launch (each rank routes only its own layers); "
                         "record with one process")
