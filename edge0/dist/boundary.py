"""Predicted routing across a pipeline boundary: a prerouter head owned by one rank's last MoE layer that routes the
next rank's first MoE layer.

The head's inputs travel with the hidden state, the head runs on the consumer's rank: the head's score is its
consumer's router on the owner's input plus the head's correction (model/heads.py), and the consumer's rank holds
that router, the owner's does not. The owner's rank captures (x, routed ids, previous routed ids) where its layer
would run the head (a stand-in consumer), sends them, and the consumer's rank computes the same prediction with the
same ops on the same bits and files it as the owner's own layer would have: tokens identical to one process.
Only heads that route (--routing predicted) cross; a head that only reads ahead (--routing prefetch) does not, and
its consumer reads on demand.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..errors import Edge0Error


class Part:
    """One rank's share, given to model/load.py's only_layers: its decoder layers (last: the model's last ones, so the
    final norm and head too); adopt() keeps the runtime's heads whose owner and consumer are both here and remembers
    the crossing ones."""

    def __init__(self, layers: range, moe_layers: list[int], last: bool = True):
        self.layers, self.last = layers, last
        self.moe = [m for m in moe_layers if m in layers]
        self.outgoing: list[int] = []  # consumer layers (next rank) of heads owned here
        self.incoming: list[tuple[int, object]] = []  # (consumer layer here, head) of heads owned by the rank before
        self.owner_of: dict[int, int] = {}  # crossing consumer -> owner

    def adopt(self, runtime) -> None:
        hs = getattr(runtime, "heads", None)
        if hs is None:
            return
        here = set(self.layers)
        routes_ahead = getattr(runtime, "predicted_routing", False)
        local = {c: o for c, o in hs.owners.items() if c in here and o in here}
        for c, o in sorted(hs.owners.items()):
            if (c in here) == (o in here):
                continue
            if not routes_ahead or (hs.routes is not None and c not in hs.routes):
                continue  # a head that only reads ahead: its consumer reads on demand
            if c < o or any(o < m < c for m in self._all_moe(hs)):
                raise Edge0Error(f"head for layer {c} (owned by layer {o}): a head crossing ranks must be owned by the "
                                 "MoE layer just before its consumer")
            self.owner_of[c] = o
            if o in here:
                self.outgoing.append(c)
            else:
                self.incoming.append((c, hs.heads[c]))
        runtime.heads = dataclasses.replace(hs, heads={c: hs.heads[c] for c in local}, owners=local)

    def _all_moe(self, hs) -> list[int]:
        return sorted(set(hs.owners) | set(hs.owners.values()))


class _Sink(dict):
    """Accepts what the owner's layer files for its consumer (decisions, waiting reads), keeps nothing."""

    def __setitem__(self, key, value) -> None:
        pass

    def append(self, item) -> None:
        pass


class _CaptureBlock:
    """The stand-in consumer's router: nothing computed, only a shape (B, T, 1)."""

    top_k = 1
    candidates = None

    def logits(self, x: mx.array) -> mx.array:
        return x[..., :1]

    def decide(self, scores: mx.array):
        z = mx.zeros(scores.shape, dtype=mx.uint32)
        return z, z

    select = decide


class _Remote:
    """The stand-in for a consumer on the next rank, in its owner's list of heads (pipeline/prefetch.py,
    pipeline/resident.py): what those file for it goes nowhere."""

    predicted_routing = True
    held = None
    ran = -1  # never ready to plan: it has no bank here

    def __init__(self, layer: int):
        self.layer = layer
        self.block = _CaptureBlock()
        self.decided = _Sink()
        self.ahead = _Sink()
        self.waiting = _Sink()


class _CaptureHead:
    """The head as its owner's layer calls it: keeps the inputs (h, inds, prev) for the message, rows in order."""

    def __init__(self, boundary: "Boundary", consumer: int):
        self.boundary, self.consumer = boundary, consumer

    def predict(self, h: mx.array, inds: mx.array, prev, router: mx.array) -> mx.array:
        self.boundary.captured[self.consumer].append((h, inds, prev))
        return router


class Boundary:
    """The crossing heads of one rank, wired into its runtime once the model is loaded."""

    def __init__(self, part: Part, runtime, num_experts: int):
        self.part, self.rt, self.num_experts = part, runtime, num_experts
        self.outgoing = list(part.outgoing)
        self.incoming = list(part.incoming)
        self.captured: dict[int, list] = {c: [] for c in self.outgoing}
        for c in self.outgoing:
            owner = runtime.executors[part.owner_of[c]]
            owner.heads.append((_CaptureHead(self, c), _Remote(c)))
            if hasattr(owner, "routes_ahead"):
                owner.routes_ahead = True
        for c, _ in self.incoming:
            _route_by_remote_head(runtime, runtime.executors[c])
        if self.incoming and hasattr(runtime, "recount_overlap"):  # the staged pipeline: its consumers routed now
            runtime.recount_overlap()

    def begin(self) -> None:
        for rows in self.captured.values():
            rows.clear()

    def sent(self, b: int) -> list[mx.array]:
        """(x, inds, prev) of each outgoing head for this decode step, B rows (prev: id E, naming no expert, where
        the owner had no previous token, as pipeline/prefetch.py joined_history)."""
        out = []
        for c in self.outgoing:
            rows = self.captured[c]
            if not rows:
                raise Edge0Error(f"pipeline: layer {self.part.owner_of[c]} ran no head for layer {c} this step")
            x = mx.concatenate([r[0] for r in rows]) if len(rows) > 1 else rows[0][0]
            inds = mx.concatenate([r[1] for r in rows]) if len(rows) > 1 else rows[0][1]
            prevs = [r[2] if r[2] is not None else mx.full(r[1].shape, self.num_experts, dtype=mx.uint32) for r in rows]
            prev = mx.concatenate(prevs) if len(prevs) > 1 else prevs[0]
            out += [x, inds.astype(mx.uint32), prev.astype(mx.uint32)]
        return out

    def received(self, features: list[mx.array]) -> None:
        """The owner's (x, inds, prev) per incoming head: its prediction for the next step, filed as the owner's
        layer would have filed it."""
        from ..pipeline.prefetch import Prediction, head_per_row

        for i, (c, head) in enumerate(self.incoming):
            x, inds, prev = features[3 * i: 3 * i + 3]
            ex = self.rt.executors[c]
            blk = ex.block
            scores = head_per_row(head, x, inds, prev, blk.logits(x))
            p_inds, plan = (getattr(blk, "decide", None) or blk.select)(scores)
            if hasattr(self.rt, "sched"):  # the staged pipeline: pulled and planned as any prediction
                self.rt.pending.append(Prediction(ex, self.rt.sched.step + 1, p_inds, plan))
                mx.async_eval(p_inds, plan)
            else:  # resident experts: decided in the graph
                ex.ahead[self.rt.step + 1] = (p_inds, plan)


def _route_by_remote_head(rt, ex) -> None:
    """The consumer takes the routing its (remote) owner's head decides, as runtime.link wires a local one."""
    blk = ex.block
    blk.planned = ex.planned
    if hasattr(blk, "choose"):
        blk.candidates = rt.candidates
    if hasattr(ex, "predicted_routing"):
        ex.predicted_routing = True
        ex.planned_by = "remote"

