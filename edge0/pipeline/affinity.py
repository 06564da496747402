"""The affinity predictor (`--routing prefetch --predictor affinity --affinity FILE`): a co-activation table learned
from recorded routing (`edge0 train affinity`) names layer L+1's likely experts from layer L's routed ids at the same
token, so their speculative reads start while layer L computes.

    table = learn([read_trace("seed1.json"), read_trace("seed3.json")])   # counts (L-1, E, E), freq (L, E)
    table.save("olmoe.affinity.npz"); table = AffinityTable.load("olmoe.affinity.npz", "--affinity t.npz")
    table.scores(3, np.array([5, 9]))   # (E,) layer 4's experts scored from layer 3's routed ids 5 and 9

counts[l, i, j]: tokens at which MoE layer l routed expert i and layer l+1 expert j; freq[l, i]: tokens at which
layer l routed i. A score is the sum over the routed ids i of P(j | i) = counts[l, i, j] / freq[l, i]. Shapes: L MoE
layers, E experts, K routed, T tokens.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import Edge0Error
from ..io.atomic import atomic_path

FORMAT = "edge0-affinity"  # the "format" field of a table's meta
POPULARITY = 1e-3  # a small weight of the next layer's own frequency: breaks ties among experts no routed id names


@dataclass
class AffinityTable:
    counts: np.ndarray  # (L-1, E, E) int64: co-activations of layer l's expert i and layer l+1's expert j
    freq: np.ndarray  # (L, E) int64: tokens at which layer l routed each expert
    top_k: int
    tokens: int  # rows learned from

    @property
    def num_layers(self) -> int:
        return self.freq.shape[0]

    @property
    def num_experts(self) -> int:
        return self.freq.shape[1]

    @cached_property
    def _cond(self) -> np.ndarray:  # (L-1, E, E): P(layer l+1 routes j | layer l routed i), made once, not per step
        return self.counts / np.maximum(self.freq[:-1], 1)[:, :, None]

    @cached_property
    def _pop(self) -> np.ndarray:  # (L, E): each layer's own routing frequency, weighted
        return POPULARITY * (self.freq / max(1, self.tokens))

    def scores(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """(E,) float32: layer+1's experts scored from layer `layer`'s routed (unique) ids at the same token."""
        return (self._cond[layer, np.asarray(ids, dtype=np.int64)].sum(axis=0) + self._pop[layer + 1]).astype(np.float32)

    def predict(self, layer: int, ids: np.ndarray, n: int) -> np.ndarray:
        """layer+1's n likeliest experts (sorted ids) after layer `layer` routed `ids`."""
        s = self.scores(layer, ids)
        return np.sort(np.argsort(-s, kind="stable")[:n])

    def check(self, *, layers: int, experts: int, what: str, error=Edge0Error) -> None:
        """Refuse, naming `what`, a table learned on a model of another shape."""
        if (self.num_layers, self.num_experts) != (layers, experts):
            raise error(f"{what}: learned for {self.num_layers} MoE layers x {self.num_experts} experts; the "
                             f"store has {layers} x {experts}")

    def save(self, path: str | Path) -> None:
        """NPZ, atomically."""
        meta = {"format": FORMAT, "version": 1, "top_k": self.top_k, "tokens": self.tokens}
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez_compressed(f, counts=self.counts.astype(np.int32), freq=self.freq.astype(np.int32),
                                meta=np.array(json.dumps(meta)))

    @classmethod
    def load(cls, path: str | Path, what: str | None = None, error=Edge0Error) -> "AffinityTable":
        """A table written by `save`; anything else is one `error` naming `what` (default the path)."""
        path, what = Path(path), what or str(path)
        if not path.is_file():
            why = "a directory, not a file" if path.is_dir() else "not a regular file" if path.exists() else "no such file"
            raise error(f"{what}: {why}")
        try:
            with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                counts, freq = z["counts"], z["freq"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, TypeError) as e:
            raise error(f"{what}: not an affinity table of `edge0 train affinity` ({type(e).__name__})") from None
        ok = (isinstance(meta, dict) and meta.get("format") == FORMAT and freq.ndim == 2 and counts.ndim == 3
              and counts.shape == (freq.shape[0] - 1, freq.shape[1], freq.shape[1]) and freq.shape[0] >= 2
              and counts.dtype.kind == "i" and freq.dtype.kind == "i" and counts.min(initial=0) >= 0
              and freq.min(initial=0) >= 0 and isinstance(meta.get("top_k"), int) and isinstance(meta.get("tokens"), int))
        if not ok:
            raise error(f"{what}: not an affinity table of `edge0 train affinity` (its fields or shapes)")
        return cls(counts.astype(np.int64), freq.astype(np.int64), meta["top_k"], meta["tokens"])


def learn(traces: list) -> AffinityTable:
    """The table of RouteTraces of one shape (L, E, K) over all their rows."""
    first = traces[0]
    layers, experts, k = first.ids.shape[0], _experts(traces), first.top_k
    counts = np.zeros((layers - 1, experts, experts), np.int64)
    freq = np.zeros((layers, experts), np.int64)
    tokens = 0
    for t in traces:
        ids = t.ids.astype(np.int64)  # (L, T, K)
        for l in range(layers):
            np.add.at(freq[l], ids[l].ravel(), 1)
        for l in range(layers - 1):  # every (i, j) pair of a token: K*K per token
            a = np.repeat(ids[l], k, axis=1).ravel()
            b = np.tile(ids[l + 1], (1, k)).ravel()
            np.add.at(counts[l], (a, b), 1)
        tokens += t.num_tokens
    return AffinityTable(counts, freq, k, tokens)


def _experts(traces: list) -> int:
    return max(t.num_experts or int(t.ids.max()) + 1 for t in traces)


def recall(table: AffinityTable, trace, n: int) -> dict:
    """On a held-out trace, mean over tokens and layers 1..L-1 of the share of a layer's K routed experts that are
    named by: the table's n likeliest from the layer before at the same token ("affinity"), and the layer's own K at
    the token before ("previous")."""
    ids = trace.ids
    layers, tokens, k = ids.shape
    hit_a = hit_p = 0
    for l in range(layers - 1):
        for t in range(tokens):
            want = set(ids[l + 1, t].tolist())
            hit_a += len(want.intersection(table.predict(l, np.unique(ids[l, t]), n).tolist()))
            if t:
                hit_p += len(want.intersection(ids[l + 1, t - 1].tolist()))
    return {"affinity": hit_a / ((layers - 1) * tokens * k), "previous": hit_p / ((layers - 1) * (tokens - 1) * k)}


def plan_next(ex, ids: np.ndarray) -> None:
    """Prefetch's affinity predictor at layer `ex` (a PrefetchExperts whose routed ids `ids` are on the host): the
    next layer's likeliest experts for this step, planned as a speculative fill (ranked by their scores)."""
    rt, nxt = ex.rt, ex.next
    if nxt is None or nxt.held is not None or nxt.cache is None or ids is None:
        return
    table, index = rt.affinity, rt.affinity_index[ex.layer]
    scores = table.scores(index, ids)
    n = rt.guesses or rt.affinity_k
    want = np.sort(np.argsort(-scores, kind="stable")[:n])
    step = rt.sched.step
    rt.plan_later(ex, lambda: rt.sched.prefetch(nxt.layer, nxt.cache, want, step=step, speculative=True, rank=scores))


def attach(rt, path: str, top_k: int, error=Edge0Error) -> None:
    """Give a prefetch runtime routing K experts the table at `path` (checked against its MoE layers and experts)
    and each layer's row of it."""
    what = "{routing.affinity} " + str(path) if error is not Edge0Error else f"--affinity {path}"
    table = AffinityTable.load(path, what, error)
    layers = sorted(rt.executors)
    table.check(layers=len(layers), experts=next(iter(rt.executors.values())).num_experts, what=what, error=error)
    rt.affinity, rt.affinity_k, rt.affinity_index = table, top_k, {layer: i for i, layer in enumerate(layers)}
