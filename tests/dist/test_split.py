"""Pipeline placement: contiguous ranges by count or by cost (no ranks started)."""

import itertools
import json

import mlx.core as mx
import pytest

from edge0.dist.split import choose_split, cost_split, counted_split, even_split, layer_costs
from edge0.errors import Edge0Error


def brute_force(costs: list[int], ranks: int) -> int:
    """The least largest part over every way to cut `costs` into `ranks` contiguous non-empty parts."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), ranks - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("costs, ranks", [([5, 1, 1, 1, 1, 1], 2), ([1, 2, 3, 4, 5, 6, 7], 3), ([9, 1, 9, 1], 2),
                                          ([3, 3, 3, 3, 3], 4), ([1, 1, 10, 1, 1, 1, 1, 1], 3)])
def test_cost_split_is_the_least_largest_rank(costs, ranks):
    parts = cost_split(costs, ranks)
    assert [i for r in parts for i in r] == list(range(len(costs)))  # contiguous, in order, every layer once
    assert all(len(r) >= 1 for r in parts) and len(parts) == ranks
    assert max(sum(costs[i] for i in r) for r in parts) == brute_force(costs, ranks)


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
    file holds)."""
    weights = mx.load(str(dist_store / "resident.safetensors"))
    manifest = json.loads((dist_store / "edge0.json").read_text())
    for layer, cost in enumerate(layer_costs(dist_store, 4)):
        resident = sum(v.nbytes for k, v in weights.items() if f"layers.{layer}." in k)
        experts = manifest["bundle_bytes"] * manifest["num_experts"]
        assert (dist_store / "experts" / f"layer_{layer:03d}.safetensors").stat().st_size >= experts
        assert resident > 0 and cost == resident + experts, layer
    with pytest.raises(Edge0Error, match="EDGE0_SPLIT=2,x: choose even, cost or layer counts"):
        choose_split("2,x", dist_store, 4, 2)
