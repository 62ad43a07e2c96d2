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

from mpmd.stages import batch as batches
from mpmd.stages import gather, names, partials
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
    # Equal graphdefs (a model's repeated blocks) on equal inputs cost the same: priced once.
    return fn_costs([stage_fn(l) for l in layers], sample_input, same=[nnx.graphdef(l) for l in layers]), "flops"


def fn_costs(fns, sample_input, side=None, same=None) -> list[float]:
    """Forward FLOPs (plus output bytes / 4) of each StageFn in turn, fed by the previous one;
    `side`: per stage, {batch key: spec} of its side inputs (None: none). `same`: per stage,
    a hashable equal for stages that compute the same function of their parameters and input
    (nnx graphdefs): one whose key, parameter and input specs were priced already is not
    lowered again."""
    x = jax.tree.map(spec, sample_input)
    costs, priced = [], {}
    for k, fn in enumerate(fns):
        p = tuple(jax.tree.map(spec, fn.param_leaves))
        s = (side[k] if side else None) or {}
        apply = lambda p, x, s, fn=fn: fn.apply(p, x, **s)
        key = _priced_key(same[k], p, x, s) if same is not None else None
        if key is not None and key in priced:
            cost, x = priced[key]
        else:
            cost, x = _cost(jax.jit(apply).lower(p, x, s)), jax.eval_shape(apply, p, x, s)
            if key is not None:
                priced[key] = cost, x
        costs.append(cost)
    return costs


def _priced_key(same, p, x, s):
    """fn_costs' key of a stage (None: unhashable, never shared): what it computes and the
    specs it computes it on."""
    key = (same, p, *((tuple(leaves), tree) for leaves, tree in (jax.tree.flatten(x), jax.tree.flatten(s))))
    try:
        hash(key)
    except TypeError:
        return None
    return key


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


def _stage_shapes(pipe: Pipeline, micro_input_spec, micro_target_spec, feeds=None):
    """(k, fn, StageShapes, first, last, loss, the leaves of its batch: input, side inputs and
    output, the model's for the last stage) of every stage, for one microbatch of these
    shapes; `feeds`: a batch dict's BatchPlan (mpmd/stages/batch.py), else the shorthand's."""
    feeds = feeds or batches.plan(
        pipe, {batches.INPUTS: micro_input_spec, batches.TARGETS: micro_target_spec}, pair=True
    )
    acts = pipe.activation_specs(feeds.inputs, feeds.side)
    loss_spec = jax.eval_shape(feeds.loss_fn, acts[-1], feeds.targets)
    loss_spec = loss_spec[0] if feeds.weighted else loss_spec
    S = pipe.num_stages
    for k, fn in enumerate(pipe.fns):
        last = k == S - 1
        params = tuple(jax.tree.map(spec, fn.param_leaves))
        aux = stage_programs.adds_losses(fn, params, acts[k], feeds.side[k])
        shapes = stage_programs.StageShapes(
            params,
            acts[k],
            loss_spec if last else acts[k + 1],
            feeds.targets if last else None,
            feeds.side[k],
            weighted=last and feeds.weighted,
            aux=aux,
            state=tuple(map(spec, fn.state.leaves)) if fn.state is not None else None,
        )
        yield k, fn, shapes, k == 0, last, feeds.loss_fn, jax.tree.leaves((acts[k], feeds.side[k] or {}, acts[k + 1]))


def measure(pipe: Pipeline, micro_input_spec, micro_target_spec, flops_only: bool = False) -> list[dict]:
    """Per stage {"F", "B", "W", "BW"}: the cost of its programs for one microbatch of these
    shapes (pytrees of jax.ShapeDtypeStruct). The first stage's B is 0: its input is data."""
    out = []
    for k, fn, shapes, first, last, loss, _ in _stage_shapes(pipe, micro_input_spec, micro_target_spec):
        built = {}  # the four programs priced, each exported once
        for split, kinds in ((True, ("fwd", "bwd_in", "bwd_w_first")), (False, ("bwd_first",))):
            built.update(
                stage_programs.build(
                    k,
                    fn,
                    shapes,
                    first=first,
                    last=last,
                    loss_fn=loss,
                    num_microbatches=1,
                    split_backward=split,
                    kinds=frozenset(kinds),
                )
            )
        cost = lambda kind: program_cost(built[names.program(kind, k)], flops_only)
        out.append(
            {
                "F": cost("fwd"),
                "B": 0.0 if first else cost("bwd_in"),
                "W": cost("bwd_w_first"),
                FULL_BACKWARD: cost("bwd_first"),
            }
        )
    return out


def _nbytes(specs) -> int:
    return int(sum(np.prod(l.shape, dtype=np.int64) * np.dtype(l.dtype).itemsize for l in jax.tree.leaves(specs)))


def memory(
    pipe: Pipeline,
    optimizer,
    micro_input_spec,
    micro_target_spec,
    feeds=None,
    layout=None,
    placement=None,
    split_backward: bool = True,
) -> list[dict]:
    """Per stage, bytes: {"params", "grads" (the accumulated gradient, like params),
    "optimizer" (optax state), "residuals" (saved by one microbatch's forward for its backward:
    the vjp residuals minus the stage's own parameters), "kept" (what one microbatch's B
    keeps for its W when the backward is split), "gathered" (its weights gathered over fsdp
    for the step, mesh.fsdp_gather per_step)}. Traced only: nothing is allocated.

    Figures are over one copy of the data-parallel replicas, as parameters are counted once
    however they are sharded. With `layout` (mpmd.lowering.core.Layout, stage k on slice
    `placement[k]`), what fsdp holds whole per device is counted fsdp times: the gathered
    weights (fsdp x the leaves on fsdp), and the gradients a stage accumulates unreduced until
    reduce{k} (mpmd/stages/partials.py: a leaf on fsdp is whole on each device until then).
    "kept" is 0 unless `split_backward` (a schedule whose W tasks run apart from B), which
    traces each stage's backward besides its forward."""
    out = []
    for k, fn, shapes, first, last, loss, batch in _stage_shapes(pipe, micro_input_spec, micro_target_spec, feeds):
        residuals, kept = stage_programs.saved_specs(
            fn, shapes, first=first, last=last, loss_fn=loss, split_backward=split_backward
        )
        opt = jax.eval_shape(optimizer.init, jax.tree.unflatten(fn.param_tree, list(shapes.params)))
        grads, gathered = _nbytes(shapes.params), 0
        if layout is not None:
            mesh, lays = layout.meshes[placement[k]], layout.params[k]
            on_fsdp = _nbytes([p for p, lay in zip(shapes.params, lays) if gather.sharded(lay)]) if mesh.fsdp > 1 else 0
            if partials.problem(mesh, batch, fn.state is not None, shapes.aux) is None:
                grads += on_fsdp * (mesh.fsdp - 1)
            if layout.fsdp_gather == gather.PER_STEP:
                gathered = on_fsdp * mesh.fsdp
        out.append(
            {
                "params": _nbytes(shapes.params),
                "grads": grads,
                "optimizer": _nbytes(opt),
                "residuals": _nbytes(residuals),
                "kept": _nbytes(kept),
                "gathered": gathered,
            }
        )
    return out


def slice_memory(schedule, per_stage: list[dict]) -> list[dict]:
    """Per slice of `schedule`, bytes: its stages' params, grads and optimizer state, and
    "activations": the most residual bytes (and, split backward, bytes B keeps for W) it holds
    at once (mpmd.schedules.simulate.peak_saved_bytes), "gathered": what the stages' weights
    gathered once a step add to that peak (held from a stage's first F to its last backward
    task), "total" their sum. Not counted: activations and cotangents in transit, XLA's
    temporaries."""
    residuals, kept = [m["residuals"] for m in per_stage], [m["kept"] for m in per_stage]
    saved = peak_saved_bytes(schedule, residuals, kept)
    with_gathered = peak_saved_bytes(schedule, residuals, kept, [m.get("gathered", 0) for m in per_stage])
    out = []
    for r in range(len(schedule.slices)):
        mine = schedule.stages_on(r)
        entry = {key: sum(per_stage[k][key] for k in mine) for key in ("params", "grads", "optimizer")}
        entry["activations"] = int(saved[r])
        entry["gathered"] = int(with_gathered[r]) - int(saved[r])
        entry["total"] = sum(entry.values())
        out.append(entry)
    return out
