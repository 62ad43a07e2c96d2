"""Lower pipeline + schedule into runtime programs and one instruction stream per slice.

Every buffer, transfer key and program is named through mpmd/stages/names.py; which slice holds a
stage is the schedule's `placement`. A training stream is emitted task by task
(mpmd/lowering/train_stream.py), the forward-only streams here; both are made of the rows of
mpmd/lowering/rows.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from mpmd.runtime.worker.instructions import Instruction, Recv, Run, Send, Spec
from mpmd.runtime.worker.streams import PackedStream
from mpmd.stages import batch as batches
from mpmd.stages import gather, names, partials
from mpmd.schedules import core as schedules
from mpmd.stages import constraints, sharding
from mpmd.schedules import simulate
from mpmd.stages import programs as stage_programs
from mpmd.stages.pipeline import Pipeline, shared_indices
from mpmd.stages.specs import spec
from mpmd.lowering.rows import J, K, Q, SCALAR, Rows, StageIO, Transfers, tiled, weight_total  # noqa: F401
from mpmd.lowering.train_stream import train_stream, train_streams  # noqa: F401 (re-exported)


class Layout(NamedTuple):
    """Where everything lies: each slice's mesh, each stage's parameter and optimizer-state
    layouts (mpmd/stages/sharding.py). `Layout.single(...)`: one device per slice, all replicated."""

    meshes: list  # per slice: sharding.SliceMesh
    params: list  # per stage: PartitionSpec per parameter leaf
    opt: list  # per stage: PartitionSpec per optimizer-state leaf
    rules: dict | None = None  # logical axis -> mesh axis (mpmd.constrain inside the programs)
    fsdp_gather: str = gather.PER_MICROBATCH  # where FSDP weights are gathered (mpmd/stages/gather.py)

    @staticmethod
    def single(pipe: Pipeline, optimizer, num_slices: int) -> "Layout":
        return layout(pipe, optimizer, [sharding.SliceMesh()] * num_slices, (0,) * pipe.num_stages, {})


def layout(pipe: Pipeline, optimizer, meshes, placement, rules, fsdp_gather: str = gather.PER_MICROBATCH) -> Layout:
    """The layouts of every stage's state on its slice's mesh; ValueError naming a parameter
    whose dimension a mesh axis does not divide, or an fsdp_gather that is not one of
    mpmd/stages/gather.py's modes."""
    gather.check_mode(fsdp_gather)
    params, opt = [], []
    for k, fn in enumerate(pipe.fns):
        mesh = meshes[placement[k]]
        p = sharding.stage_param_layouts(fn, mesh, rules, k)
        params.append(p)
        opt.append(sharding.optimizer_layouts(optimizer, fn, p))
    return Layout(list(meshes), params, opt, dict(rules or {}), fsdp_gather)


def check_gather(lay: Layout, placement) -> None:
    """LayoutError when fsdp_gather is per_step but no stage has anything to gather (no slice
    with fsdp > 1, or no parameter on fsdp): asked where a run starts, not of a layout a lost
    slice forces, where per_step then gathers nothing, as per_microbatch would."""
    if lay.fsdp_gather == gather.PER_STEP and (problem := gather.problem(lay.meshes, lay.params, placement)):
        raise sharding.LayoutError(problem)


def _laid_out(tree, mesh) -> tuple[Spec, ...]:
    """Specs of an activation bundle on `mesh`: each leaf split along its batch axis."""
    return tuple(
        Spec(tuple(l.shape), jax.numpy.dtype(l.dtype).name, tuple(sharding.batch_layout(l.shape, mesh)))
        for l in jax.tree.leaves(tree)
    )


def _pieces(tree, mesh) -> tuple[int, ...]:
    """Into how many batch shards `mesh` cuts each leaf of an activation bundle (a send's pieces)."""
    return tuple(sharding.batch_pieces(sharding.batch_layout(l.shape, mesh), mesh) for l in jax.tree.leaves(tree))


def _placed(tree, mesh):
    """A pytree of abstract arrays as ShapeDtypeStructs laid out (batch axis) on `mesh`."""
    return jax.tree.map(lambda l: sharding.with_layout(l, sharding.batch_layout(l.shape, mesh), mesh), tree)


def _differentiable(specs: tuple, pieces: tuple) -> tuple[tuple, tuple]:
    """The leaves of a cotangent transfer: only floating-point leaves carry one back."""
    keep = [stage_programs.differentiable(s) for s in specs]
    return (
        tuple(s for s, k in zip(specs, keep) if k),
        tuple(p for p, k in zip(pieces, keep) if k) if pieces else pieces,
    )


class Lowered(NamedTuple):
    num_slices: int
    programs: list[dict]  # per slice: name -> ProgramSpec
    # Plans, one encoded stream per slice (runtime/worker/streams.py; each reads as its instructions):
    train: list[PackedStream]  # the training step
    grads: list[PackedStream]  # forward + backward only, gradients kept
    eval: list[PackedStream]  # forward only, loss per microbatch
    predict: list[PackedStream]  # forward only, last stage's output kept
    init: list[PackedStream]  # optimizer-state creation
    fetch: dict[int, tuple[str, ...]]  # what the controller reads after a training step
    loss_fetch: dict[int, tuple[str, ...]]  # after a gradient run: the losses, auxiliary ones too
    eval_fetch: dict[int, tuple[str, ...]]  # after an evaluation run: the losses
    io: StageIO = StageIO()  # side inputs, auxiliary losses, weighted loss


def recv_windows(schedule: schedules.Schedule, recv_window: int | None = None) -> tuple[int, ...]:
    """Per slice, how many receives may be outstanding at once (mpmd.runtime.worker.streams
    with_recv_window): `recv_window` for every slice, or by default the slice's peak of live
    activations in the schedule (mpmd/schedules/simulate.py), so a slice never holds more received,
    not yet used bundles than the activations the schedule itself keeps alive there."""
    if recv_window is not None:
        return (recv_window,) * schedule.num_slices
    return tuple(max(1, n) for n in simulate.simulate(schedule).peak_live_activations)


def lower(
    pipe: Pipeline,
    schedule: schedules.Schedule,
    optimizer,
    max_grad_norm,
    micro_input_spec,
    micro_target_spec,
    layouts: Layout | None = None,
    recv_window: int | None = None,
    feeds: batches.BatchPlan | None = None,
) -> Lowered:
    """`recv_window`: receives outstanding at once per slice (see recv_windows). `feeds`: how
    a batch dict's microbatch reaches the stages (mpmd/stages/batch.py); by default the
    shorthand's, inputs and targets of these specs."""
    S, m, P = pipe.num_stages, schedule.num_microbatches, schedule.num_slices
    placement = schedule.placement
    layouts = layouts or Layout.single(pipe, optimizer, P)
    mesh_of = [layouts.meshes[placement[k]] for k in range(S)]  # stage -> its slice's mesh
    feeds = feeds or batches.plan(
        pipe, {batches.INPUTS: micro_input_spec, batches.TARGETS: micro_target_spec}, pair=True
    )
    acts = pipe.activation_specs(feeds.inputs, feeds.side)  # acts[k] enters stage k
    loss_spec = jax.eval_shape(feeds.loss_fn, acts[-1], feeds.targets)
    loss_spec = loss_spec[0] if feeds.weighted else loss_spec
    clip = max_grad_norm is not None
    shared = pipe.shared
    param_specs = [
        tuple(sharding.with_layout(spec(a), lay, mesh_of[k]) for a, lay in zip(fn.param_leaves, layouts.params[k]))
        for k, fn in enumerate(pipe.fns)
    ]

    progs: list[dict] = [{} for _ in range(P)]
    aux, partial, gathered = [], [], []
    # Each stage is traced with its slice's layout in force for mpmd.constrain (constraints.py).
    for k, fn in constraints.each_laid_out(enumerate(pipe.fns), mesh_of, layouts.rules):
        last, mesh = k == S - 1, mesh_of[k]
        scalar = sharding.with_layout(loss_spec, jax.sharding.PartitionSpec(), mesh)
        side = _placed(feeds.side[k], mesh) if feeds.side[k] else None
        aux.append(stage_programs.adds_losses(fn, param_specs[k], acts[k], feeds.side[k]))
        state = (
            tuple(sharding.with_layout(spec(l), jax.sharding.PartitionSpec(), mesh) for l in fn.state.leaves)
            if fn.state is not None
            else None
        )
        shapes = stage_programs.StageShapes(
            param_specs[k],
            _placed(acts[k], mesh),
            scalar if last else _placed(acts[k + 1], mesh),
            _placed(feeds.targets, mesh) if last else None,
            side,
            weighted=last and feeds.weighted,
            aux=aux[-1],
            state=state,
        )
        here = progs[placement[k]]
        # Gradients unreduced over the batch axes until the stage's last gradient task, where
        # the stage allows it (mpmd/stages/partials.py); else reduced in each backward program.
        batch_leaves = jax.tree.leaves((acts[k], feeds.side[k] or {}, acts[k + 1]))
        partial.append(partials.problem(mesh, batch_leaves, fn.state is not None, aux[-1]) is None)
        # FSDP weights gathered once a step (mpmd/stages/gather.py): the training programs take
        # pg{k}, gather{k}'s output; the gradients keep the parameters' own layouts.
        gathered.append(layouts.fsdp_gather == gather.PER_STEP and gather.gathers(layouts.params[k], mesh))
        if gathered[-1]:
            here.update(gather.build(k, param_specs[k]))
        taken = shapes._replace(params=gather.gathered_specs(param_specs[k])) if gathered[-1] else shapes
        here.update(
            stage_programs.build(
                k,
                fn,
                taken,
                first=k == 0,
                last=last,
                loss_fn=feeds.loss_fn,
                num_microbatches=m,
                split_backward=schedule.split_backward,
                partial=mesh if partial[-1] else None,
                grad_specs=param_specs[k],
            )
        )
        if partial[-1]:
            here.update(stage_programs.build_reduce(k, param_specs[k], mesh))
        here.update(
            stage_programs.build_forward_only(
                k, fn, shapes, last=last, loss_fn=feeds.loss_fn, y_specs=_placed(acts[k + 1], mesh)
            )
        )
        if last and feeds.weighted:
            here.update(
                stage_programs.build_weight(
                    k, shapes, loss_fn=feeds.loss_fn, num_microbatches=m, y_specs=_placed(acts[k + 1], mesh)
                )
            )
        # A shared leaf's gradient is counted in the global norm by its first holder only.
        not_counted = [i for g in shared for s, i in g if s == k and s != min(t for t, _ in g)]
        here.update(
            stage_programs.build_optimizer(
                k,
                fn,
                param_specs[k],
                optimizer,
                S,
                max_grad_norm,
                not_counted,
                opt_layouts=[jax.sharding.NamedSharding(mesh.abstract(), o) for o in layouts.opt[k]],
            )
        )

    idx = shared_indices(S, shared)
    for k in range(S):
        if idx[k]:
            progs[placement[k]].update(stage_programs.build_shared(k, param_specs, shared))
    shared_specs = _shared_transfers(shared, idx, param_specs, layouts, mesh_of)
    cts = [
        _differentiable(_laid_out(acts[k + 1], mesh_of[k]), _pieces(acts[k + 1], mesh_of[k + 1]) if k + 1 < S else ())
        for k in range(S)
    ]
    transfers = Transfers(
        [_laid_out(a, mesh_of[k]) if k < S else () for k, a in enumerate(acts)],
        [_pieces(a, mesh_of[k - 1]) if 0 < k else () for k, a in enumerate(acts)],
        [c[0] for c in cts],
        [c[1] for c in cts],
    )
    io = StageIO(
        tuple(s is not None for s in feeds.side),
        tuple(aux),
        feeds.weighted,
        tuple(fn.state is not None for fn in pipe.fns),
        tuple(partial),
        tuple(gathered),
    )
    train = train_streams(schedule, transfers, clip, shared, shared_specs, io)
    evaluate, predict = _forward_only(schedule, transfers, io)

    fetch = {placement[-1]: tuple(names.loss(j) for j in range(m)) + ((names.weight_sum(),) if io.weighted else ())}
    eval_fetch = dict(fetch)  # forward-only programs return no auxiliary losses
    for k in range(S):
        if io.adds_aux(k):
            fetch[placement[k]] = fetch.get(placement[k], ()) + tuple(names.aux(k, j) for j in range(m))
    loss_fetch = dict(fetch)
    if clip:  # every slice receives every stage's squared norm; slice 0 reports them
        fetch[0] = fetch.get(0, ()) + tuple(names.sqnorm(k) for k in range(S))
    # What outlives a plan, as name templates (runtime/worker/streams.py with_deletes): every
    # stage's state, and what the controller fetches (every loss, every squared norm).
    K, J = "{k}", "{j}"
    persistent = {names.params(K), names.opt_state(K)} | ({names.stage_state(K)} if any(io.state) else set())
    reported = {names.aux(K, J)} if any(io.aux) else set()
    kept = {
        r: persistent
        | reported
        | ({names.loss(J), names.weight_sum()} if r == placement[-1] else set())
        | ({names.sqnorm(K)} if clip and r == 0 else set())
        for r in range(P)
    }
    # The gradient plan is the training plan minus the optimizer: same programs, no update.
    no_update = [s.select(~s.template_mask(_is_update)) for s in train]
    # Deletes and receive marks are left to each worker, for its own slice (runtime/worker/streams.py
    # PackedStream.finishing): the window's marks are row indices, Deletes included.
    windows = recv_windows(schedule, recv_window)
    grads = [s.finishing(kept[r] | {names.grads(K)}, windows[r]) for r, s in enumerate(no_update)]
    train = [s.finishing(kept[r], windows[r]) for r, s in enumerate(train)]
    evaluate = [s.finishing(kept[r], windows[r]) for r, s in enumerate(evaluate)]
    predict = [s.finishing(persistent | {names.output(J)}, windows[r]) for r, s in enumerate(predict)]
    init = [
        PackedStream.from_instructions(
            [
                Run(names.program("opt_init", k), (names.params(k),), (names.opt_state(k),), f"init s{k}")
                for k in schedule.stages_on(r)
            ]
        )
        for r in range(P)
    ]
    return Lowered(P, progs, train, grads, evaluate, predict, init, fetch, loss_fetch, eval_fetch, io)


def _shared_transfers(shared, idx, param_specs, layouts: Layout, mesh_of) -> dict:
    """{(q, k): (specs, pieces)}: holder q's shared part as holder k receives it, each leaf
    laid out like k's own copy of that weight (replicated if k holds no copy of it)."""
    out = {}
    copy_on = {}  # (q, j) -> {k: i}: where the other copies of q's leaf j sit
    for group in shared:
        for q, j in group:
            copy_on[(q, j)] = dict(group)
    for k in range(len(idx)):
        for q in range(len(idx)):
            if q == k or not idx[k] or not idx[q] or not any(k in copy_on[(q, j)] for j in idx[q]):
                continue
            specs, pieces = [], []
            for j in idx[q]:
                i = copy_on[(q, j)].get(k)
                lay = tuple(layouts.params[k][i]) if i is not None else ()
                leaf = param_specs[q][j]
                specs.append(Spec(tuple(leaf.shape), jax.numpy.dtype(leaf.dtype).name, lay))
                pieces.append(sharding.batch_pieces(layouts.params[q][j], mesh_of[q]))
            out[(q, k)] = (tuple(specs), tuple(pieces))
    return out


def _forward_only(schedule: schedules.Schedule, transfers: Transfers, io: StageIO = StageIO()):
    """Evaluation and prediction plans, every slice's `forward_only_stream`."""
    plans = [forward_only_stream(schedule, r, transfers, io) for r in range(schedule.num_slices)]
    return [e for e, _ in plans], [p for _, p in plans]


def forward_only_stream(
    schedule: schedules.Schedule, r: int, transfers: Transfers, io: StageIO = StageIO()
) -> tuple[PackedStream, PackedStream]:
    """Slice r's evaluation and prediction streams: F tasks only, in (microbatch, stage) order.

    Every dependency F(k-1, j) -> F(k, j) goes forward in that one global order, so no slice
    can wait on a task that waits on it: deadlock-free for any placement. The rows of one
    microbatch are the same for every microbatch, so they are tiled m times.
    """
    S, placement, m = schedule.num_stages, schedule.placement, schedule.num_microbatches
    row = Rows()
    evaluate, predict = [], []
    for k in schedule.stages_on(r):
        a_in = names.inputs(J) if k == 0 else names.activation(K, J)
        out = names.output(J) if k == S - 1 else names.activation(Q, J)
        rows = []
        if k > 0 and placement[k - 1] != r:
            rows.append(
                row(
                    Recv(a_in, 0, names.act_key(K, J), transfers.acts_in[k], transfers.act_pieces[k]),
                    k,
                    0,
                    placement[k - 1],
                )
            )
        side = (names.side(K, J),) if io.takes_side(k) else ()
        state = (names.stage_state(K),) if io.carries_state(k) else ()
        rows.append(
            row(
                Run(names.program("infer", K), (names.params(K),) + state + (a_in,) + side, (out,), f"F s{K} mb{J}"),
                k,
                k + 1,
            )
        )
        if k < S - 1 and placement[k + 1] != r:
            rows.append(row(Send(out, 0, names.act_key(Q, J), transfers.act_pieces[k + 1]), k, k + 1, placement[k + 1]))
        evaluate += rows
        predict += rows
        if k == S - 1:
            evaluate.append(
                row(Run(names.program("loss", K), (out, names.targets(J)), (names.loss(J),), f"loss mb{J}"), k)
            )
    every = np.arange(m, dtype=np.int32)
    head = []
    if io.weighted and placement[-1] == r:  # the step's total weight, before any loss
        head = [Rows.block([row(weight_total(m), S - 1)])]
    return (
        row.encoded(head + [tiled([evaluate], np.zeros(m, np.int64), every)]),
        row.encoded([tiled([predict], np.zeros(m, np.int64), every)]),
    )


def _is_update(ins: Instruction) -> bool:
    """Part of the optimizer step: the update, the clipping norm and its exchange."""
    if isinstance(ins, Run):
        return names.parse_program(ins.program).kind in ("update", "sqnorm")
    if isinstance(ins, (Send, Recv)):
        return names.parse_key(ins.key).kind == "sqnorm_to"
    return False
