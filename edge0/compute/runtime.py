"""Builds the expert executors of a store for one executor choice and memory budget, and holds what
they share: the fence, the slot caches and their statistics, the whole-layer prefill."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx

from .choices import EXECUTORS
from ..errors import Edge0Error, SettingError
from ..io.cgroup import memory_room
from .banks import Bank, Fence
from .eviction import DECAY, shared_window
from .executors import SlotCache, SlotStats, SlottedExperts, WholeLayer
from .experts import ExactExperts, ResidentExperts

DEFAULT_HOT_GIB = 1.0  # hot LRU size when no --memory-budget is given
PACK_BANK_BYTES = 1 << 20  # a slot bank keeps the kernel's packed copy only of bundles larger than this: each fill
# repacks its slot (on the thread that read it: the graph-building one for a bundle this small in the page cache),
# which costs more than the products of small experts gain; large bundles gain, the whole-layer prefill banks' too.


class Hooks:
    """What the decode loop (edge0/decode) calls on a store's runtime at each point of a generation; each a no-op here,
    as for a model run without a store's runtime. A scheduled pipeline overrides what it needs (pipeline/prefetch_runtime.py).

    A generation: begin, prefill (sync after each chunk, end_prefill), then per step: flush, the step evaluated,
    settle, sync, next_step (or step_built where steps overlap), and finish (recover if it raised). A batch also
    moves its rows' routing history: snapshot, join, keep_rows."""

    trace = None  # the timeline recorder of the run (sched.trace.NULL when off), set by whoever builds it
    generation = 0  # bumped by begin(): a step generator of an older generation must not touch the runtime

    @property
    def overlaps_steps(self) -> bool:
        """Decode may build step n+1's graph while step n evaluates (decode/step.py): nothing syncs with the host."""
        return True

    def overlaps_batch(self, rows: int) -> bool:
        """Whether a batch of `rows` sequences decodes as one does (overlaps_steps; decode/batch.py)."""
        return self.overlaps_steps

    def begin(self) -> int:
        """Start a generation; returns its number."""
        self.generation += 1
        return self.generation

    def recover(self) -> None:
        """Back to a state a generation can start from, whatever the last one left (idempotent)."""

    def finish(self) -> None:
        """A generation ended: nothing of it left in flight."""

    def sync(self) -> None:
        """Every graph built so far is evaluated (after a prefill chunk or a step)."""

    def end_prefill(self) -> None:
        """The prompt is in the KV cache; decode steps follow."""

    def flush(self) -> None:
        """Before a step's evaluation: work that may overlap it starts (scheduled routing's last predictions)."""

    def settle(self) -> None:
        """After a step's evaluation: what flush started is done."""

    def next_step(self) -> None:
        """A step is evaluated; the next one begins."""

    def step_built(self) -> None:
        """Overlapped decode: a step's graph is built (and queued), the one before it may still be evaluating."""
        self.next_step()

    def snapshot(self, ahead: int = 0) -> dict:
        """The routing state of a batch's rows; none here."""
        return {}

    def keep_rows(self, rows: list[int]) -> None:
        """A batch keeps only these rows."""

    def join(self, histories: list) -> None:
        """A batch's rows are these (snapshot, rows) parts, in order."""


@dataclass
class Runtime(Hooks):
    """What the executors of one loaded store share."""

    executor: str  # "exact" | "staged" | "hot" | "resident"
    fence: Fence
    executors: dict  # layer -> executor callable (x, inds) -> (T, K, D)
    banks: list = field(default_factory=list)  # persistent slot banks (staged: 1 per layer; hot: 1 shared)
    held: dict = field(default_factory=dict)  # staged: layer -> the bank holding every expert of a held layer
    stats: SlotStats = field(default_factory=SlotStats)
    prefill: WholeLayer | None = None

    @property
    def resident_expert_bytes(self) -> int:
        """Expert bytes held in banks now (decode banks are allocated at their first use), prefill banks included."""
        held = sum(b.nbytes for b in [*self.banks, *self.held.values()] if b.allocated)
        if self.prefill is not None:
            held += sum(b.nbytes for b in self.prefill.banks if b.allocated)
        return held

    @property
    def overlaps_steps(self) -> bool:
        """No layer's executor syncs with the host inside a step (every expert resident)."""
        return self.executor == "resident"

    def begin(self) -> int:
        """Start a generation (before prefill): nothing of an earlier generation is carried but fully written
        slots. Returns the generation's number."""
        self.recover()
        return super().begin()

    def recover(self) -> None:
        """Bring the runtime back to a state a generation can start from, whatever the last one left: no read
        in flight, no pending prefill bank, every slot writable. Called after a generation raised
        (decode/loop.py does it) and by begin(); idempotent; a read's error is not raised again here.
        Slots a failed read was filling were emptied where it failed (SlotCache.forget)."""
        self.reset_pipeline()
        mx.synchronize()  # a graph the failed step async_eval'd may still be reading the banks
        if self.prefill is not None:
            self.prefill.abandon()
        self.fence.sync()  # every graph built before now is evaluated or abandoned: its slots may be written

    def sync(self) -> None:
        self.fence.sync()

    def reset_pipeline(self) -> None:
        """Drop the scheduled pipeline's state (none for native executors)."""

    def end_prefill(self) -> None:
        if self.prefill is not None:
            self.prefill.release()

    def link(self, blocks: dict) -> None:
        """The model's MoE blocks, for a scheduled pipeline to route (none here)."""

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()


def build_runtime(reader, executor: str, compute_dtype: mx.Dtype | None, *, memory_budget_gib: float | None = None,
                  slots: int | None = None, held: tuple = ()) -> Runtime:
    """Executors for every MoE layer of the store behind `reader`.

    staged: one bank of `slots` (default 2K) per layer; hot: one LRU bank shared by all layers, as large
    as the budget allows. Whole-layer prefill (staged, hot) is used when two layers of experts fit the budget.
    held (staged): layers that hold every expert, loaded now (ResidentExperts), the other layers' banks sharing
    what `slots` per layer would take (streamed_slots).
    """
    if executor not in EXECUTORS:
        raise SettingError(f"{{io.executor}} {executor}: choose {', '.join(EXECUTORS)}")
    m = reader.manifest
    fence = Fence()
    budget = None if memory_budget_gib is None else int(memory_budget_gib * 2**30)
    if budget is not None and budget < 0:
        raise SettingError(f"{{io.memory_budget_gib}} {memory_budget_gib}: must not be negative")
    if executor == "auto":
        executor = auto_executor(m, compute_dtype, budget)
    layers = [e.layer for e in m.layers]
    exact = {layer: ExactExperts(reader, layer, compute_dtype) for layer in layers}
    rt = Runtime(executor, fence, {})
    if executor == "exact":
        rt.executors = exact
        return rt
    if executor == "resident":
        packable = packed_copies_fit(m, compute_dtype, budget)
        for layer in layers:
            bank, rt.executors[layer] = _resident(reader, layer, fence, compute_dtype, exact[layer].quant, packable)
            rt.banks.append(bank)
        return rt

    rt = _staged(rt, reader, exact, budget, slots, memory_budget_gib, held) if executor == "staged" else \
        _hot(rt, reader, exact, budget)
    if rt.prefill is not None:
        rt.prefill.decode_banks = rt.banks
    return rt


def _resident(reader, layer: int, fence: Fence, compute_dtype, quant, packable: bool) -> tuple[Bank, ResidentExperts]:
    """Every expert of `layer` read into a bank of E slots, never written again, and its executor."""
    m = reader.manifest
    bank = Bank(m.pieces, m.num_experts, fence, compute_dtype)
    reader.read_layer_into(layer, [bank.write_buffers(e) for e in range(m.num_experts)])
    bank.commit(range(m.num_experts))
    return bank, ResidentExperts(bank.arrays, quant, packable=packable)


def auto_executor(m, compute_dtype, budget: int | None) -> str:
    """resident when every expert fits: inside --memory-budget when one is given, else in half the memory
    this process can have now (no host sync inside a step, no copy per token: the fastest path for a model
    that fits in RAM); else staged, the path for a model larger than memory."""
    return "resident" if _experts_fit(m, compute_dtype, budget, copies=1) else "staged"


def packed_copies_fit(m, compute_dtype, budget: int | None) -> bool:
    """Whether resident experts may also keep the kernel's packed copy (as many bytes again, ResidentExperts.pack):
    where twice their bytes fit as auto_executor asks them to fit once, so the copies never push a model that fits
    out of its budget."""
    return _experts_fit(m, compute_dtype, budget, copies=2)


def _experts_fit(m, compute_dtype, budget: int | None, *, copies: int) -> bool:
    """Whether `copies` of every expert fit inside --memory-budget, else in half the memory this process can have."""
    need = Bank.slot_bytes(m.pieces, compute_dtype) * m.num_experts * len(m.layers)
    return copies * need <= (budget if budget is not None else available_memory() // 2)


def available_memory() -> int:
    """Bytes this process can still take: the kernel's MemAvailable, or less under its memory cgroup's limit."""
    room = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
    except OSError:
        pass
    if room is None:
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    capped = memory_room()  # a cgroup's limit (v1 or v2), page cache counted
    return max(room if capped is None else min(room, capped), 0)


def streamed_slots(slots: int, layers: int, held: int, experts: int) -> int:
    """Slots per bank of the streamed layers when `held` of `layers` hold all their `experts` within the memory of
    `slots` per layer (0 when every layer is held)."""
    return 0 if held >= layers else min(experts, (slots * layers - experts * held) // (layers - held))


def batch_rows(size: int, *, slots: int, experts: int, top_k: int) -> int:
    """The rows a batch over streamed banks of `slots` runs at once: the most, up to `size`, whose expected union of
    routed experts (rows routing independently: E (1 - (1 - K/E)^B)) fits the bank. Beyond it every step reads the
    union's overflow again (a bank that cannot hold a step's experts reads them the exact way), so the batch moves
    more bytes per token than its rows one after another."""
    rows = 1
    while rows < size and experts * (1 - (1 - top_k / experts) ** (rows + 1)) <= slots:
        rows += 1
    return rows


def _staged(rt: Runtime, reader, exact: dict, budget: int | None, slots: int | None, budget_gib,
            held: tuple = ()) -> Runtime:
    """One bank of `slots` (default 2K) per layer, or every expert for the held layers and what is left shared by
    the others; whole-layer prefill when two layers fit what is left."""
    m, fence, cdtype = reader.manifest, rt.fence, _dtype(exact)
    layers = list(exact)
    per_slot = Bank.slot_bytes(m.pieces, cdtype)  # memory per resident bundle
    s = slots or 2 * m.top_k
    if s < m.top_k:
        raise SettingError(f"{{io.slots}} {s}: a staged bank needs at least K = {m.top_k} slots")
    need = s * per_slot * len(layers)
    if budget is not None and need > budget:
        raise SettingError(f"{{io.memory_budget_gib}} {budget_gib} GiB: staged banks need {need / 2**30:.3f} GiB "
                           f"({s} slots x {len(layers)} layers); raise it, or use {{io.executor}} hot")
    if budget is None or 2 * m.num_experts * per_slot <= budget - need:
        rt.prefill = WholeLayer(reader, fence, cdtype)
    left = (available_memory() // 2 if budget is None else
            budget - (2 * m.num_experts * per_slot if rt.prefill is not None else 0)) - need
    quant = next(iter(exact.values())).quant if exact else None
    packable = quant is not None and quant.bits == 4 and need <= left  # packed copies fit
    pack = quant.group_size if packable and m.bundle_bytes > PACK_BANK_BYTES else None  # and pay, refilled
    if (rt.prefill is not None and pack is not None and cdtype == mx.float32  # (the kernel's products' activations)
            and need + 2 * m.num_experts * per_slot <= left):
        rt.prefill.pack_group_size = pack  # the prompt's two layers' packed copies fit too
    held = [layer for layer in layers if layer in held]
    if rt.prefill is not None and held:  # a prompt reads the streamed layers alone
        rt.prefill.only([layer for layer in layers if layer not in held])
    per_bank = streamed_slots(s, len(layers), len(held), m.num_experts)
    if len(held) * m.num_experts > s * len(layers) or (per_bank < m.top_k and len(held) < len(layers)):
        raise Edge0Error(f"layers {held} cannot hold every expert within {s} slots a layer")
    for layer in layers:
        if layer in held:  # every expert, loaded now: no read and no host sync at decode
            rt.held[layer], rt.executors[layer] = _resident(reader, layer, fence, cdtype, exact[layer].quant,
                                                            packable)
            continue
        bank = Bank(m.pieces, per_bank, fence, cdtype, pack_group_size=pack)
        rt.banks.append(bank)
        cache = SlotCache(bank, rt.stats, m.num_experts)
        rt.executors[layer] = SlottedExperts(reader, layer, cache, fence, exact[layer], rt.prefill, shared=False)
    return rt


def _hot(rt: Runtime, reader, exact: dict, budget: int | None) -> Runtime:
    """One bank shared by every layer, as large as the budget allows after the prefill banks."""
    m, fence, cdtype = reader.manifest, rt.fence, _dtype(exact)
    layers = list(exact)
    per_slot = Bank.slot_bytes(m.pieces, cdtype)
    prefill_bytes = 2 * m.num_experts * per_slot
    room = int(DEFAULT_HOT_GIB * 2**30) if budget is None else budget
    if prefill_bytes <= room // 2:  # prefill banks take at most half of the budget from the LRU
        rt.prefill = WholeLayer(reader, fence, cdtype)
        room -= prefill_bytes
    capacity = min(room // per_slot, m.num_experts * len(layers))
    if capacity < 1:
        rt.executors = {layer: _Streaming(exact[layer], rt.prefill, layer) for layer in layers}
        return rt
    bank = Bank(m.pieces, capacity, fence, cdtype)
    rt.banks.append(bank)
    cache = SlotCache(bank, rt.stats, m.num_experts * (max(layers) + 1), decay=DECAY ** (1 / len(layers)),
                      window=shared_window(len(layers)))  # lfu decays per token, keeps the other layers' last sets
    for layer in layers:
        rt.executors[layer] = SlottedExperts(reader, layer, cache, fence, exact[layer], rt.prefill, shared=True)
    return rt


def _dtype(exact: dict):
    return next(iter(exact.values())).dtype  # the compute dtype every executor of the runtime shares


class _Streaming:
    """No room for any resident bundle: every step streams through exact (prefill through whole-layer if it fits)."""

    def __init__(self, exact: ExactExperts, prefill: WholeLayer | None, layer: int):
        self.exact, self.prefill, self.layer = exact, prefill, layer

    def __call__(self, x, inds):
        if self.prefill is not None and self.prefill.wants(inds):
            return self.prefill(self.layer, x, inds)
        return self.exact(x, inds)
