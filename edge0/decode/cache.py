"""The prompt cache: KV caches of earlier generations, kept by the tokens they hold, so that a prompt sharing
a prefix with one of them (a chat's next turn) prefills only what follows the prefix.

An LRU bounded in bytes, like mlx-lm's LRUPromptCache. A hit gives a copy (the entry stays reusable),
trimmed to the shared prefix where the cache types allow it (attention KV caches do; recurrent states, as in
Qwen3.5's linear attention, only when the entry is a whole prefix of the prompt). At least one prompt token
is always left to prefill, so the routing history a generation starts from (the previous token's experts,
which prerouter heads read) is the same as without the cache.

An entry is stored as owned, evaluated copies of the positions it uses, and counted by those arrays' bytes: a KV
cache allocates in steps of 256 positions, and a batch's extracted row is a lazy view that keeps the whole batch's
buffer alive, so counting the used slice of what it was handed let the cache hold several times its budget.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, _BaseCache, can_trim_prompt_cache, trim_prompt_cache

DEFAULT_GIB = 1.0  # --prompt-cache-gib


@dataclass
class PromptCacheStats:
    """Lookups since start (the server's /metrics)."""

    lookups: int = 0
    hits: int = 0
    tokens: int = 0  # prompt tokens served from the cache


class PromptCache:
    """tokens -> the model's KV cache holding them; least recently used entries dropped past max_bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], list] = OrderedDict()
        self.sizes: dict[tuple[int, ...], int] = {}  # each entry's bytes, counted once when stored
        self.stats = PromptCacheStats()

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def take(self, prompt: list[int]) -> tuple[list | None, int]:
        """(a copy of the cache holding the longest reusable prefix of prompt, its length), or (None, 0)."""
        self.stats.lookups += 1
        best, best_n = None, 0
        limit = len(prompt) - 2  # leave the last two prompt tokens: one to prefill, one to decode from
        for key in self.entries:
            n = min(_common(key, prompt), limit)
            trimmable = can_trim_prompt_cache(self.entries[key])
            if n > best_n and (n == len(key) or trimmable):
                best, best_n = key, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        cache = copy.deepcopy(self.entries[best])
        if best_n < len(best):
            trim_prompt_cache(cache, len(best) - best_n)
        self.stats.hits += 1
        self.stats.tokens += best_n
        return cache, best_n

    def put(self, tokens: list[int], cache: list) -> None:
        """Keep `cache`, which holds exactly `tokens` (owned by the prompt cache from now on)."""
        if self.max_bytes <= 0 or not tokens:
            return
        key = tuple(tokens)
        cache = _owned(cache)
        size = _nbytes(cache)  # from the shapes: nothing is evaluated for an entry that cannot fit
        if size > self.max_bytes:
            return  # it would evict every other entry, then itself
        mx.async_eval(list(_arrays(cache)))  # no wait: a batch may have the next step in flight
        # the same tokens, or a prefix of them: the new entry serves every prompt those served
        for other in [k for k in self.entries if len(k) <= len(key) and key[:len(k)] == k]:
            del self.entries[other], self.sizes[other]
        self.entries[key] = cache
        self.sizes[key] = size
        total = self.nbytes
        while self.entries and total > self.max_bytes:
            total -= self.sizes.pop(self.entries.popitem(last=False)[0])

    def clear(self) -> None:
        self.entries.clear()
        self.sizes.clear()


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _nbytes(cache: list) -> int:
    """The bytes an entry holds: after _owned, each array is its own buffer of exactly its nbytes."""
    return sum(a.nbytes for a in _arrays(cache))


def _arrays(value):
    """Every array inside a cache list, whatever the cache types (CacheList nests caches, ArraysCache a list)."""
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)
    elif isinstance(value, _BaseCache):
        yield from _arrays(list(vars(value).values()))


def _owned(cache: list) -> list:
    """cache with its attention KV cut to the positions it holds and every array a copy of its own (no view into a
    batch's or a longer allocation, once evaluated), not yet evaluated."""
    for c in cache:
        _own(c)
    return cache


def _own(c) -> None:
    if isinstance(c, KVCache) and c.keys is not None and c.keys.shape[2] > c.offset:
        c.keys, c.values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
    for name, value in vars(c).items():
        setattr(c, name, _copied(value))


def _copied(value):
    if isinstance(value, mx.array):
        return mx.array(value)  # a copy: a slice or a row of a batch would share (and keep) the whole buffer
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, _BaseCache):
        _own(value)
    return value
