"""Which contiguous layers each pipeline rank runs: an even count, counts given, or by cost, the largest rank's cost
least. A rank's cost is the larger of its share of the bytes the model keeps in memory (its layers' resident tensors
and experts' bytes in the store; the embedding with the first layer, the final norm and head with the last) and its
share of the expert bytes a decode step reads (each layer's, measured: dist/calibrate.py).

    EDGE0_SPLIT=cost | even | 3,5  (set by `edge0 launch --split`)
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from ..errors import Edge0Error

SPLIT_ENV = "EDGE0_SPLIT"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def even_split(layers: int, ranks: int) -> list[range]:
    """Contiguous ranges of `layers` decoder layers, one per rank, sizes differing by at most one (the first ranks
    take the extra layers)."""
    return counted_split([layers // ranks + (r < layers % ranks) for r in range(ranks)], layers, ranks)


def counted_split(counts: list[int], layers: int, ranks: int, where: str = "--split") -> list[range]:
    if ranks > layers:
        raise Edge0Error(f"{ranks} ranks for a model of {layers} layers: at most one rank per layer")
    if len(counts) != ranks or any(n < 1 for n in counts) or sum(counts) != layers:
        raise Edge0Error(f"{where}: must be {ranks} counts of at least 1 layer that add up to the model's {layers}")
    out, at = [], 0
    for n in counts:
        out.append(range(at, at + n))
        at += n
    return out


def layer_costs(root: Path, layers: int) -> list[int]:
    """Per decoder layer: its bytes in resident.safetensors plus its experts' bytes in the store; the embedding's
    bytes on layer 0's (rank 0 holds it), the final norm's and output head's on the last layer's (the last rank's;
    a tied head's embedding too)."""
    from ..io.manifest import read_manifest

    costs = [0] * layers
    sizes = _tensor_sizes(root / "resident.safetensors")
    tied = not any("lm_head" in name for name in sizes)
    for name, size in sizes.items():
        m = _LAYER.search(name)
        if m is not None:
            if int(m.group(1)) < layers:
                costs[int(m.group(1))] += size
        elif "embed" in name:
            costs[0] += size
            costs[-1] += size if tied else 0
        else:
            costs[-1] += size
    manifest = read_manifest(root)
    for entry in manifest.layers:
        costs[entry.layer] += manifest.bundle_bytes * manifest.num_experts
    return costs


def cost_split(costs: list[int], ranks: int, reads: list[int] | None = None) -> list[range]:
    """Contiguous ranges whose largest cost is least (linear partition, dynamic programming). A range's cost: its
    share of all `costs`, or with `reads`, the larger of that and its share of all reads."""
    n = len(costs)
    if ranks > n:
        raise Edge0Error(f"{ranks} ranks for a model of {n} layers: at most one rank per layer")
    held, read = _prefix(costs), _prefix(reads or [0] * n)

    def cost(j: int, i: int) -> float:  # layers j..i-1
        share = (held[i] - held[j]) / (held[n] or 1)
        return max(share, (read[i] - read[j]) / read[n]) if read[n] else share
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(ranks + 1)]  # best[r][i]: least max cost of the first i layers on r ranks
    cut = [[0] * (n + 1) for _ in range(ranks + 1)]
    best[0][0] = 0
    for r in range(1, ranks + 1):
        for i in range(r, n + 1):
            for j in range(r - 1, i):
                v = max(best[r - 1][j], cost(j, i))
                if v < best[r][i]:
                    best[r][i], cut[r][i] = v, j
    bounds, i = [], n
    for r in range(ranks, 0, -1):
        bounds.append(range(cut[r][i], i))
        i = cut[r][i]
    return bounds[::-1]


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def choose_split(spec: str, root: Path, layers: int, ranks: int,
                 reads: list[int] | None = None) -> tuple[list[range], list[int]]:
    """(the ranges of `spec`: even, cost (by bytes held and, given, each layer's measured reads) or counts, and each
    layer's bytes held)."""
    costs = layer_costs(root, layers)
    if spec == "even":
        return even_split(layers, ranks), costs
    if spec == "cost":
        return cost_split(costs, ranks, reads), costs
    return counted_split(_counts(spec), layers, ranks, f"--split {spec}"), costs


def _counts(spec: str) -> list[int]:
    try:
        return [int(n) for n in spec.split(",")]
    except ValueError:
        raise Edge0Error(f"--split {spec}: choose even, cost or layer counts such as 3,3") from None


def check_split(spec: str, ranks: int, model: str | None) -> None:
    """`edge0 launch`'s check before any rank starts: `spec` names `ranks` ranges of the layers of the model at path
    `model` (None: the built-in one), where that store is readable here (else each rank checks it)."""
    from ..model.demo import DEMO_STORE
    from ..model.arch import read_config, text_config

    counts = None if spec in ("even", "cost") else _counts(spec)
    try:
        layers = text_config(read_config(Path(model) if model else DEMO_STORE))["num_hidden_layers"]
    except (Edge0Error, OSError, ValueError, KeyError, TypeError):
        layers = None  # the store is on the other hosts only, or not a store: the ranks say so
    if counts is not None and layers is None and (len(counts) != ranks or min(counts) < 1):
        raise Edge0Error(f"--split {spec}: must be {ranks} counts of at least 1 layer")  # the layers unknown here
    if counts is not None:
        counted_split(counts, layers if layers is not None else sum(counts), ranks, f"--split {spec}")
    elif layers is not None and ranks > layers:
        raise Edge0Error(f"{ranks} ranks for a model of {layers} layers: at most one rank per layer")


def _tensor_sizes(path: Path) -> dict[str, int]:
    """{tensor name: bytes} from a safetensors file's header (nothing else read)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise Edge0Error(f"{path}: cannot read its safetensors header ({e})") from None
