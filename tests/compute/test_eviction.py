"""Slot replacement policies (compute/eviction.py) and their replay, against hit counts worked out by hand, a brute
force optimum, and the engine's own SlotCache on the same steps."""

import itertools

import numpy as np
import pytest

from edge0.compute.banks import Bank, Fence
from edge0.compute.eviction import DECAY, replay, shared_window, trace_hit_rates
from edge0.compute.executors import SlotCache, SlotStats
from edge0.io.manifest import Piece
from edge0.io.routesynth import synth_trace

# 3 slots, one expert a step. Worked by hand:
# SCAN: 0 and 1 used twice, then a scan of 2, 3, 4, then 0 and 1 again. LRU evicts 0 at step 5 and 1 at step 6
# (least recent), so steps 7 and 8 miss too: hits at 2, 3, 9 = 3. The optimum evicts 2 and then 3 (never used
# again): hits at 2, 3, 7, 8, 9 = 5; LFU does the same (0 and 1 were used twice, 2 and 3 once).
SCAN = [0, 1, 0, 1, 2, 3, 4, 0, 1, 0]
# MIXED: LRU evicts 1 (step 4: used at 1), 2 (step 6), 3 (step 7): hits at 3, 5, 8, 9 = 4; the optimum evicts 2 at
# step 4 (never used again), so 1 hits at step 6: 5 hits. LFU makes LRU's choices here: 4.
MIXED = [0, 1, 2, 0, 3, 0, 1, 4, 0, 1]
HAND = {("SCAN", "lru"): 3, ("SCAN", "lfu"): 5, ("SCAN", "belady"): 5,
        ("MIXED", "lru"): 4, ("MIXED", "lfu"): 4, ("MIXED", "belady"): 5}


@pytest.mark.parametrize("name,policy", sorted(HAND))
def test_replay_counts_the_hits_worked_out_by_hand(name, policy):
    steps = [[e] for e in {"SCAN": SCAN, "MIXED": MIXED}[name]]
    assert replay(steps, 3, policy) == (HAND[name, policy], 10)


def _best(steps: list[frozenset], slots: int) -> int:
    """The most hits any replacement can get: every choice of victims tried (tiny traces only)."""
    best = {frozenset(): 0}  # bank contents -> most hits reaching them
    for ids in steps:
        after = {}
        for bank, hits in best.items():
            h = hits + len(bank & ids)
            keep = bank - ids
            room = slots - len(ids)
            for kept in itertools.combinations(sorted(keep), min(room, len(keep))):
                state = ids | frozenset(kept)
                after[state] = max(after.get(state, -1), h)
        best = after
    return max(best.values())


def _lru(steps: list[frozenset], slots: int) -> int:
    """A textbook LRU over sets: a list in order of use, the oldest not routed now dropped first."""
    order, hits = [], 0
    for ids in steps:
        hits += len(ids & set(order))
        order = [e for e in order if e not in ids] + sorted(ids)
        while len(order) > slots:
            order.pop(0)
    return hits


def test_belady_is_the_optimum_and_lru_is_lru_on_random_steps():
    """Steps of 1 to 3 experts of 6, 4 slots: the replay's Belady equals the brute-force optimum and LFU is no better;
    steps of one expert (no ties of recency): its LRU is the textbook one."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        steps = [frozenset(rng.choice(6, size=int(rng.integers(1, 4)), replace=False).tolist()) for _ in range(9)]
        arrays = [np.array(sorted(s)) for s in steps]
        best = _best(steps, 4)
        assert replay(arrays, 4, "belady", num_keys=6)[0] == best
        assert replay(arrays, 4, "lfu", num_keys=6)[0] <= best
        ones = rng.integers(0, 6, size=12)
        assert replay([[e] for e in ones], 4, "lru", num_keys=6)[0] == _lru([frozenset([e]) for e in ones], 4)


def _cache(policy: str, slots: int = 3, keys: int = 8) -> SlotCache:
    pieces = [Piece(name="w", dtype="U32", shape=[2], offset=0, nbytes=8)]
    return SlotCache(Bank(pieces, slots, Fence(), None), SlotStats(), keys, policy=policy)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("name", ["SCAN", "MIXED"])
def test_a_slot_cache_hits_what_its_policy_hits_by_hand(policy, name):
    """The engine's SlotCache (each step's ids assigned, as a staged layer's decode step does) hits as counted by
    hand: lfu keeps the twice-used experts through a scan, where lru loses them."""
    cache = _cache(policy)
    for e in {"SCAN": SCAN, "MIXED": MIXED}[name]:
        assert cache.assign(np.array([e])) is not None
        cache.bank.fence.sync()  # the step's graph evaluated: its slots may be written
    assert (cache.stats.hits, cache.stats.lookups) == (HAND[name, policy], 10)


def test_a_slot_cache_replaces_as_the_replay_does_on_long_random_routing():
    """Skewed routing of 8 experts of 32 a step, 16 slots, 300 steps: the engine's SlotCache and the replay agree
    hit for hit under each policy (the replay's figures are the engine's), and lfu beats lru on it."""
    rng = np.random.default_rng(1)
    p = 1.0 / np.arange(1, 33) ** 1.1
    steps = [np.sort(rng.choice(32, size=8, replace=False, p=p / p.sum())) for _ in range(300)]
    got = {}
    for policy in ("lru", "lfu"):
        cache = _cache(policy, slots=16, keys=32)
        for ids in steps:
            cache.assign(ids)
            cache.bank.fence.sync()
        got[policy] = cache.stats.hits
        assert replay(steps, 16, policy, num_keys=32) == (cache.stats.hits, cache.stats.lookups)
    assert got["lfu"] > got["lru"]


# RECENT: 0 used three times, then 1, 2, 3, 1, 2 into 3 slots. At step 5, lfu alone replaces 1 (used once, longest
# ago), then misses 1 and 2: hits at 1, 2 = 2. Keeping the slots used in the last 2 lookups (1 and 2), it replaces
# 0: hits at 1, 2, 6, 7 = 4, as LRU and the optimum do.
RECENT = [0, 0, 0, 1, 2, 3, 1, 2]


@pytest.mark.parametrize("window,hits", [(0, 2), (2, 4)])
def test_a_window_keeps_the_last_lookups_experts(window, hits):
    steps = [[e] for e in RECENT]
    assert replay(steps, 3, "lfu", window=window) == (hits, 8)
    assert replay(steps, 3, "lru") == replay(steps, 3, "belady") == (4, 8)
    pieces = [Piece(name="w", dtype="U32", shape=[2], offset=0, nbytes=8)]
    cache = SlotCache(Bank(pieces, 3, Fence(), None), SlotStats(), 8, window=window)  # the engine's, as hot's bank
    for e in RECENT:
        cache.assign(np.array([e]))
        cache.bank.fence.sync()
    assert cache.stats.hits == hits


def test_trace_hit_rates_pool_every_layer():
    ids = np.array([[[e] for e in SCAN], [[e] for e in MIXED]])  # (L=2, T=10, K=1)
    rates = trace_hit_rates(ids, 3)
    assert rates == {"lru": 7 / 20, "lfu": 9 / 20, "belady": 10 / 20}


def _shared_steps(ids: np.ndarray, experts: int) -> list[np.ndarray]:
    """hot's lookups: each token's layers in turn, keys layer * E + expert."""
    return [np.unique(ids[layer, t]) + layer * experts for t in range(ids.shape[1]) for layer in range(len(ids))]


def _textbook(steps: list[np.ndarray], slots: int, policy: str, layers: int, decay: float) -> int:
    """Hits of one bank over `steps`, written plainly: each miss takes an empty slot, else the slot of the held key
    not routed now that goes first (ties: the first slot): lru the least recently used; belady the one used again
    last; lfu (hot's) the least decayed uses, the keys of the last layers - 1 lookups (every other layer's last
    set) after all others, by recency."""
    bank, last, counts, hits = [None] * slots, {}, {}, 0
    for s, ids in enumerate(steps):
        now = set(ids.tolist())
        hits += len(now & set(bank))
        for key in sorted(now - set(bank)):
            def order(i):
                b = bank[i]
                if b is None:
                    return (-1,)
                if policy == "belady":
                    return (0, -next((j for j in range(s + 1, len(steps)) if b in steps[j]), len(steps)))
                recent = policy == "lfu" and last[b] >= s - (layers - 1)
                return (int(recent), 0.0 if recent or policy == "lru" else counts[b], last[b])
            bank[min((i for i in range(slots) if bank[i] not in now), key=order)] = key
        counts = {k: c * decay for k, c in counts.items()}
        for key in now:
            last[key], counts[key] = s, counts.get(key, 0.0) + 1
    return hits


def test_a_shared_bank_hits_what_a_textbook_replay_of_each_policy_hits():
    """hot's one bank over 4 layers of a synthetic trace (OLMoE's token-to-token keep and skew), 20 slots: the
    replay's LRU, Belady and lfu, and the engine's SlotCache as hot builds it, hit what plain replays written here
    hit. hot's lfu keeps every other layer's last set, not the looked-up layer's own (needed a token later): on
    this trace that hits more than keeping all of the last token's sets."""
    layers, experts, slots = 4, 16, 20
    ids = synth_trace(layers, experts, 4, 40, seed=3).ids.astype(np.int64)
    steps = _shared_steps(ids, experts)
    decay = DECAY ** (1 / layers)
    want = {p: _textbook(steps, slots, p, layers, decay) for p in ("lru", "lfu", "belady")}
    lookups = sum(len(s) for s in steps)
    assert trace_hit_rates(ids, slots, num_keys=experts, shared=True) == {p: h / lookups for p, h in want.items()}
    pieces = [Piece(name="w", dtype="U32", shape=[2], offset=0, nbytes=8)]
    cache = SlotCache(Bank(pieces, slots, Fence(), None), SlotStats(), layers * experts, decay=decay,
                      window=shared_window(layers))
    for keys in steps:
        cache.assign(keys)
        cache.bank.fence.sync()
    assert (cache.stats.hits, cache.stats.lookups) == (want["lfu"], lookups)
    whole_token = replay(steps, slots, "lfu", layers * experts, decay, window=layers)[0]
    assert want["lru"] < whole_token < want["lfu"] < want["belady"]
