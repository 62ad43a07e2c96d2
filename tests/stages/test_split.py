"""Automatic stage boundaries: the slowest stage is as cheap as any contiguous split allows."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mpmd import models
import mpmd
from mpmd.stages.pipeline import keywords_of
from mpmd.stages.split import Layers, balanced_boundaries


def brute_force_best(costs, num_stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize(
    "costs,num_stages",
    [([1, 1, 1, 1], 2), ([5, 1, 1, 1, 1, 1], 3), ([0.1, 4, 4, 4, 4, 0.5], 4), ([3, 1, 4, 1, 5, 9, 2, 6], 3)],
)
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


class Shift(nnx.Module):
    """x + scale * a (a defaults to none)."""

    def __init__(self, seed: int):
        self.scale = nnx.Param(jnp.full((), 1.0 + seed))

    def __call__(self, x, *, a=None):
        return x + self.scale[...] * (0.0 if a is None else a)


class NeedsB(Shift):
    def __call__(self, x, *, b, a=None):
        return super().__call__(x, a=a) * b


def test_split_layers_hand_each_layer_its_own_side_inputs():
    """A stage of layers takes the union of its layers' keyword-only parameters (required if
    any layer requires it) and gives each layer only those it declares; its parameters sit
    where an nnx.Sequential of the same layers has them."""
    layers = [Shift(0), NeedsB(1), models.Hidden(1, 1, rngs=nnx.Rngs(0))]
    stage = Layers(*layers)
    assert keywords_of(stage) == (("a", False), ("b", True))
    assert mpmd.Pipeline([stage], lambda y, t: jnp.mean(y)).fns[0].keywords == (("a", False), ("b", True))
    x, a, b = jnp.ones((2, 1)), jnp.full((2, 1), 2.0), jnp.full((2, 1), 3.0)
    np.testing.assert_array_equal(stage(x, a=a, b=b), layers[2]((x + a + 2.0 * a) * b))
    with pytest.raises(TypeError, match=r"\['c'\]"):
        stage(x, a=a, b=b, c=b)
    paths = lambda s: [kp for kp, _ in jax.tree_util.tree_flatten_with_path(nnx.state(s, nnx.Param))[0]]
    assert paths(stage) == paths(nnx.Sequential(*layers))
