"""Split a model into pipeline stages: at its `mpmd.stage_boundary` marks (mpmd/stages/marks.py), or,
for a model that exposes its ordered layers, into balanced contiguous runs of layers.

A layer's cost comes from mpmd/stages/costs.py (forward FLOPs on a sample microbatch, else
its parameter count). Boundaries minimise the most expensive stage (the pipeline runs at
the pace of its slowest stage), by dynamic programming over contiguous layer ranges:
O(layers^2 * stages), trivial for real layer counts.

A stage cut from layers is a `Layers`: the layers applied in turn, each given the side inputs
(batch keys, mpmd/stages/batch.py) its own `__call__` declares keyword-only.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from mpmd.stages import leaf_paths
from mpmd.stages import marks
from mpmd.stages.costs import Stages, layer_costs
from mpmd.stages.pipeline import keywords_of


class Layers(nnx.Module):
    """Consecutive layers as one stage: x -> layers[-1](...layers[0](x)).

    Each layer gets the output of the one before (the first: the stage's input) as its one
    argument, a tuple too (an nnx.Sequential would unpack it into several), and of the
    stage's side inputs exactly those its `__call__` declares keyword-only (`def __call__(self,
    x, *, segment_ids=None)`). The stage takes the union of its layers' keyword-only parameters,
    one being required if any layer requires it (`side_input_keywords()`, which mpmd.Pipeline reads).
    Parameters sit at `layers.<i>.<path in layer i>`, as in an nnx.Sequential of the layers.
    """

    def __init__(self, *layers):
        self.layers = nnx.List(layers)

    def side_input_keywords(self) -> tuple:
        """(name, required) of every keyword-only parameter of any layer, in first-use order."""
        required: dict[str, bool] = {}
        for layer in self.layers:
            for name, needed in keywords_of(layer):
                required[name] = required.get(name, False) or needed
        return tuple(required.items())

    def __call__(self, x, **side):
        unknown = set(side) - {name for name, _ in self.side_input_keywords()}
        if unknown:
            raise TypeError(
                f"no layer of this stage takes the keyword argument(s) {sorted(unknown)}; "
                f"its layers take {[name for name, _ in self.side_input_keywords()]}"
            )
        for layer in self.layers:
            x = layer(x, **{name: side[name] for name, _ in keywords_of(layer) if name in side})
        return x


def split(model, num_stages: int | None = None, sample_input=None, cuts=None) -> Stages:
    """Cut `model` into pipeline stages.

    num_stages=None: at the model's `mpmd.stage_boundary` marks (len(marks) + 1 stages of
    StageFn records; shared weights live in every stage that uses them). With num_stages, a
    marked model is cut at its marks when they make exactly that many stages; an unmarked
    model has `model.layers()` split into `num_stages` contiguous stages of balanced cost (the
    first stage holds the first layer, the last stage the last).
    `sample_input` (one microbatch; defaults to `model.sample_input()` where the model has one)
    is what a marked model is traced with, and enables FLOP-based balancing of layers. For a
    marked model whose `__call__` takes keyword-only side inputs, give a sample batch dict
    (`{"inputs": x, "mask": m, ...}`): the keys it names are the side inputs the cut feeds.
    `cuts` (unmarked models): the layer indices where stages 1.. begin, instead of balancing
    (what mpmd.tune chooses from measured costs); len(cuts) == num_stages - 1.
    """
    name = type(model).__name__
    if sample_input is None and callable(getattr(model, "sample_input", None)):
        sample_input = model.sample_input()
    if num_stages is None:
        if sample_input is None:
            raise ValueError(
                f"mpmd.split({name}) without num_stages cuts the model at its mpmd.stage_boundary "
                f"marks, which needs a sample input: pass sample_input=(one microbatch) or give "
                f"the model a sample_input() method"
            )
        return marks.split_marked(model, sample_input)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    # Marks are found by tracing, which needs a concrete model and an input to trace with.
    traceable = (
        sample_input is not None
        and isinstance(model, nnx.Module)
        and callable(model)
        and not any(isinstance(l, jax.ShapeDtypeStruct) for l in jax.tree.leaves(nnx.state(model)))
    )
    num_marks = marks.count_marks(model, sample_input) if traceable else 0
    if num_marks:
        if num_marks + 1 != num_stages:
            raise ValueError(
                f"{name} has {num_marks} mpmd.stage_boundary marks, which make {num_marks + 1} "
                f"stages, but num_stages={num_stages}; pass num_stages=None (or {num_marks + 1}) "
                f"to cut at the marks, or move the marks"
            )
        return marks.split_marked(model, sample_input)
    if not callable(getattr(model, "layers", None)):
        raise ValueError(
            f"mpmd.split needs a model exposing its ordered layers as model.layers(); "
            f"{name} has none. Pass your own list of nnx.Module stages "
            f"to mpmd.Pipeline instead, or mark stage ends with mpmd.stage_boundary."
        )
    layers = list(model.layers())
    if num_stages > len(layers):
        raise ValueError(
            f"cannot split {name} into {num_stages} stages: it has only "
            f"{len(layers)} layers; allowed num_stages: 1..{len(layers)}"
        )
    if cuts is not None:
        if len(cuts) != num_stages - 1:
            raise ValueError(
                f"cuts {list(cuts)!r} make {len(cuts) + 1} stages, but num_stages={num_stages}; "
                f"give num_stages - 1 = {num_stages - 1} cut points"
            )
        stages = cut(layers, cuts)
        bounds = [0, *cuts, len(layers)]
    else:
        costs, unit = layer_costs(layers, sample_input)
        bounds = balanced_boundaries(costs, num_stages)
        stages = cut(layers, bounds[1:-1])
        stages.costs = [float(sum(costs[a:b])) for a, b in zip(bounds, bounds[1:])]
        stages.cost_unit = unit
    stages.param_paths = layer_param_paths(model, layers, bounds)
    return stages


def layer_param_paths(model, layers, bounds) -> list[tuple[str, ...]]:
    """Per stage (the Layers of layers[a:b]), each parameter leaf's path in the model:
    `blocks.3.mlp.up.kernel`, the same whichever stage holds block 3 (a layer not found as a
    module of the model is `layers.<its index in model.layers()>`)."""
    where = {
        id(node): ".".join(map(str, path))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module) and path
    }
    out = []
    for a, b in zip(bounds, bounds[1:]):
        paths = []
        for keypath, _ in jax.tree_util.tree_flatten_with_path(nnx.state(Layers(*layers[a:b]), nnx.Param))[0]:
            j = a + int(leaf_paths.path_string(keypath[1:2]))  # keypath: ("layers", j, ...)
            prefix = where.get(id(layers[j]), f"layers.{j}")
            paths.append(".".join(p for p in (prefix, leaf_paths.path_string(keypath[2:])) if p))
        out.append(tuple(paths))
    return out


def cut(units, cuts) -> Stages:
    """Consecutive runs of `units` (nnx.Modules: layers, or a user's own stages) as stages:
    stage k is units[cuts[k-1]:cuts[k]], one Layers. `.costs` counts units."""
    units = list(units)
    cuts = list(cuts)
    if (
        not all(isinstance(c, int) and not isinstance(c, bool) for c in cuts)
        or cuts != sorted(set(cuts))
        or (cuts and not 0 < cuts[0] <= cuts[-1] < len(units))
    ):
        raise ValueError(
            f"cuts must be increasing integers in 1..{len(units) - 1} (the unit where "
            f"each stage after the first begins; {len(units)} units), got {cuts!r}"
        )
    bounds = [0, *cuts, len(units)]
    stages = Stages(Layers(*units[a:b]) for a, b in zip(bounds, bounds[1:]))
    stages.costs, stages.cost_unit = [float(b - a) for a, b in zip(bounds, bounds[1:])], "units"
    return stages


def balanced_boundaries(costs, num_stages: int) -> list[int]:
    """Cut points [0, c1, ..., n] minimising the largest stage sum (ties: earlier cuts)."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    # best[s][i]: minimal max-stage cost of splitting layers[:i] into s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]
