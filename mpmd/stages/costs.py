"""What each pipeline stage costs: the `Stages` record mpmd.split returns (the stages in
order plus each one's predicted cost), and the estimates behind it.

A stage's cost is its forward FLOPs from XLA's cost analysis on a sample microbatch (the
embedding's gather costs almost nothing, a block's matmuls most), falling back to its
parameter count when no sample input is known. Both mpmd/stages/split.py (balancing layers) and
mpmd/stages/marks.py (reporting the cost of a marked cut) use these.

`measure` prices a built pipeline's own programs per task kind, for mpmd.schedules.simulate:

    costs = measure(pipe, micro_input_spec, micro_target_spec)
    simulate(schedules.make("zb-h1", 4, 8), costs)     # priced by what the programs do

Each stage's forward (F), input gradient (B), weight gradient (W) and full backward (BW)
program is exported exactly as the Trainer ships it and priced in the same unit. B and W
are the two halves of one backward (mpmd/stages/backward_split.py: W reuses what B computed), so
B + W = BW up to XLA's fusion choices (GPT d_model 128, last stage of 2 with 2 blocks, 4 x 64
tokens: BW 476, B 257, W 219 MFLOP; before the split W rebuilt the vjp and cost 476). `flops_only=True` prices FLOPs alone.

`memory` gives what each stage holds, in bytes, from shapes alone (an mpmd.abstract model
is never allocated): parameters, accumulated gradients, optimizer state, the residuals its
forward saves per microbatch (what rematerialisation shrinks) and what its B keeps for its
W in a split-backward schedule. `slice_memory` adds them up per slice under a schedule, with
the schedule's peak of microbatches in flight.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from mpmd.stages import names
from mpmd.stages import programs as stage_programs
from mpmd.stages.pipeline import Pipeline, stage_fn
from mpmd.schedules.simulate import FULL_BACKWARD, peak_saved_bytes
from mpmd.stages.specs import spec
from mpmd.runtime.worker.programs import ProgramSpec


class Stages(list):
    """The stages in order (nnx.Modules, or StageFn records for a marked model); `.costs`
    holds each stage's predicted cost and `.cost_unit` says in what ("flops" or "params");
    `.param_paths` (mpmd/stages/leaf_paths.py), per stage, each parameter leaf's path in the model."""
    costs: list[float]
    cost_unit: str
    param_paths: list[tuple[str, ...]]


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
        costs.append(_cost(jax.jit(fn.apply).lower(p, x)))
        x = jax.eval_shape(fn.apply, p, x)
    return costs


def _cost(lowered, flops_only: bool = False) -> float:
    """flops + bytes accessed / 4 of a lowered computation (or flops alone), from XLA's cost
    analysis."""
    analysis = lowered.cost_analysis() or {}
    if isinstance(analysis, list):  # older jax returned one dict per computation
        analysis = analysis[0] if analysis else {}
    # A pure gather (the embedding) reports ~0 flops; count its output bytes so it is not free.
    traffic = 0.0 if flops_only else float(analysis.get("bytes accessed", 0.0)) / 4
    return float(analysis.get("flops", 0.0)) + traffic


def program_cost(program: ProgramSpec, flops_only: bool = False) -> float:
    """The cost of an exported program (a ProgramSpec as shipped to a slice)."""
    exported = jax.export.deserialize(bytearray(program.data))
    args, _ = jax.tree.unflatten(exported.in_tree, exported.in_avals)
    return _cost(jax.jit(exported.call).lower(*args), flops_only)


def _stage_shapes(pipe: Pipeline, micro_input_spec, micro_target_spec):
    """(k, fn, StageShapes, first, last) of every stage, for one microbatch of these shapes."""
    acts = pipe.activation_specs(micro_input_spec)
    loss_spec = jax.eval_shape(pipe.loss_fn, acts[-1], micro_target_spec)
    S = pipe.num_stages
    for k, fn in enumerate(pipe.fns):
        last = k == S - 1
        shapes = stage_programs.StageShapes(tuple(jax.tree.map(spec, fn.param_leaves)), acts[k],
                                            loss_spec if last else acts[k + 1], micro_target_spec if last else None)
        yield k, fn, shapes, k == 0, last


def measure(pipe: Pipeline, micro_input_spec, micro_target_spec, flops_only: bool = False) -> list[dict]:
    """Per stage {"F", "B", "W", "BW"}: the cost of its programs for one microbatch of these
    shapes (pytrees of jax.ShapeDtypeStruct). The first stage's B is 0: its input is data."""
    out = []
    for k, fn, shapes, first, last in _stage_shapes(pipe, micro_input_spec, micro_target_spec):
        built = {}
        for split in (True, False):
            built.update(stage_programs.build(k, fn, shapes, first=first, last=last, loss_fn=pipe.loss_fn,
                                              num_microbatches=1, split_backward=split))
        cost = lambda kind: program_cost(built[names.program(kind, k)], flops_only)
        out.append({"F": cost("fwd"), "B": 0.0 if first else cost("bwd_in"), "W": cost("bwd_w_first"),
                    FULL_BACKWARD: cost("bwd_first")})
    return out


def _nbytes(specs) -> int:
    return int(sum(np.prod(l.shape, dtype=np.int64) * np.dtype(l.dtype).itemsize for l in jax.tree.leaves(specs)))


def memory(pipe: Pipeline, optimizer, micro_input_spec, micro_target_spec) -> list[dict]:
    """Per stage, bytes: {"params", "grads" (the accumulated gradient, like params),
    "optimizer" (optax state), "residuals" (saved by one microbatch's forward for its backward:
    the vjp residuals minus the stage's own parameters), "kept" (what one microbatch's B
    keeps for its W when the backward is split)}. Traced only: nothing is allocated."""
    out = []
    for k, fn, shapes, first, last in _stage_shapes(pipe, micro_input_spec, micro_target_spec):
        stage = dict(fn=fn, shapes=shapes, first=first, last=last, loss_fn=pipe.loss_fn)
        opt = jax.eval_shape(optimizer.init, jax.tree.unflatten(fn.param_tree, list(shapes.params)))
        out.append({"params": _nbytes(shapes.params), "grads": _nbytes(shapes.params), "optimizer": _nbytes(opt),
                    "residuals": _nbytes(stage_programs.residual_specs(**stage)),
                    "kept": _nbytes(stage_programs.kept_specs(**stage))})
    return out


def slice_memory(schedule, per_stage: list[dict]) -> list[dict]:
    """Per slice of `schedule`, bytes: its stages' params, grads and optimizer state, and
    "activations": the most residual bytes (and, split backward, bytes B keeps for W) it holds
    at once (mpmd.schedules.simulate.peak_saved_bytes), "total" their sum. Not counted: activations and
    cotangents in transit, XLA's temporaries."""
    saved = peak_saved_bytes(schedule, [m["residuals"] for m in per_stage], [m["kept"] for m in per_stage])
    out = []
    for r in range(len(schedule.slices)):
        mine = schedule.stages_on(r)
        entry = {key: sum(per_stage[k][key] for k in mine) for key in ("params", "grads", "optimizer")}
        entry["activations"] = int(saved[r])
        entry["total"] = sum(entry.values())
        out.append(entry)
    return out
