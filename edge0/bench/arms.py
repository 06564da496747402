"""`edge0 bench`'s arms: their names, and the `edge0 run` flags each name stands for."""

from __future__ import annotations

from ..errors import Edge0Error

ARMS = ("mlx-lm", "mlx-lm:f32", "exact", "staged", "staged:lru", "hot", "hot:lru", "resident", "native",
        "prefetch:repeat", "prefetch:next-router", "prefetch:heads", "prefetch:affinity", "predicted", "predicted:even", "predicted:no-lora",
        "predicted:resident", "predicted:resident:no-lora", "llama.cpp", "llama.cpp:no-mmap")


def split_arm(arm: str) -> tuple[str, str, str]:
    """`BASE[+MODE][@KERNEL]`: (base, its --read-ahead mode or "", its --kernel or "")."""
    arm, _, kernel = arm.partition("@")
    base, _, ahead = arm.partition("+")
    return base, ahead, kernel


def arm_flags(arm: str) -> list[str]:
    """`ARM+MODE` runs ARM with --read-ahead MODE, `ARM@KERNEL` with --kernel KERNEL (mlx or edge0)."""
    arm, ahead, kernel = split_arm(arm)
    return _arm_flags(arm) + (["--read-ahead", ahead] if ahead else []) + (["--kernel", kernel] if kernel else [])


def _arm_flags(arm: str) -> list[str]:
    if arm == "native":
        return ["--routing", "native", "--executor", "staged"]
    if arm == "predicted":  # streamed, as native: the heads next to the store, for its K (and its adapter, if any)
        return ["--routing", "predicted", "--executor", "staged"]
    if arm == "predicted:even":  # every layer the same slots: the layers no head routes stream too (--placement)
        return ["--routing", "predicted", "--executor", "staged", "--placement", "even"]
    if arm == "predicted:no-lora":
        return ["--routing", "predicted", "--executor", "staged", "--lora", "none"]  # without the recovery adapter
    if arm == "predicted:resident":  # every expert in memory, the heads route inside the graph
        return ["--routing", "predicted", "--executor", "resident"]
    if arm == "predicted:resident:no-lora":  # the same without the adapter: what the adapter costs a step
        return ["--routing", "predicted", "--executor", "resident", "--lora", "none"]
    if arm.startswith("prefetch:"):  # prefetch:PREDICTOR[/N]: N guesses read ahead per predicted set
        predictor, _, guesses = arm.split(":", 1)[1].partition("/")
        return ["--routing", "prefetch", "--predictor", predictor] + (["--guesses", guesses] if guesses else [])
    if arm.endswith(":lru"):  # the banks replace the least recently used (--evict lru), not lfu
        return ["--routing", "native", "--executor", arm.split(":")[0], "--evict", "lru"]
    return ["--routing", "native", "--executor", arm]


def streams_staged(arm: str) -> bool:
    """The arms whose experts stream through staged banks: the ones --slots sizes."""
    base = split_arm(arm)[0]
    return (base in ("native", "staged", "staged:lru", "predicted", "predicted:even", "predicted:no-lora")
            or base.startswith("prefetch:"))


def check_slots(slots: int, arms: list[str], m) -> None:
    """--slots S: between the store's K and its experts, and some arm streams through staged banks."""
    if not any(map(streams_staged, arms)):
        raise Edge0Error(f"--slots {slots}: no arm streams through staged banks (native, staged, predicted, "
                         "prefetch:*)")
    if not m.top_k <= slots <= m.num_experts:
        raise Edge0Error(f"--slots {slots}: a staged bank holds between K = {m.top_k} and the model's "
                         f"{m.num_experts} experts")
