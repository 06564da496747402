"""hot's one shared bank on real routing, held out: policies against the optimum (tools/evict_study.py --shared).

The bank holds (layer, expert) bundles of every layer, looked up layer after layer, token after token. Policies:
  lru                 the least recently used;
  lfu                 the engine's: decayed counts, every other layer's last set kept (eviction.shared_window);
  lfu (whole token)   the engine's before: the looked-up layer's own last set kept as well;
  learned             keeps the highest p / d: p the chance a key is routed at its layer's next lookup, from a
                      logistic model of its recent uses fitted on another trace (held out), d the lookups until then;
  oracle-next         lfu that knows every layer's next set (the next `layers` lookups): a bound on any policy
                      that predicts one token ahead.
"""

from __future__ import annotations

import numpy as np

from edge0.compute.eviction import DECAY, replay, shared_window

RATES = (0.8, 0.95, 1.0)  # decays of the learned model's use rates


def lookups(ids: np.ndarray, experts: int) -> list[np.ndarray]:
    """hot's lookups over ids (L, T, K): keys layer * E + expert, each token's layers in turn."""
    return [np.unique(ids[layer, t]) + layer * experts for t in range(ids.shape[1]) for layer in range(len(ids))]


def scored(steps: list[np.ndarray], slots: int, score, after=None) -> int:
    """Hits of one bank whose victims are the lowest of score(s) (keys,), ties the least recently used, then slot
    order (replay's rules); after(s, keys) is told each lookup."""
    held = np.full(slots, -1)
    used = np.zeros(slots, dtype=np.int64)
    hits = 0
    for s, keys in enumerate(steps):
        here = np.isin(held, keys)
        hits += int(here.sum())
        misses = keys[~np.isin(keys, held)]
        if len(misses):
            sc = np.where(held >= 0, score(s)[np.maximum(held, 0)], -np.inf)
            sc[here] = np.inf
            held[np.lexsort((used, sc))[:len(misses)]] = misses
        used[np.isin(held, keys)] = s + 1
        if after is not None:
            after(s, keys)
    return hits


def oracle_next(steps: list[np.ndarray], slots: int, layers: int, num_keys: int) -> int:
    """lfu (no window) that keeps the keys of the next `layers` lookups first, the soonest needed last replaced."""
    counts, weight, decay = np.zeros(num_keys), 1.0, DECAY ** (1 / layers)

    def score(s):
        sc = counts / weight
        for j in range(min(len(steps) - 1, s + layers), s, -1):
            sc[steps[j]] = 1e12 * (layers + s + 1 - j)
        return sc

    def after(s, keys):
        nonlocal weight
        counts[keys] += weight
        weight /= decay
    return scored(steps, slots, score, after)


class UseModel:
    """Per layer, after each of its lookups: features of every expert (used at the last 3 lookups, decayed use
    rates, log lookups since its last use) and the model's p that the next lookup routes it."""

    def __init__(self, layers: int, experts: int, weights: np.ndarray | None = None):
        self.used = np.zeros((3, layers, experts))
        self.counts = np.zeros((len(RATES), layers, experts))
        self.totals = np.zeros((len(RATES), layers, 1))
        self.since = np.full((layers, experts), 50.0)
        self.weights = weights
        self.p = np.full((layers, experts), 0.125)

    def step(self, layer: int, ids: np.ndarray) -> np.ndarray:
        now = np.zeros(self.used.shape[2])
        now[ids] = 1.0
        self.used[:, layer] = np.roll(self.used[:, layer], 1, axis=0)
        self.used[0, layer] = now
        decays = np.array(RATES)[:, None]
        self.counts[:, layer] = self.counts[:, layer] * decays + now
        self.totals[:, layer] = self.totals[:, layer] * decays + 1
        self.since[layer] = np.where(now > 0, 0, self.since[layer] + 1)
        x = np.concatenate([self.used[:, layer], self.counts[:, layer] / self.totals[:, layer],
                            np.log1p(self.since[layer])[None]]).T  # (E, features)
        if self.weights is not None:
            self.p[layer] = 1 / (1 + np.exp(-(self.weights[0] + x @ self.weights[1:])))
        return x


def fit(ids: np.ndarray, experts: int, ridge: float = 1e-3) -> np.ndarray:
    """The logistic model's weights (intercept first), fitted by Newton's method on one trace: features after a
    layer's token t, label: routed at t + 1."""
    model, xs, ys = UseModel(len(ids), experts), [], []
    for t in range(ids.shape[1] - 1):
        for layer in range(len(ids)):
            xs.append(model.step(layer, ids[layer, t]))
            ys.append(np.isin(np.arange(experts), ids[layer, t + 1]))
    x, y = np.c_[np.ones(sum(map(len, xs))), np.concatenate(xs)], np.concatenate(ys).astype(float)
    w = np.zeros(x.shape[1])
    for _ in range(25):
        p = 1 / (1 + np.exp(-x @ w))
        hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(len(w))
        w -= np.linalg.solve(hess, x.T @ (p - y) + ridge * w)
    return w


def learned(ids: np.ndarray, slots: int, experts: int, weights: np.ndarray) -> int:
    """Hits keeping the highest p / d (UseModel's p; d: lookups until the key's layer is looked up again)."""
    layers = len(ids)
    model = UseModel(layers, experts, weights)
    layer_of = np.repeat(np.arange(layers), experts)

    def score(s):
        return model.p.reshape(-1) / ((layer_of - s % layers - 1) % layers + 1)
    return scored(lookups(ids, experts), slots, score, lambda s, keys: model.step(s % layers, keys % experts))


def shared_study(traces: dict[str, np.ndarray], slots: int, experts: int, rows: slice) -> None:
    """Each policy's hits over each trace's `rows` as a ratio to the optimum's; learned fitted on each other trace
    in turn (its range printed)."""
    names = list(traces)
    table = {p: [] for p in ("lru", "lfu", "lfu (whole token)", "learned", "oracle-next")}
    for test in names:
        ids = traces[test][:, rows]
        layers, steps, keys = len(ids), lookups(ids, experts), len(ids) * experts
        decay = DECAY ** (1 / layers)
        best, total = replay(steps, slots, "belady", keys)
        got = {"lru": replay(steps, slots, "lru", keys)[0],
               "lfu": replay(steps, slots, "lfu", keys, decay, window=shared_window(layers))[0],
               "lfu (whole token)": replay(steps, slots, "lfu", keys, decay, window=layers)[0],
               "oracle-next": oracle_next(steps, slots, layers, keys)}
        for p, h in got.items():
            table[p].append(f"{h / best:.3f}")
        tuned = [learned(ids, slots, experts, fit(traces[n], experts)) / best for n in names if n != test]
        table["learned"].append(f"{min(tuned):.3f}-{max(tuned):.3f}")
        print(f"  {slots} slots, {test}: optimum hit rate {best / total:.3f}", flush=True)
    print(f"{slots} shared slots (ratio to the optimum per trace: {' '.join(names)})")
    for p, r in table.items():
        print(f"  {p:18s} " + " ".join(r))
