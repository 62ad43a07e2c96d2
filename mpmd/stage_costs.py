"""What each pipeline stage costs: the `Stages` record mpmd.split returns (the stages in
order plus each one's predicted cost), and the estimates behind it.

A stage's cost is its forward FLOPs from XLA's cost analysis on a sample microbatch (the
embedding's gather costs almost nothing, a block's matmuls most), falling back to its
parameter count when no sample input is known. Both mpmd/split.py (balancing layers) and
mpmd/marks.py (reporting the cost of a marked cut) use these.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from mpmd.pipeline import stage_fn
from mpmd.specs import spec


class Stages(list):
    """The stages in order (nnx.Modules, or StageFn records for a marked model); `.costs`
    holds each stage's predicted cost and `.cost_unit` says in what ("flops" or "params")."""
    costs: list[float]
    cost_unit: str


def layer_costs(layers, sample_input) -> tuple[list[float], str]:
    if sample_input is None:
        return [float(sum(np.size(p) for p in jax.tree.leaves(nnx.state(l, nnx.Param)))) for l in layers], "params"
    return fn_costs([stage_fn(l) for l in layers], sample_input), "flops"


def fn_costs(fns, sample_input) -> list[float]:
    """Forward FLOPs (plus output bytes / 4) of each StageFn in turn, fed by the previous one."""
    x = jax.tree.map(spec, sample_input)
    costs = []
    for fn in fns:
        p = tuple(jax.tree.map(spec, fn.param_leaves))
        analysis = jax.jit(fn.apply).lower(p, x).cost_analysis() or {}
        if isinstance(analysis, list):  # older jax returned one dict per computation
            analysis = analysis[0] if analysis else {}
        # A pure gather (the embedding) reports ~0 flops; count its output bytes so it is not free.
        costs.append(float(analysis.get("flops", 0.0)) + float(analysis.get("bytes accessed", 0.0)) / 4)
        x = jax.eval_shape(fn.apply, p, x)
    return costs
