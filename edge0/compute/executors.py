"""The streaming executor paths beyond exact: staged slot banks, the hot LRU, whole-layer prefill.

All of them compute switch_glu (experts.py) over a bank of slots with the same kernel, so they are
bitwise equal to exact on the same inputs. Fills are plain (slot, expert) lists, read by the store's I/O
pool (io/pool.py) one task per bundle, in parallel, by `fill_slots`.

Shapes: T tokens, K routed, U unique experts of a step, S slots, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import BankBusy
from ..io.pool import ReadTask
from .banks import Bank, Fence
from .eviction import DECAY, POLICIES, Frequency, victim_perm
from .experts import ExactExperts, Quant, bank_positions, switch_glu, unique_ids
from .kernels import host_eval, queue


@dataclass
class SlotStats:
    """Hits and misses of a slot cache (slots already holding the routed expert are hits)."""

    lookups: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


SMALL_BANK = 64  # slots up to which SlotCache.assign works on Python lists (a staged layer's bank)


class SlotCache:
    """A bank whose slots hold keyed bundles (key: expert id, or layer * E + expert when shared), replaced by
    `policy` (eviction.py: lfu, the least often used lately, or lru), never a slot a pending graph reads or a
    read is filling. decay: lfu's per lookup (a shared bank's is per layer's); window: lfu replaces the slots used
    in the last `window` lookups last (a shared bank's: eviction.shared_window)."""

    def __init__(self, bank: Bank, stats: SlotStats, num_keys: int, policy: str = POLICIES[0], decay: float = DECAY,
                 window: int = 0):
        self.bank, self.stats, self.decay, self.window = bank, stats, decay, window
        self.freq: Frequency | None = None  # lfu: lookups' decayed counts per key
        self.slot_of = np.full(num_keys, -1, dtype=np.int64)  # key -> slot, -1 when not held
        self.evict_by(policy)
        self.used = np.zeros(bank.slots, dtype=np.int64)  # clock of each slot's last use
        self.filling = np.zeros(bank.slots, dtype=bool)  # a read into the slot is in flight (scheduler's)
        self.reserved = np.zeros(bank.slots, dtype=bool)  # planned for a step that has not read it yet (scheduler's)
        self.clock = 0

    def evict_by(self, policy: str) -> None:
        """Replace by `policy` (lfu, lru) from now on; lfu counts lookups from now on."""
        self.freq = Frequency(len(self.slot_of), self.decay) if policy == "lfu" else None

    def assign(self, keys: np.ndarray, *, count: bool = True,
               rank: np.ndarray | None = None) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """Slots for unique `keys`, and the (slot, key) fills that make them hold those keys; None when
        too few slots can be written now. rank: a score per key (a head's for the step the fill serves); the
        held keys it scores lowest are replaced first (empty slots before any), else the policy's (ties: the least
        recently used)."""
        if rank is not None and len(rank) != len(self.slot_of):  # keys of several layers (a shared bank)
            rank = None
        recent = False  # lfu's window: the slots used in the last `window` lookups go last (made only on a miss)
        if rank is None and self.freq is not None:
            rank, recent = self.freq.counts, bool(self.window)
        if self.bank.slots <= SMALL_BANK:
            return self._assign_small(keys, count, rank, recent)
        slots = self.slot_of[keys]  # (U,)
        miss = slots < 0
        n_miss = int(miss.sum())
        fills: list[tuple[int, int]] = []
        if n_miss:
            free = self.bank.writable_slots() & ~self.filling & ~self.reserved
            free[slots[~miss]] = False
            free = np.flatnonzero(free)
            if len(free) < n_miss:
                return None
            if rank is None:
                victims = free[np.argsort(self.used[free], kind="stable")][:n_miss]
            else:
                used = self.used[free]
                victims = free[victim_perm(rank, self.bank.holds[free], used,
                                           self.clock - used < self.window if recent else None)][:n_miss]
            old = self.bank.holds[victims]
            self.slot_of[old[old >= 0]] = -1
            self.slot_of[keys[miss]] = victims
            self.bank.holds[victims] = keys[miss]
            slots[miss] = victims
            fills = list(zip(victims.tolist(), keys[miss].tolist()))
        self._used(slots, len(keys) - n_miss, count)
        return slots, fills

    def _assign_small(self, keys: np.ndarray, count: bool, rank: np.ndarray | None,
                      recent: bool = False) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """assign for a bank of a few slots (a staged layer's 2K): the same choice (the writable slots first in
        the order of replacement, ties in slot order) on Python lists, where each of the array version's ~25 numpy
        calls on a handful of elements costs more than the arithmetic."""
        slot_of, holds = self.slot_of, self.bank.holds
        keyl = keys.tolist()
        at = slot_of.item  # (one lookup per key: a fancy index costs more on a handful of keys)
        slotl = [at(k) for k in keyl]
        misses = [i for i, s in enumerate(slotl) if s < 0]
        fills: list[tuple[int, int]] = []
        if misses:
            completed, held = self.bank.fence.completed, set(slotl)
            last_read, filling, reserved = self.bank.last_read.tolist(), self.filling.tolist(), self.reserved.tolist()
            free = [s for s in range(self.bank.slots)
                    if last_read[s] <= completed and not filling[s] and not reserved[s] and s not in held]
            if len(free) < len(misses):
                return None
            used, heldl = self.used.tolist(), holds.tolist()
            if rank is None:
                free.sort(key=used.__getitem__)  # stable: equal clocks stay in slot order, as argsort(kind="stable")
            else:
                free = _victim_sorted(free, rank.item, heldl, used, self.clock - self.window if recent else None)
            for i, slot in zip(misses, free):
                old = heldl[slot]
                if old >= 0:
                    slot_of[old] = -1
                slot_of[keyl[i]] = slotl[i] = slot
                holds[slot] = keyl[i]
                fills.append((slot, keyl[i]))
        if count:
            self.stats.lookups += len(keyl)
            self.stats.hits += len(keyl) - len(misses)
            if self.freq is not None:  # Frequency.use, key by key (unique keys: the same adds)
                counts, weight = self.freq.counts, self.freq.weight
                for k in keyl:
                    counts[k] += weight
                self.freq.tick()
        self.clock += 1
        used, clock = self.used, self.clock
        for s in slotl:
            used[s] = clock
        return np.array(slotl, dtype=np.int64), fills

    def _used(self, slots: np.ndarray, hits: int, count: bool = True) -> None:
        """`slots` are about to be read: now the most recently used; counted as lookups, `hits` of them hits."""
        if count:
            self.stats.lookups += len(slots)
            self.stats.hits += hits
            if self.freq is not None:
                self.freq.use(self.bank.holds[slots])
        self.clock += 1
        self.used[slots] = self.clock

    def holding(self, keys: np.ndarray, slots: np.ndarray) -> bool:
        """Whether unique `keys` are held, whole (no read filling them), at `slots`: then they are looked up
        there as hits (a plan that has landed), with no assignment to make."""
        if len(keys) != len(slots) or not (self.slot_of[keys] == slots).all() or self.filling[slots].any():
            return False
        self._used(slots, len(slots))
        return True

    def forget(self, slots) -> None:
        """Mark `slots` empty (a read into them failed: they may hold half a bundle); lookups miss them."""
        slots = np.asarray(slots, dtype=np.int64)
        held = self.bank.holds[slots]
        self.slot_of[held[held >= 0]] = -1
        self.bank.holds[slots] = -1
        self.used[slots] = 0


def _victim_sorted(free: list, score, held: list, used: list, recent_after: int | None) -> list:
    """`free` (slots in slot order) in eviction.victim_order's order: empty first, then the lowest `score`d held key,
    ties the least recently used, then slot order; used after `recent_after` (lfu's window) last."""
    inf = float("inf")
    if recent_after is None:
        order = [(-inf if held[s] < 0 else score(held[s]), used[s], s) for s in free]
    else:
        order = [(-inf if held[s] < 0 else inf if used[s] > recent_after else score(held[s]), used[s], s) for s in free]
    order.sort()
    return [s for _, _, s in order]


def evict_by(executors, policy: str) -> None:
    """Every slot bank behind `executors` (a runtime's, by layer) replaces by `policy` (--evict)."""
    caches = {id(c): c for c in (getattr(ex, "cache", None) for ex in executors.values()) if c is not None}
    for cache in caches.values():
        cache.evict_by(policy)


def fill_slots(reader, layer: int, bank: Bank, fills: list[tuple[int, int]], num_experts: int | None = None,
               step: int = -1, cached: list[bool] | None = None) -> None:
    """Read each (slot, key) bundle straight into the bank's memory, all of them at once on the I/O pool (one
    preadv per bundle, no MLX op), and wait for them; a failed read raises once every read has stopped. cached:
    per fill, found whole in the page cache just before (`warm_fills`)."""
    if not fills:
        return
    items = [(key % num_experts if num_experts else key, bank.write_buffers(slot)) for slot, key in fills]
    reader.pool.read_bundles(layer, items, bank=bank, slots=[slot for slot, _ in fills], step=step, cached=cached)


class SlottedExperts:
    """Native routing over slot banks: the routed set is read on demand into slots not already holding it.

    staged: each layer has its own bank of S slots (default 2K), keyed by expert id: the slots one step
      reads are never the ones a read for the next step fills (the per-slot write rule).
    hot: every layer shares one large bank keyed by (layer, expert), LRU across layers.
    A step whose unique experts do not fit the bank falls back to exact.
    """

    def __init__(self, reader, layer: int, cache: SlotCache, fence: Fence, exact: ExactExperts,
                 prefill: "WholeLayer | None", *, shared: bool):
        self.reader, self.layer, self.cache, self.fence = reader, layer, cache, fence
        self.exact, self.prefill = exact, prefill
        self.num_experts = reader.manifest.num_experts
        self.key_base = layer * self.num_experts if shared else 0
        self.quant = exact.quant

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.prefill is not None and self.prefill.wants(inds):
            return self.prefill(self.layer, x, inds)
        host_eval(inds)  # SYNC: the routed ids must reach the host to plan the reads
        self.fence.sync()
        host = np.array(inds, copy=False)
        ids = unique_ids(host)
        keys = ids + self.key_base
        cache = self.cache
        got = cache.assign(keys) if cache.bank.slots >= len(ids) else None
        if got is None:  # more experts than slots, or too few writable slots: read them the exact way
            return self.exact.compute(x, host, ids)
        slots, fills = got
        cached = warm_fills(self.reader, self.layer, fills, self.num_experts)
        early = held_first(self.reader, self.layer, x, host, ids, slots, cache.bank, fills, self.quant, cached)
        try:
            fill_slots(self.reader, self.layer, cache.bank, fills, self.num_experts, cached=cached)
        except BaseException:
            cache.forget([slot for slot, _ in fills])  # none of them was committed
            raise
        y = early() if early is not None else switch_glu(x, bank_positions(host, ids, slots), cache.bank.read(slots),
                                                         self.quant, owner=self)
        queue(y)  # the experts compute while Python builds the next layer (the next sync waits)
        return y


def held_first(reader, layer: int, x: mx.array, host: np.ndarray, ids: np.ndarray, slots: np.ndarray, bank: Bank,
               fills: list[tuple[int, int]], quant: Quant, cached: list[bool] | None = None):
    """hits_first's `rest` when some routed experts are held and some of the (slot, key) fills wait for the disk
    (a bundle not wholly in the page cache; `cached`: warm_fills of the fills, when known); else None (the step is
    one gather, built once the fills have landed). A read from the page cache is a copy of a fraction of a
    millisecond, less than the second gather's extra nodes cost (measured on `small`, warm)."""
    if not 0 < len(fills) < len(ids):
        return None
    if all(warm_fills(reader, layer, fills, reader.manifest.num_experts) if cached is None else cached):
        return None
    return hits_first(x, host, ids, slots, bank, np.isin(slots, [slot for slot, _ in fills], invert=True), quant)


def warm_fills(reader, layer: int, fills: list[tuple[int, int]], num_experts: int) -> list[bool]:
    """Per (slot, key) fill, whether its bundle is wholly in the page cache now (the reads then skip the probe)."""
    return [reader.cached(layer, key % num_experts) for _, key in fills]


def hits_first(x: mx.array, host: np.ndarray, ids: np.ndarray, slots: np.ndarray, bank: Bank, held: np.ndarray,
               quant: Quant):
    """Start the routed rows whose experts a bank already holds (`held`, per unique id) computing now, before
    the others' reads land; returns the function that, once they have, builds the rest and puts the rows back in
    routed order. Each (token, k) row is the same product on the same bytes either way, so the output is bitwise
    the one-node gather's; only the stream no longer idles while the misses are read.

    x (..., D), host (..., K) routed ids, ids (U,) their sorted unique values, slots (U,) where each is held."""
    lead, k = host.shape[:-1], host.shape[-1]
    flat = host.reshape(-1)  # (R,) rows in routed order, R = T*K
    at = np.searchsorted(ids, flat)
    pos = np.asarray(slots, dtype=np.uint32)[at]  # (R,) bank positions
    hit = held[at]  # (R,)
    order = np.concatenate([np.flatnonzero(hit), np.flatnonzero(~hit)])  # hits first
    n_hit = int(hit.sum())
    xs = x.reshape(-1, x.shape[-1])  # (T, D)
    token = order // k  # (R,) the token of each reordered row

    def part(rows: np.ndarray) -> mx.array:  # (n, D): row i is token rows[i]'s product with its expert
        p = pos[order[rows]]
        used = bank.read(unique_ids(p))
        if xs.shape[0] == 1:  # one token (a decode step): its rows are one gather of n experts
            return switch_glu(xs, mx.array(p[None]), used, quant)[0]
        return switch_glu(xs[mx.array(token[rows].astype(np.uint32))], mx.array(p[:, None]), used, quant)[:, 0]

    first = part(np.arange(n_hit))
    mx.async_eval(first)

    def rest() -> mx.array:
        y = mx.concatenate([first, part(np.arange(n_hit, len(order)))], axis=0)  # (R, D) in `order`
        return y[mx.array(np.argsort(order).astype(np.uint32))].reshape(*lead, k, -1)

    return rest


class WholeLayer:
    """Prefill: each MoE layer's experts read whole (one preadv per layer, or a few), used for every
    prompt token, the next layer's read running on a worker thread while this layer's read lands and it computes.

    Two E-slot banks alternate between layers; they exist only during prefill (`release`). The reads run
    on the store's I/O pool as demand reads. pack_group_size: the banks keep the edge0 kernel's packed copy, made as
    each layer's read lands, on the thread that read it (compute/banks.py Bank): a prompt's products run faster on it.
    """

    def __init__(self, reader, fence: Fence, compute_dtype, pack_group_size: int | None = None):
        m = reader.manifest
        self.reader, self.fence, self.compute_dtype = reader, fence, compute_dtype
        self.pack_group_size = pack_group_size
        self.order = [e.layer for e in m.layers]
        self.only(self.order)
        self.quant = Quant(m.quantization["bits"], m.quantization["group_size"], m.quantization.get("mode", "affine"))
        self.min_rows = m.num_experts  # T*K at which a step touches about every expert
        self.banks: list[Bank] = []
        self.pending: dict[int, tuple[Bank, ReadTask]] = {}
        self.decode_banks: list[Bank] = []  # the runtime's slot banks (build_runtime): allocated while a prompt computes

    def only(self, layers) -> None:
        """Read only `layers` (all of them at first; the others hold every expert: compute/runtime.py _staged's held
        layers), each read starting as the streamed layer before it computes."""
        keep = set(layers)
        order = [layer for layer in self.order if layer in keep]
        self.next = dict(zip(order, order[1:]))

    def wants(self, inds: mx.array) -> bool:
        """A prompt chunk touching about every expert; never a decode step, even a batch's (B rows of one
        token each): its experts are the batch's union, read into the slot banks."""
        return inds.ndim >= 2 and inds.shape[-2] > 1 and inds.size >= self.min_rows

    def _start(self, layer: int, in_use: Bank | None = None) -> None:
        if not self.banks:  # a prompt's first layer
            m = self.reader.manifest
            self.banks = [Bank(m.pieces, m.num_experts, self.fence, self.compute_dtype,
                               pack_group_size=self.pack_group_size) for _ in range(2)]
        busy = {id(b) for b, _ in self.pending.values()} | {id(in_use)}
        bank = next((b for b in self.banks if id(b) not in busy and b.writable), None)
        if bank is None:
            raise BankBusy(f"whole-layer prefill of layer {layer}: both prefill banks are pending or read by an "
                           "unevaluated graph")
        buffers = [bank.write_buffers(e) for e in range(bank.slots)]  # checked here, on the main thread
        # on a pool thread: bytes only, no MLX op
        task = ReadTask(layer, 0, buffers, demand=True, whole=True, commit=(bank, np.arange(bank.slots)))
        self.pending[layer] = (bank, self.reader.pool.submit([task])[0])

    def __call__(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        mx.async_eval(x)  # the layers before compute while the banks are allocated (their own stream) and read
        if layer not in self.pending:
            self._start(layer)
        bank, task = self.pending.pop(layer)
        nxt = self.next.get(layer)
        if nxt is not None and nxt not in self.pending:  # the other bank is free (the layer before is evaluated):
            self._start(nxt, in_use=bank)  # the next layer's read runs beside this one's and this layer's compute
        for decode in self.decode_banks:  # after the prompt's own banks, on the allocation stream: written while it
            decode.prepare()  # computes, not at their first use, the prompt's last token (once)
        self.reader.pool.wait([task], layer=layer, why="prefill")
        y = switch_glu(x, inds, bank.read(), self.quant)
        mx.eval(y)  # SYNC: compute this layer now so its bank can take the layer after next
        self.fence.sync()
        return y

    def release(self) -> None:
        """Drop the prefill banks (decode does not need them)."""
        self.reader.pool.wait([task for _, task in self.pending.values()], layer=-1, why="prefill")
        self.pending.clear()
        self.banks = []

    def abandon(self) -> None:
        """After a failed generation: wait for the reads in flight (their errors were or will be reported
        elsewhere), then drop them and the banks."""
        self.reader.pool.finish([task for _, task in self.pending.values()])  # never raises the read's error
        self.pending.clear()
        self.banks = []

    def close(self) -> None:
        self.abandon()
