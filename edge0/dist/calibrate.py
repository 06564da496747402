"""--split cost's measure of each layer's expert reads: a short decode through an even split before the real one.

Each rank counts the bytes its own layers read from the store per decode step (io/reader.py ReadStats.by_layer) over
CALIBRATION_TOKENS greedy tokens of CALIBRATION_PROMPT; one all_sum gives every rank every layer's. A layer's reads
depend on its routing and its bank, not on which rank runs it, so an even split measures them for any split. Under
`--routes` the calibration forces the trace's first rows (dist/routes.py): the reads the run will do, not the router's.
"""

from __future__ import annotations

import gc

import mlx.core as mx

CALIBRATION_PROMPT = "The history of the city begins"
CALIBRATION_TOKENS = 32


def measured_reads(open_even, group, layers: int, routes=None, routes_file: str | None = None) -> list[int]:
    """Bytes each decoder layer read from the store over the calibration's decode steps (the prompt's reads not
    counted), the same list on every rank. open_even(): this rank's engine of an even split. routes: the run's
    trace (io/routetrace.py RouteTrace, read from routes_file), forced from its row 0 as the run forces it."""
    engine = open_even()
    try:
        mine = _decode_reads(engine, layers, routes, routes_file)
    finally:
        engine.close()
        del engine
        gc.collect()  # its cycles (the trace's hooks, predicted routing's runtime) would hold it beside the run's
    return mx.distributed.all_sum(mx.array(mine, dtype=mx.int64), group=group, stream=mx.cpu).tolist()


def _decode_reads(engine, layers: int, routes, routes_file: str | None) -> list[int]:
    from ..model.traced import attach_routes
    from .routes import rank_routes

    by_layer = engine.store.reader.stats.by_layer
    at_first: list[dict] = []  # the counts when the first token came out (the prompt's reads before it)

    def cancelled() -> bool:
        if not at_first:
            at_first.append(dict(by_layer))
        return False
    prompt = engine.encode_text(CALIBRATION_PROMPT)
    steps = CALIBRATION_TOKENS if routes is None else min(CALIBRATION_TOKENS, routes.num_tokens - len(prompt) + 1)
    req = engine.request(prompt, max_tokens=max(steps, 1), ignore_eos=True)
    traced = attach_routes(engine, rank_routes(engine, routes), req, routes_file=routes_file, record=None)
    engine.generate(req, cancelled=cancelled)
    if traced is not None:
        traced.detach()
    start = at_first[0] if at_first else dict(by_layer)
    return [by_layer.get(i, 0) - start.get(i, 0) for i in range(layers)]
