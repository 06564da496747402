"""A run's routing forced from a routing trace (`--routes FILE`) or recorded into one (`--record-routes FILE`).

    traced = TracedRouting(model, trace=read_trace(path), record=True, what="--routes t.json")
    ... generate ...
    write_trace(out, traced.recorded(prompt_tokens=len(prompt), tokens=prompt + generated))
    traced.detach()

Every Edge0 MoE block routes through its `routes` hook (blocks.py `_routing`): row t of the trace is the sequence's
token t (one sequence, computed from its first token: no prompt cache), the trace's i-th layer the model's i-th MoE
layer. Forced routing uses exactly the traced ids, in their
order; their weights are the trace's where it holds them (a recorded trace replays bit for bit), else the block's
own router's weights for those ids (block.weigh). Shapes: T tokens, K routed, B rows.

A batch (decode/batch.py BatchDecoder) forces each row from its own trace: `TracedRouting(model, traces=[a, b])`,
`admit(i)` before the i-th sequence is admitted (its prompt and first step run alone, B = 1: trace i), then each
batched step's row r follows trace r from its own cursor (rows in order of admission, none left yet).
`sink` takes every call's routing instead of the hooks' own record: `edge0 serve --record-routes` splits a batch's
rows by request (serve/routes_record.py).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..errors import Edge0Error
from ..io.routetrace import RouteTrace, check_fits, write_trace
from .route_stats import moe_blocks


def attach_routes(engine, trace: RouteTrace | None, req, *, routes_file: str | None,
                  record: str | None) -> "TracedRouting | None":
    """The hooks of --routes (`trace`, read from routes_file) / --record-routes (the file `record`) on the engine's
    model for request `req`, the trace checked against the run's shape (its MoE layers, experts, K, and the tokens
    it computes)."""
    if trace is None and record is None:
        return None
    what = f"--routes {routes_file}" if trace is not None else f"--record-routes {record}"
    traced = TracedRouting(engine.store.model, trace=trace, record=record is not None, what=what)
    engine.prompt_cache = None  # the trace's rows are the sequence's from its first token: every one is computed
    if trace is not None:
        steps = min(req.max_tokens, len(req.forced)) if req.forced else req.max_tokens
        check_fits(trace, what, layers=len(traced.blocks), experts=engine.store.manifest.num_experts,
                   top_k=engine.top_k, tokens=len(req.prompt) + steps - 1)
    return traced


def save_routes(record: str | None, traced: "TracedRouting | None", engine, req, tokens: list[int]) -> None:
    """--record-routes (the file `record`): the run's routing, rows [0, prompt) marked the prompt's."""
    if traced is not None and record is not None:
        write_trace(record, traced.recorded(prompt_tokens=len(req.prompt), tokens=list(req.prompt) + tokens,
                                                        num_experts=engine.store.manifest.num_experts))


class TracedRouting:
    """The hooks of every MoE block of `model` for one sequence: forced from `trace` (None: the blocks route) and
    recorded when `record`. `what` names the flag in errors."""

    def __init__(self, model, *, trace: RouteTrace | None = None, record: bool = False, what: str,
                 traces: list[RouteTrace] | None = None, sink=None):
        blocks = moe_blocks(model)
        other = [i for i, b in blocks.items() if not hasattr(b, "routes")]
        if not blocks or other:
            why = f"layers {', '.join(map(str, other))} route in their family's own code" if other else "it has none"
            raise Edge0Error(f"{what}: routing traces need Edge0's own MoE blocks (qwen3_moe, qwen3_5_moe, "
                             f"bailing_moe): {why}")
        self.traces = traces if traces is not None else [trace] if trace is not None else []
        self.record, self.what = record, what
        self.sink = sink  # (layer index, inds, scores) of each call, recorded by the caller (unevaluated)
        self.current = 0  # the trace of a call of one row: the sequence admitted last (admit)
        self.blocks = blocks
        self.layers = [_Layer(self, j) for j in range(len(blocks))]
        for blk, hook in zip(blocks.values(), self.layers):
            blk.routes = hook

    def admit(self, index: int) -> None:
        """The next sequence, admitted alone and then the batch's next row, follows traces[index] from its row 0."""
        if not 0 <= index < len(self.traces):
            raise Edge0Error(f"{self.what}: no trace {index} (of {len(self.traces)})")
        self.current = index

    def detach(self) -> None:
        for blk in self.blocks.values():
            blk.routes = None

    def recorded(self, *, prompt_tokens: int, tokens: list[int] | None = None, num_experts: int | None = None
                 ) -> RouteTrace:
        """What every layer routed to since the hooks were set, as a trace (rows that not every layer routed, as a
        step that raised leaves, dropped)."""
        return trace_of([h.arrays() for h in self.layers], list(self.blocks), prompt_tokens=prompt_tokens,
                        tokens=tokens, num_experts=num_experts)


def trace_of(per: list[tuple[np.ndarray, np.ndarray]], layers: list[int], *, prompt_tokens: int,
             tokens: list[int] | None, num_experts: int | None) -> RouteTrace:
    """The trace of each MoE layer's (T, K) ids and weights: the rows every layer routed, of the sequence's `tokens`
    (the prompt's, then the generated) where given (a step built ahead that fed the end-of-sequence token dropped)."""
    n = min([ids.shape[0] for ids, _ in per] + ([len(tokens)] if tokens is not None else []))
    ids = np.stack([i[:n] for i, _ in per]).astype(np.int32)
    weights = np.stack([w[:n] for _, w in per]).astype(np.float32)
    return RouteTrace(ids, weights, layers, num_experts, min(prompt_tokens, n),
                      None if tokens is None else list(tokens[:n]))


class _Layer:
    """One MoE layer's hook: each trace's rows from its own cursor on, and what it routed."""

    def __init__(self, owner: TracedRouting, index: int):
        self.owner, self.index = owner, index
        self.cursors = [0] * max(1, len(owner.traces))  # per trace: its sequence's next token, the trace's row for it
        self.rows: list[tuple[mx.array, mx.array]] = []  # (inds, scores) of each call, recorded

    def __call__(self, block, x: mx.array, own) -> tuple[mx.array, mx.array]:
        o = self.owner
        lead = x.shape[:-1]  # (B, T) or (T,)
        b, t = math.prod(lead[:-1]), lead[-1]
        which = [o.current] if b == 1 else list(range(b))  # rows in order of admission
        if b > 1 and o.sink is None and (len(o.traces) < b or t != 1):  # a sink splits the rows itself
            raise Edge0Error(f"{o.what}: a batch of {b} rows needs a trace per row (--routes gives "
                             f"{len(o.traces) or 1}), each row one token a step")
        if o.traces:
            inds = mx.array(np.concatenate([self._ids(r, t) for r in which]).astype(np.uint32)).reshape(*lead, -1)
            tr = o.traces[which[0]]
            if all(o.traces[r].weights is not None for r in which):
                w = np.concatenate([o.traces[r].weights[self.index, self.cursors[r]:self.cursors[r] + t] for r in which])
                scores = mx.array(w).reshape(*lead, tr.top_k).astype(x.dtype)
            else:
                scores = block.weigh(block.logits(x), inds)
            for r in which:
                self.cursors[r] += t
        else:
            inds, scores = own(block, x)
            self.cursors[0] += t
        if o.sink is not None:
            o.sink(self.index, inds, scores)
        elif o.record:
            self.rows.append((inds, scores))
        return inds, scores

    def _ids(self, r: int, t: int) -> np.ndarray:
        """(t, K) ids of trace r from its cursor (refused past its end)."""
        tr, start = self.owner.traces[r], self.cursors[r]
        if start + t > tr.num_tokens:
            name = self.owner.what + (f" (trace {r})" if len(self.owner.traces) > 1 else "")
            raise Edge0Error(f"{name}: the trace holds {tr.num_tokens} tokens, the run reached token {start + t}")
        return tr.ids[self.index, start:start + t]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(T, K) ids and weights recorded (evaluated here where they were not)."""
        if not self.rows:
            return np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32)
        ids = [np.array(i).reshape(-1, i.shape[-1]) for i, _ in self.rows]
        w = [np.array(s.astype(mx.float32)).reshape(-1, s.shape[-1]) for _, s in self.rows]
        return np.concatenate(ids), np.concatenate(w)
