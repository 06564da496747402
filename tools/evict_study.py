"""Slot replacement on real routing, held out: which policy a staged bank should use (compute/eviction.py).

    python tools/evict_study.py tests/data/olmoe/olmoe-1b-7b-seed{1,2,3}.json --slots 16,32 [--tokens 120]
    python tools/evict_study.py tests/data/olmoe/olmoe-1b-7b-seed{1,2,3}.json --shared 175,256 --rows 11:131

--shared: hot's one bank of that many bundles instead (tools/evict_shared.py), over the trace rows --rows (default
all; 11:131 are the rows `edge0 bench --prompt-tokens 12 --max-tokens 120` serves from the bank).

Every policy's slot hit rate over each trace, as a ratio to the optimum (Belady) at the same slots a layer. What a
policy tunes (lfu's decay, the co-activation weight, the split of slots across layers) is chosen on one trace and
measured on the others, each trace in turn: the figures are held out. Policies:
  lru, lfu            the engine's (lfu: decayed use counts, eviction.DECAY unless tuned);
  lfu+coact           lfu plus a table, counted from the other traces, of which experts of a layer follow which at
                      the next token (what the layer's ids now say of its next set);
  lfu+split           lfu with the slots split across layers by the other traces' marginal hits (same total);
  oracle-next         lfu that knows the next token's set exactly (a bound on any next-step predictor).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge0.compute.eviction import DECAY, replay  # noqa: E402
from edge0.errors import Edge0Error  # noqa: E402
from edge0.io.routetrace import read_trace  # noqa: E402

DECAYS = (0.95, 0.98, 0.99, 1.0)
COACT = (0.0, 0.02, 0.05, 0.1)


def scored(steps, slots: int, score_of, num_keys: int) -> int:
    """Hits of one bank whose victims are the lowest of score_of(t, ids) (keys,), after `replay`'s rules."""
    from evict_shared import scored as bank_hits  # (one replay loop for both studies)

    return bank_hits(steps, slots, lambda t: score_of(t, steps[t]))


def lfu_plus(steps, slots, num_keys, table=None, weight=0.0, oracle=False, decay=DECAY) -> int:
    """lfu's rate of use (decayed counts over their decayed total) plus weight x the table's mean probability that
    a key follows the step's ids; oracle: the next step's keys first."""
    rate = np.zeros((len(steps) + 1, num_keys))  # row t: the rates known before step t
    counts, total = np.zeros(num_keys), 0.0
    for t, ids in enumerate(steps):
        counts *= decay
        counts[ids] += 1
        total = total * decay + 1
        rate[t + 1] = counts / total

    def score(t, ids):
        s = rate[t].copy()
        if table is not None and weight:
            s += weight * table[ids].mean(0)
        if oracle and t + 1 < len(steps):
            s[steps[t + 1]] += 1e6
        return s
    return scored(steps, slots, score, num_keys)


def coact_table(traces, layer: int, num_keys: int) -> np.ndarray:
    """P(key at the next token | key now) of one layer, counted over `traces` (add-one smoothed)."""
    c = np.ones((num_keys, num_keys))
    for ids in traces:
        for a, b in zip(ids[layer][:-1], ids[layer][1:]):
            c[np.ix_(a, b)] += 1
    return c / c.sum(1, keepdims=True)


def split(traces, slots: int, num_keys: int, k: int) -> list[int]:
    """Slots per layer (total layers x slots, at least K each, steps of 2) by the traces' marginal lfu hits."""
    layers = traces[0].shape[0]
    sizes = list(range(k, num_keys + 1, 2))
    gain = np.array([[sum(replay(ids[layer], s, "lfu", num_keys)[0] for ids in traces) for s in sizes]
                     for layer in range(layers)])
    at = np.zeros(layers, dtype=int)
    while sum(sizes[i] for i in at) + 2 <= layers * slots and (at + 1 < len(sizes)).any():
        step = [gain[layer, at[layer] + 1] - gain[layer, at[layer]] if at[layer] + 1 < len(sizes) else -1
                for layer in range(layers)]
        at[int(np.argmax(step))] += 1
    return [sizes[i] for i in at]


def hits(ids, slots, policy, num_keys, *, train=(), decay=DECAY, weight=0.0, sizes=None) -> int:
    """A trace's hits over every layer under `policy` (lookups: every id of it)."""
    out = 0
    for layer, steps in enumerate(ids):
        steps = [np.unique(s) for s in steps]
        s = slots if sizes is None else sizes[layer]
        if policy in ("lru", "belady"):
            out += replay(steps, s, policy, num_keys)[0]
        elif policy == "lfu":
            out += replay(steps, s, "lfu", num_keys, decay=decay)[0]
        elif policy == "lfu+coact":
            out += lfu_plus(steps, s, num_keys, coact_table(train, layer, num_keys), weight, decay=decay)
        elif policy == "oracle-next":
            out += lfu_plus(steps, s, num_keys, oracle=True, decay=decay)
    return out


def study(traces: dict[str, np.ndarray], slots: int, num_keys: int, k: int) -> None:
    names = list(traces)
    rows = {p: [] for p in ("lru", "lfu", "lfu tuned", "lfu+coact", "lfu+split", "oracle-next")}
    for test in names:
        ids = traces[test]
        train = [traces[n] for n in names if n != test]
        tune = train[0]  # tuned on one other trace, as the issue asks
        best = hits(ids, slots, "belady", num_keys)
        d = max(DECAYS, key=lambda d: hits(tune, slots, "lfu", num_keys, decay=d))
        w = max(COACT, key=lambda w: hits(tune, slots, "lfu+coact", num_keys, train=train[1:] or train, weight=w))
        rows["lru"].append(hits(ids, slots, "lru", num_keys) / best)
        rows["lfu"].append(hits(ids, slots, "lfu", num_keys) / best)
        rows["lfu tuned"].append(hits(ids, slots, "lfu", num_keys, decay=d) / best)
        rows["lfu+coact"].append(hits(ids, slots, "lfu+coact", num_keys, train=train, weight=w) / best)
        sizes = split(train, slots, num_keys, k)
        rows["lfu+split"].append(hits(ids, slots, "lfu", num_keys, sizes=sizes) / best)
        rows["oracle-next"].append(hits(ids, slots, "oracle-next", num_keys) / best)
        print(f"  S={slots} test {test}: optimum hit rate {best / ids.size:.3f}; tuned decay {d}, coact weight {w}, "
              f"split {sizes}", flush=True)
    print(f"S={slots} (ratio to the optimum per test trace; mean)")
    for p, r in rows.items():
        print(f"  {p:12s} " + " ".join(f"{x:.3f}" for x in r) + f"   mean {np.mean(r):.3f}")


def _ints(flag: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise Edge0Error(f"{flag} {text}: expected whole numbers, comma-separated") from None
    if min(out) < 1:
        raise Edge0Error(f"{flag} {text}: each must be at least 1")
    return out


def run(a: argparse.Namespace) -> None:
    if len(a.traces) < 2:
        raise Edge0Error("give two or more traces: each is measured with what the others tune")
    loaded = {Path(f).stem: read_trace(f) for f in a.traces}
    shapes = {n: t.ids.shape[0::2] for n, t in loaded.items()}
    if len(set(shapes.values())) > 1:
        raise Edge0Error(f"the traces are of different models (layers, K): {shapes}")
    traces = {n: t.ids[:, :a.tokens].astype(np.int64) for n, t in loaded.items()}
    first = next(iter(loaded.values()))
    num_keys = first.num_experts or int(max(t.max() for t in traces.values())) + 1
    if a.shared:
        from evict_shared import shared_study
        try:
            rows = slice(*(int(x) if x else None for x in a.rows.split(":")))
        except (ValueError, TypeError):
            raise Edge0Error(f"--rows {a.rows}: expected A:B (rows A to B - 1; either may be left out)") from None
        if min(t[:, rows].shape[1] for t in traces.values()) == 0:
            raise Edge0Error(f"--rows {a.rows}: no row of a trace falls there")
        for s in _ints("--shared", a.shared):
            shared_study(traces, s, num_keys, rows)
        return
    for s in _ints("--slots", a.slots):
        study(traces, s, num_keys, first.top_k)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="routing traces of one model (two or more)")
    p.add_argument("--slots", default="16,32", help="slots a layer, comma-separated (default 16,32)")
    p.add_argument("--tokens", type=int, default=None, help="the traces' first N tokens only (default all)")
    p.add_argument("--shared", default=None, help="hot's one shared bank of these bundles, comma-separated")
    p.add_argument("--rows", default=":", help="with --shared: the rows A:B replayed (default all)")
    a = p.parse_args()
    try:
        if a.tokens is not None and a.tokens < 2:
            raise Edge0Error(f"--tokens {a.tokens}: at least 2")
        run(a)
    except Edge0Error as e:
        print(f"evict_study: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
