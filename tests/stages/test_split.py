"""Automatic stage boundaries: the slowest stage is as cheap as any contiguous split allows."""
import itertools

import pytest
from flax import nnx

from mpmd import models
import mpmd
from mpmd.stages.split import balanced_boundaries


def brute_force_best(costs, num_stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("costs,num_stages", [([1, 1, 1, 1], 2), ([5, 1, 1, 1, 1, 1], 3),
                                              ([0.1, 4, 4, 4, 4, 0.5], 4), ([3, 1, 4, 1, 5, 9, 2, 6], 3)])
def test_boundaries_minimise_the_slowest_stage(costs, num_stages):
    bounds = balanced_boundaries(costs, num_stages)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == num_stages + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:])), "every stage holds at least one layer"
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == pytest.approx(brute_force_best(costs, num_stages))


def test_gpt_split_by_flops_reports_predicted_costs():
    model = models.GPT(64, 32, 2, 6, 16, rngs=nnx.Rngs(0))
    stages = mpmd.split(model, num_stages=4)
    assert stages.cost_unit == "flops" and len(stages.costs) == 4
    # The embedding (a gather) and the head cost little next to the blocks, so they share
    # their stages with blocks rather than sitting alone: 8 layers over 4 stages.
    sizes = [len(s.layers) for s in stages]
    assert sum(sizes) == 8 and stages[0].layers[0] is model.embed and stages[-1].layers[-1] is model.head
    assert max(stages.costs) <= 1.5 * (sum(stages.costs) / 4)
