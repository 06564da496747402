"""`edge0 train affinity`: the co-activation table of the affinity predictor (pipeline/affinity.py), learned from
recorded routing traces in any layout io/routetrace.py reads, and its recall on a held-out trace.

    summary = train_affinity(["seed1.json", "seed3.json"], "olmoe.affinity.npz", heldout="seed2.json")
"""

from __future__ import annotations

from pathlib import Path

from ..errors import Edge0Error
from ..io.outputs import Kind, check_file_out, refuse_inputs, starts_with
from ..io.routetrace import read_trace
from ..pipeline.affinity import learn, recall

AFFINITY_KIND = Kind("an NPZ file (an affinity table)", "zip magic", starts_with(b"PK\x03\x04"))
GUESSES = (1, 2, 3)  # the table's K, 2K and 3K likeliest experts: their recall is reported


def train_affinity(paths: list[str], out: str, *, heldout: str | None = None, force: bool = False) -> dict:
    """Learn the table of the traces at `paths` (one shape: MoE layers, K, experts), write it to `out` atomically,
    and return a summary (with `heldout`: the recall of its K, 2K and 3K likeliest, and the previous token's)."""
    inputs = {**{"--traces": p for p in paths[:1]}, **{f"--traces {p}": p for p in paths[1:]}, "--heldout": heldout}
    refuse_inputs(out, inputs, "--out", replaces=False)
    check_file_out(out, force, AFFINITY_KIND, "--out")
    traces = [read_trace(p, f"--traces {p}") for p in paths]
    held = read_trace(heldout, f"--heldout {heldout}") if heldout else None
    first = traces[0]
    for path, t in [*zip(paths, traces), *([(heldout, held)] if held else [])]:
        if t.ids.shape[0] < 2:
            raise Edge0Error(f"{path}: {t.ids.shape[0]} MoE layer; a table links each layer to the next (2 or more)")
        if (t.ids.shape[0], t.top_k) != (first.ids.shape[0], first.top_k) or None not in (
                t.num_experts, first.num_experts) and t.num_experts != first.num_experts:
            raise Edge0Error(f"{path}: {t.ids.shape[0]} MoE layers, K {t.top_k}, {t.num_experts or '?'} experts; "
                             f"{paths[0]} has {first.ids.shape[0]}, K {first.top_k}, {first.num_experts or '?'}")
    if held is not None and held.num_tokens < 2:  # the previous token's recall compares each token with the one before
        raise Edge0Error(f"--heldout {heldout}: {held.num_tokens} token; a held-out trace needs 2 or more")
    table = learn(traces)
    if held is not None and int(held.ids.max()) >= table.num_experts:
        raise Edge0Error(f"--heldout {heldout}: routes expert {int(held.ids.max())}; the traces name "
                         f"{table.num_experts}")
    table.save(Path(out))
    summary = {"out": out, "layers": table.num_layers, "experts": table.num_experts, "top_k": table.top_k,
               "tokens": table.tokens}
    if held is not None:
        k = table.top_k
        summary["recall"] = {n * k: recall(table, held, n * k) for n in GUESSES if n * k < table.num_experts}
    return summary
