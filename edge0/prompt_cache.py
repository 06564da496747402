"""The prompt cache: KV caches of earlier generations, kept by the tokens they hold, so that a prompt sharing
a prefix with one of them (a chat's next turn) prefills only what follows the prefix.

An LRU bounded in bytes, like mlx-lm's LRUPromptCache. A hit gives a copy (the entry stays reusable),
trimmed to the shared prefix where the cache types allow it (attention KV caches do; recurrent states, as in
Qwen3.5's linear attention, only when the entry is a whole prefix of the prompt). At least one prompt token
is always left to prefill, so the routing history a generation starts from (the previous token's experts,
which prerouter heads read) is the same as without the cache.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

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
        self.stats = PromptCacheStats()

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(c) for c in self.entries.values())

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
        self.entries.pop(key, None)
        for other in [k for k in self.entries if len(k) < len(key) and key[:len(k)] == k]:
            del self.entries[other]  # a prefix of the new entry: the new one serves every prompt it served
        self.entries[key] = cache
        while self.entries and self.nbytes > self.max_bytes:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _nbytes(cache: list) -> int:
    total = 0
    for c in cache:
        state = c.state if isinstance(c.state, (list, tuple)) else [c.state]
        total += sum(getattr(a, "nbytes", 0) for a in state if a is not None)
    return total
