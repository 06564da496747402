"""Which held expert a slot bank replaces, and a replay of a routing trace through one (no MLX, no files).

    replay(trace.ids[layer], slots=16, policy="lfu")        # (hits, lookups) of that layer's bank
    trace_hit_rates(trace.ids, slots=16)                   # {"lru": .., "lfu": .., "belady": ..} over every layer

Policies: `lfu` (the default) replaces the held expert used least often, each use weighted DECAY per step since
(ties: the least recently used); `lru` the least recently used; `belady` (replay only: it reads the future) the one
used again last, the optimum. lfu is the default because on real routing (docs/BENCHMARKS.md) a layer's experts
keep a popularity within a generation that a recency order forgets in a few steps.
Shapes: T steps, K routed, S slots, E experts.
"""

from __future__ import annotations

import numpy as np

from .choices import EVICTIONS as POLICIES  # what a bank may use

DECAY = 0.99  # per step: a use 69 steps ago counts half (a shared bank decays per layer step: decay ** (1 / layers))
_RESCALE = 1e100  # weights are rescaled before growing past this


class Frequency:
    """Decayed use counts of every key, kept as counts scaled by 1 / decay ** steps (one add per use, no decay of
    every key per step); only their order matters."""

    def __init__(self, num_keys: int, decay: float = DECAY):
        self.counts = np.zeros(num_keys)  # (keys,) decayed uses, scaled by `weight`
        self.weight = 1.0  # what a use adds now
        self.decay = decay

    def use(self, keys) -> None:
        """One step (one lookup of `keys`) has passed."""
        self.counts[keys] += self.weight
        self.tick()

    def tick(self) -> None:
        """`use`'s step, its keys already counted (a few keys are added one by one: SlotCache's small banks)."""
        self.weight /= self.decay
        if self.weight > _RESCALE:
            self.counts /= self.weight
            self.weight = 1.0


def victim_order(score: np.ndarray, held: np.ndarray, used: np.ndarray, recent: np.ndarray | None = None) -> np.ndarray:
    """Each slot's place in the order of replacement when `score` scores each key (slots holding keys `held`, -1:
    empty): empty first, then the lowest scored, ties the least recently used (lower `used` goes first), then in
    slot order; slots marked `recent` last of all (by recency)."""
    perm = victim_perm(score, held, used, recent)
    order = np.empty_like(perm)
    order[perm] = np.arange(len(perm))  # the inverse permutation: no second sort
    return order


def victim_perm(score: np.ndarray, held: np.ndarray, used: np.ndarray, recent: np.ndarray | None = None) -> np.ndarray:
    """The slots in victim_order's order of replacement (first replaced first)."""
    key_score = np.where(held >= 0, score[np.maximum(held, 0)], -np.inf)
    if recent is not None:
        key_score = np.where(recent & (held >= 0), np.inf, key_score)
    return np.lexsort((used, key_score))


def replay(steps, slots: int, policy: str = "lfu", num_keys: int | None = None, decay: float = DECAY,
           window: int = 0) -> tuple[int, int]:
    """Hits and lookups of one bank of `slots` over `steps` ((T, K) routed ids, or a list of id arrays), each step's
    unique ids looked up and its misses filled as SlotCache.assign does (empty slots first, in slot order; the
    `policy`'s victims among the slots not holding one of the step's ids; lfu: the slots used in the last `window`
    lookups last); a step of more ids than slots is not looked up (the engine reads it the exact way)."""
    steps = [np.unique(np.asarray(s)) for s in steps]
    num_keys = num_keys or (1 + max((int(s.max()) for s in steps if s.size), default=0))
    held = np.full(slots, -1, dtype=np.int64)
    used = np.zeros(slots, dtype=np.int64)
    freq = Frequency(num_keys, decay)
    future = _next_uses(steps, num_keys) if policy == "belady" else None
    hits = lookups = clock = 0
    for t, ids in enumerate(steps):
        if len(ids) > slots:
            continue
        here = np.isin(held, ids)
        hits += int(here.sum())
        lookups += len(ids)
        misses = ids[~np.isin(ids, held)]
        if len(misses):
            score = {"lfu": freq.counts, "lru": np.zeros(num_keys), "belady": None}[policy]
            if score is None:
                score = -future[t + 1]  # used again last: lowest
            recent = clock - used < window if window and policy == "lfu" else None
            order = victim_order(score, held, used, recent)
            order[here] = slots  # never a slot the step reads
            victims = np.argsort(order, kind="stable")[:len(misses)]
            held[victims] = misses
        clock += 1
        used[np.isin(held, ids)] = clock
        freq.use(ids)
    return hits, lookups


def shared_window(layers: int) -> int:
    """lfu's window in one bank every layer shares (hot): the last `layers - 1` lookups, every other layer's last
    set (each needed again within a token), not the looked-up layer's own (needed again only a token later)."""
    return layers - 1


def trace_hit_rates(ids: np.ndarray, slots: int, policies=("lru", "lfu", "belady"), num_keys: int | None = None,
                    shared: bool = False) -> dict[str, float]:
    """Slot hit rate over a trace's ids (L, T, K), per policy: hits over lookups, every layer together, of a staged
    bank of `slots` per layer, or (shared) of one bank of `slots` for every layer (hot: keys layer * E + expert,
    looked up layer after layer, token after token; lfu keeps every other layer's last experts: shared_window)."""
    num_keys = num_keys or int(ids.max()) + 1
    layers = ids.shape[0]
    out = {}
    for policy in policies:
        if shared:
            steps = [ids[layer, t].astype(np.int64) + layer * num_keys for t in range(ids.shape[1])
                     for layer in range(layers)]
            got = [replay(steps, slots, policy, layers * num_keys, DECAY ** (1 / layers),
                          window=shared_window(layers))]
        else:
            got = [replay(layer, slots, policy, num_keys) for layer in ids]
        out[policy] = sum(h for h, _ in got) / max(1, sum(n for _, n in got))
    return out


def _next_uses(steps: list[np.ndarray], num_keys: int) -> np.ndarray:
    """(T + 1, keys): the first step at or after t that uses each key (T + 1: never again)."""
    out = np.full((len(steps) + 1, num_keys), len(steps) + 1, dtype=np.int64)
    for t in range(len(steps) - 1, -1, -1):
        out[t] = out[t + 1]
        out[t, steps[t]] = t
    return out
