"""Pipeline placement: contiguous ranges by count or by cost (no ranks started)."""

import itertools
import json

import mlx.core as mx
import pytest

from edge0.dist.split import choose_split, cost_split, counted_split, even_split, layer_costs
from edge0.errors import Edge0Error


def brute_force(costs: list[int], ranks: int, reads: list[int] | None = None) -> float:
    """The least largest rank cost over every way to cut the layers into `ranks` contiguous non-empty parts; a part's
    cost its share of `costs`, or the larger of that and its share of `reads`."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), ranks - 1):
        bounds = [0, *cuts, n]
        worst = max(part_cost(costs, reads, a, b) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def part_cost(costs, reads, a: int, b: int) -> float:
    held = sum(costs[a:b]) / sum(costs)
    return held if not reads or not sum(reads) else max(held, sum(reads[a:b]) / sum(reads))


@pytest.mark.parametrize("costs, ranks", [([5, 1, 1, 1, 1, 1], 2), ([1, 2, 3, 4, 5, 6, 7], 3), ([9, 1, 9, 1], 2),
                                          ([3, 3, 3, 3, 3], 4), ([1, 1, 10, 1, 1, 1, 1, 1], 3)])
def test_cost_split_is_the_least_largest_rank(costs, ranks):
    parts = cost_split(costs, ranks)
    assert [i for r in parts for i in r] == list(range(len(costs)))  # contiguous, in order, every layer once
    assert all(len(r) >= 1 for r in parts) and len(parts) == ranks
    assert max(part_cost(costs, None, r.start, r.stop) for r in parts) == brute_force(costs, ranks)


@pytest.mark.parametrize("costs, reads, ranks, want", [
    ([1] * 6, [5, 5, 2, 1, 1, 1], 2, [range(0, 2), range(2, 6)]),  # the first layers read most: rank 0 takes fewer
    ([1] * 6, [0] * 6, 2, [range(0, 3), range(3, 6)]),  # nothing read (resident experts): by bytes held
    ([4, 1, 1, 1, 1, 4], [1, 1, 1, 1, 1, 1], 3, None),
    ([3, 1, 2, 5, 1, 1, 2], [9, 1, 1, 1, 4, 1, 1], 3, None),
])
def test_cost_split_weighs_reads(costs, reads, ranks, want):
    parts = cost_split(costs, ranks, reads)
    assert [i for r in parts for i in r] == list(range(len(costs))) and len(parts) == ranks
    assert max(part_cost(costs, reads, r.start, r.stop) for r in parts) == brute_force(costs, ranks, reads)
    assert want is None or parts == want


def test_even_and_counted():
    assert even_split(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert counted_split([1, 3], 4, 2) == [range(0, 1), range(1, 4)]
    for counts in ([2, 3], [0, 4], [1, 1, 2]):
        with pytest.raises(Edge0Error, match="must be 2 counts of at least 1 layer that add up to the model's 4"):
            counted_split(counts, 4, 2)
    with pytest.raises(Edge0Error, match="5 ranks for a model of 4 layers"):
        even_split(4, 5)


def test_layer_costs_are_the_stores_bytes(dist_store):
    """Each layer: its resident tensors' bytes (as MLX loads them) plus its experts' bytes (E bundles, which its layer
    file holds); the embedding's on layer 0 (rank 0 holds it), the final norm's and the head's on the last layer."""
    weights = mx.load(str(dist_store / "resident.safetensors"))
    manifest = json.loads((dist_store / "edge0.json").read_text())
    embed = sum(v.nbytes for k, v in weights.items() if k.startswith("model.embed_tokens."))
    last = sum(v.nbytes for k, v in weights.items() if k.startswith(("model.norm.", "lm_head.")))
    assert embed > 0 and last > 0
    for layer, cost in enumerate(layer_costs(dist_store, 4)):
        resident = sum(v.nbytes for k, v in weights.items() if f"layers.{layer}." in k)
        experts = manifest["bundle_bytes"] * manifest["num_experts"]
        ends = embed if layer == 0 else last if layer == 3 else 0
        assert (dist_store / "experts" / f"layer_{layer:03d}.safetensors").stat().st_size >= experts
        assert resident > 0 and cost == resident + experts + ends, layer
    with pytest.raises(Edge0Error, match="--split 2,x: choose even, cost or layer counts"):
        choose_split("2,x", dist_store, 4, 2)
