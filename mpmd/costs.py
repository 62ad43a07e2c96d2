"""Per-task costs of a pipeline's own programs, measured with XLA's cost analysis.

    costs = mpmd.costs.measure(pipe, micro_input_spec, micro_target_spec)
    simulate(schedules.make("zb-h1", 4, 8), costs)     # priced by what the programs do

Each stage's forward (F), input gradient (B), weight gradient (W) and full backward (BW)
program is exported exactly as the Trainer ships it and priced in flops (plus bytes
accessed / 4, so a gather-only stage such as an embedding is not free; the same unit as
mpmd.split's cost balancing). Simulating with these instead of the F = B = W rule of thumb
shows what a zero-bubble schedule really costs: until W stops recomputing the forward vjp,
B + W exceeds BW, and ZB-H1 does more backward work than 1F1B (see mpmd/simulate.py).
"""
from __future__ import annotations

import jax

from mpmd import names, stage_programs
from mpmd.pipeline import Pipeline
from mpmd.simulate import FULL_BACKWARD
from runtime.programs import ProgramSpec


def program_cost(spec: ProgramSpec) -> float:
    """flops + bytes accessed / 4 of an exported program, from XLA's cost analysis."""
    exported = jax.export.deserialize(bytearray(spec.data))
    args = jax.tree.unflatten(exported.in_tree, exported.in_avals)[0]   # (args, kwargs)
    analysis = jax.jit(exported.call).lower(*args).cost_analysis() or {}
    return float(analysis.get("flops", 0.0)) + float(analysis.get("bytes accessed", 0.0)) / 4


def measure(pipe: Pipeline, micro_input_spec, micro_target_spec) -> list[dict]:
    """Per stage {"F", "B", "W", "BW"}: the cost of its programs for one microbatch of these
    shapes (pytrees of jax.ShapeDtypeStruct). The first stage's B is 0: its input is data."""
    acts = pipe.activation_specs(micro_input_spec)
    loss_spec = jax.eval_shape(pipe.loss_fn, acts[-1], micro_target_spec)
    S = pipe.num_stages
    out = []
    for k, fn in enumerate(pipe.fns):
        first, last = k == 0, k == S - 1
        params = tuple(jax.ShapeDtypeStruct(l.shape, l.dtype) for l in fn.param_leaves)
        shapes = stage_programs.StageShapes(params, acts[k], loss_spec if last else acts[k + 1],
                                            micro_target_spec if last else None)
        built = {}
        for split in (True, False):
            built.update(stage_programs.build(k, fn, shapes, first=first, last=last, loss_fn=pipe.loss_fn,
                                              num_microbatches=1, split_backward=split))
        cost = lambda kind: program_cost(built[names.program(kind, k)])
        out.append({"F": cost("fwd"), "B": 0.0 if first else cost("bwd_in"), "W": cost("bwd_w_first"),
                    FULL_BACKWARD: cost("bwd_first")})
    return out
