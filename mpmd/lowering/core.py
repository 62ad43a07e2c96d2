"""Lower pipeline + schedule into runtime programs and one instruction stream per slice.

Every buffer, transfer key and program is named through mpmd/stages/names.py; which slice holds a
stage is the schedule's `placement`. A training stream is emitted task by task by
`_TrainStream`, one method per part of the step (forward, input gradient, weight
gradient, shared-weight exchange, clipping norm, update), so each part reads on its own.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np

from mpmd.runtime.worker.instructions import Instruction, Recv, Run, Send, Spec
from mpmd.runtime.worker.streams import PackedStream
from mpmd.stages import batch as batches
from mpmd.stages import names, partials
from mpmd.schedules import core as schedules
from mpmd.stages import constraints, sharding
from mpmd.schedules import simulate
from mpmd.stages import programs as stage_programs
from mpmd.stages.pipeline import Pipeline, shared_indices, shared_peers
from mpmd.stages.specs import spec
from mpmd.schedules.task_arrays import KIND_CODES, as_arrays

SCALAR = (Spec((), "float32"),)


class Layout(NamedTuple):
    """Where everything lies: each slice's mesh, each stage's parameter and optimizer-state
    layouts (mpmd/stages/sharding.py). `Layout.single(...)`: one device per slice, all replicated."""
    meshes: list                  # per slice: sharding.SliceMesh
    params: list                  # per stage: PartitionSpec per parameter leaf
    opt: list                     # per stage: PartitionSpec per optimizer-state leaf
    rules: dict | None = None     # logical axis -> mesh axis (mpmd.constrain inside the programs)

    @staticmethod
    def single(pipe: Pipeline, optimizer, num_slices: int) -> "Layout":
        return layout(pipe, optimizer, [sharding.SliceMesh()] * num_slices, (0,) * pipe.num_stages, {})


def layout(pipe: Pipeline, optimizer, meshes, placement, rules) -> Layout:
    """The layouts of every stage's state on its slice's mesh; ValueError naming a parameter
    whose dimension a mesh axis does not divide."""
    params, opt = [], []
    for k, fn in enumerate(pipe.fns):
        mesh = meshes[placement[k]]
        p = sharding.stage_param_layouts(fn, mesh, rules, k)
        params.append(p)
        opt.append(sharding.optimizer_layouts(optimizer, fn, p))
    return Layout(list(meshes), params, opt, dict(rules or {}))


class Transfers(NamedTuple):
    """The specs a receive names and the pieces a send cuts, per kind of transfer. Index k:
    acts_in[k] / act_pieces[k]: the activation entering stage k (on k's slice / as k-1's slice
    cuts it); cts_in[k] / ct_pieces[k]: the gradient of stage k's output (on k's slice / as
    k+1's slice cuts it)."""
    acts_in: list
    act_pieces: list
    cts_in: list
    ct_pieces: list

    @staticmethod
    def plain(act_specs: list[tuple[Spec, ...]]) -> "Transfers":
        """Whole arrays, as received (act_specs[k]: the bundle entering stage k; k =
        num_stages: the last output)."""
        return Transfers(list(act_specs), [()] * len(act_specs), list(act_specs[1:]), [()] * (len(act_specs) - 1))


def _laid_out(tree, mesh) -> tuple[Spec, ...]:
    """Specs of an activation bundle on `mesh`: each leaf split along its batch axis."""
    return tuple(Spec(tuple(l.shape), jax.numpy.dtype(l.dtype).name,
                      tuple(sharding.batch_layout(l.shape, mesh))) for l in jax.tree.leaves(tree))


def _pieces(tree, mesh) -> tuple[int, ...]:
    """Into how many batch shards `mesh` cuts each leaf of an activation bundle (a send's pieces)."""
    return tuple(sharding.batch_pieces(sharding.batch_layout(l.shape, mesh), mesh) for l in jax.tree.leaves(tree))


def _placed(tree, mesh):
    """A pytree of abstract arrays as ShapeDtypeStructs laid out (batch axis) on `mesh`."""
    return jax.tree.map(lambda l: sharding.with_layout(l, sharding.batch_layout(l.shape, mesh), mesh), tree)


class StageIO(NamedTuple):
    """What a stage's programs take and give beyond activations (mpmd/stages/batch.py): per
    stage whether it is fed side inputs and whether it adds auxiliary losses, and whether the
    loss is weighted (the last slice first sums the step's weights). The defaults: none."""
    side: tuple = ()
    aux: tuple = ()
    weighted: bool = False
    state: tuple = ()              # per stage: whether it carries stage state (st{k})
    partial: tuple = ()            # per stage: its gradients accumulate unreduced (mpmd/stages/partials.py)

    def takes_side(self, k: int) -> bool:
        return bool(self.side) and self.side[k]

    def adds_aux(self, k: int) -> bool:
        return bool(self.aux) and self.aux[k]

    def carries_state(self, k: int) -> bool:
        return bool(self.state) and self.state[k]

    def reduces(self, k: int) -> bool:
        """Whether stage k's gradient is reduced once, by reduce{k} after its last gradient task."""
        return bool(self.partial) and self.partial[k]


def _differentiable(specs: tuple, pieces: tuple) -> tuple[tuple, tuple]:
    """The leaves of a cotangent transfer: only floating-point leaves carry one back."""
    keep = [stage_programs.differentiable(s) for s in specs]
    return (tuple(s for s, k in zip(specs, keep) if k),
            tuple(p for p, k in zip(pieces, keep) if k) if pieces else pieces)


class Lowered(NamedTuple):
    num_slices: int
    programs: list[dict]                   # per slice: name -> ProgramSpec
    # Plans, one encoded stream per slice (runtime/worker/streams.py; each reads as its instructions):
    train: list[PackedStream]                   # the training step
    grads: list[PackedStream]                   # forward + backward only, gradients kept
    eval: list[PackedStream]                    # forward only, loss per microbatch
    predict: list[PackedStream]                 # forward only, last stage's output kept
    init: list[PackedStream]                    # optimizer-state creation
    fetch: dict[int, tuple[str, ...]]      # what the controller reads after a training step
    loss_fetch: dict[int, tuple[str, ...]]  # after a gradient run: the losses, auxiliary ones too
    eval_fetch: dict[int, tuple[str, ...]]  # after an evaluation run: the losses
    io: StageIO = StageIO()                 # side inputs, auxiliary losses, weighted loss


def recv_windows(schedule: schedules.Schedule, recv_window: int | None = None) -> tuple[int, ...]:
    """Per slice, how many receives may be outstanding at once (mpmd.runtime.worker.streams
    with_recv_window): `recv_window` for every slice, or by default the slice's peak of live
    activations in the schedule (mpmd/schedules/simulate.py), so a slice never holds more received,
    not yet used bundles than the activations the schedule itself keeps alive there."""
    if recv_window is not None:
        return (recv_window,) * schedule.num_slices
    return tuple(max(1, n) for n in simulate.simulate(schedule).peak_live_activations)


def lower(pipe: Pipeline, schedule: schedules.Schedule, optimizer, max_grad_norm,
          micro_input_spec, micro_target_spec, layouts: Layout | None = None,
          recv_window: int | None = None, feeds: batches.BatchPlan | None = None) -> Lowered:
    """`recv_window`: receives outstanding at once per slice (see recv_windows). `feeds`: how
    a batch dict's microbatch reaches the stages (mpmd/stages/batch.py); by default the
    shorthand's, inputs and targets of these specs."""
    S, m, P = pipe.num_stages, schedule.num_microbatches, schedule.num_slices
    placement = schedule.placement
    layouts = layouts or Layout.single(pipe, optimizer, P)
    mesh_of = [layouts.meshes[placement[k]] for k in range(S)]     # stage -> its slice's mesh
    feeds = feeds or batches.plan(pipe, {batches.INPUTS: micro_input_spec, batches.TARGETS: micro_target_spec},
                                  pair=True)
    acts = pipe.activation_specs(feeds.inputs, feeds.side)          # acts[k] enters stage k
    loss_spec = jax.eval_shape(feeds.loss_fn, acts[-1], feeds.targets)
    loss_spec = loss_spec[0] if feeds.weighted else loss_spec
    clip = max_grad_norm is not None
    shared = pipe.shared
    param_specs = [tuple(sharding.with_layout(spec(a), lay, mesh_of[k])
                         for a, lay in zip(fn.param_leaves, layouts.params[k])) for k, fn in enumerate(pipe.fns)]

    progs: list[dict] = [{} for _ in range(P)]
    aux, partial = [], []
    # Each stage is traced with its slice's layout in force for mpmd.constrain (constraints.py).
    for k, fn in constraints.each_laid_out(enumerate(pipe.fns), mesh_of, layouts.rules):
        last, mesh = k == S - 1, mesh_of[k]
        scalar = sharding.with_layout(loss_spec, jax.sharding.PartitionSpec(), mesh)
        side = _placed(feeds.side[k], mesh) if feeds.side[k] else None
        aux.append(stage_programs.adds_losses(fn, param_specs[k], acts[k], feeds.side[k]))
        state = (tuple(sharding.with_layout(spec(l), jax.sharding.PartitionSpec(), mesh) for l in fn.state.leaves)
                 if fn.state is not None else None)
        shapes = stage_programs.StageShapes(param_specs[k], _placed(acts[k], mesh),
                                            scalar if last else _placed(acts[k + 1], mesh),
                                            _placed(feeds.targets, mesh) if last else None, side,
                                            weighted=last and feeds.weighted, aux=aux[-1], state=state)
        here = progs[placement[k]]
        # Gradients unreduced over the batch axes until the stage's last gradient task, where
        # the stage allows it (mpmd/stages/partials.py); else reduced in each backward program.
        batch_leaves = jax.tree.leaves((acts[k], feeds.side[k] or {}, acts[k + 1]))
        partial.append(partials.problem(mesh, batch_leaves, fn.state is not None, aux[-1]) is None)
        here.update(stage_programs.build(k, fn, shapes, first=k == 0, last=last, loss_fn=feeds.loss_fn,
                                         num_microbatches=m, split_backward=schedule.split_backward,
                                         partial=mesh if partial[-1] else None))
        if partial[-1]:
            here.update(stage_programs.build_reduce(k, param_specs[k], mesh))
        here.update(stage_programs.build_forward_only(k, fn, shapes, last=last, loss_fn=feeds.loss_fn,
                                                      y_specs=_placed(acts[k + 1], mesh)))
        if last and feeds.weighted:
            here.update(stage_programs.build_weight(k, shapes, loss_fn=feeds.loss_fn, num_microbatches=m,
                                                    y_specs=_placed(acts[k + 1], mesh)))
        # A shared leaf's gradient is counted in the global norm by its first holder only.
        not_counted = [i for g in shared for s, i in g if s == k and s != min(t for t, _ in g)]
        here.update(stage_programs.build_optimizer(k, fn, param_specs[k], optimizer, S, max_grad_norm,
                                                   not_counted, opt_layouts=[jax.sharding.NamedSharding(
                                                       mesh.abstract(), o) for o in layouts.opt[k]]))

    idx = shared_indices(S, shared)
    for k in range(S):
        if idx[k]:
            progs[placement[k]].update(stage_programs.build_shared(k, param_specs, shared))
    shared_specs = _shared_transfers(shared, idx, param_specs, layouts, mesh_of)
    cts = [_differentiable(_laid_out(acts[k + 1], mesh_of[k]),
                           _pieces(acts[k + 1], mesh_of[k + 1]) if k + 1 < S else ()) for k in range(S)]
    transfers = Transfers([_laid_out(a, mesh_of[k]) if k < S else () for k, a in enumerate(acts)],
                          [_pieces(a, mesh_of[k - 1]) if 0 < k else ()
                           for k, a in enumerate(acts)],
                          [c[0] for c in cts], [c[1] for c in cts])
    io = StageIO(tuple(s is not None for s in feeds.side), tuple(aux), feeds.weighted,
                 tuple(fn.state is not None for fn in pipe.fns), tuple(partial))
    train = train_streams(schedule, transfers, clip, shared, shared_specs, io)
    evaluate, predict = _forward_only(schedule, transfers, io)

    fetch = {placement[-1]: tuple(names.loss(j) for j in range(m)) + ((names.weight_sum(),) if io.weighted else ())}
    eval_fetch = dict(fetch)   # forward-only programs return no auxiliary losses
    for k in range(S):
        if io.adds_aux(k):
            fetch[placement[k]] = fetch.get(placement[k], ()) + tuple(names.aux(k, j) for j in range(m))
    loss_fetch = dict(fetch)
    if clip:   # every slice receives every stage's squared norm; slice 0 reports them
        fetch[0] = fetch.get(0, ()) + tuple(names.sqnorm(k) for k in range(S))
    # What outlives a plan, as name templates (runtime/worker/streams.py with_deletes): every
    # stage's state, and what the controller fetches (every loss, every squared norm).
    K, J = "{k}", "{j}"
    persistent = {names.params(K), names.opt_state(K)} | ({names.stage_state(K)} if any(io.state) else set())
    reported = ({names.aux(K, J)} if any(io.aux) else set())
    kept = {r: persistent | reported | ({names.loss(J), names.weight_sum()} if r == placement[-1] else set())
            | ({names.sqnorm(K)} if clip and r == 0 else set()) for r in range(P)}
    # The gradient plan is the training plan minus the optimizer: same programs, no update.
    no_update = [s.select(~s.template_mask(_is_update)) for s in train]
    # Deletes and receive marks are left to each worker, for its own slice (runtime/worker/streams.py
    # PackedStream.finishing): the window's marks are row indices, Deletes included.
    windows = recv_windows(schedule, recv_window)
    grads = [s.finishing(kept[r] | {names.grads(K)}, windows[r]) for r, s in enumerate(no_update)]
    train = [s.finishing(kept[r], windows[r]) for r, s in enumerate(train)]
    evaluate = [s.finishing(kept[r], windows[r]) for r, s in enumerate(evaluate)]
    predict = [s.finishing(persistent | {names.output(J)}, windows[r]) for r, s in enumerate(predict)]
    init = [PackedStream.from_instructions([Run(names.program("opt_init", k), (names.params(k),), (names.opt_state(k),),
                                           f"init s{k}") for k in schedule.stages_on(r)]) for r in range(P)]
    return Lowered(P, progs, train, grads, evaluate, predict, init, fetch, loss_fetch, eval_fetch, io)


def _shared_transfers(shared, idx, param_specs, layouts: Layout, mesh_of) -> dict:
    """{(q, k): (specs, pieces)}: holder q's shared part as holder k receives it, each leaf
    laid out like k's own copy of that weight (replicated if k holds no copy of it)."""
    out = {}
    copy_on = {}          # (q, j) -> {k: i}: where the other copies of q's leaf j sit
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


def train_streams(schedule: schedules.Schedule, transfers: Transfers, clip: bool,
                  shared: list[list[tuple[int, int]]] = (), shared_specs: dict | None = None,
                  io: StageIO = StageIO()) -> list[PackedStream]:
    """One training step's instruction stream per slice, before Deletes are inserted: every
    slice's `train_stream`."""
    schedule = schedule._replace(slices=as_arrays(schedule.slices))   # converted once
    return [train_stream(schedule, r, transfers, clip, shared, shared_specs, io)
            for r in range(schedule.num_slices)]


# Template fields (runtime/worker/streams.py): k the task's stage, j its microbatch, q the other
# stage a row names (k + 1 for what F sends, k - 1 for what B sends) or a destination.
K, J, Q = "{k}", "{j}", "{q}"


class _Rows:
    """One slice's templates (deduplicated) and rows as (template id, k, q, peer) tuples or
    blocks of arrays; every name comes from mpmd/stages/names.py with fields for k, j, q."""

    def __init__(self):
        self.ids: dict = {}

    def __call__(self, template, k: int, q: int = 0, peer: int = 0) -> tuple[int, int, int, int]:
        return self.ids.setdefault(template, len(self.ids)), k, max(q, 0), peer

    @staticmethod
    def block(rows, j=0) -> tuple[np.ndarray, ...]:
        """(op, k, j, q, peer) arrays of `rows` (each (id, k, q, peer)), microbatch j."""
        a = np.array(rows, dtype=np.int32).reshape(-1, 4).T
        return a[0], a[1], np.full(len(rows), j, np.int32), a[2], a[3]

    def encoded(self, blocks) -> PackedStream:
        cols = [np.concatenate([b[c] for b in blocks]) if blocks else np.zeros(0, np.int32) for c in range(5)]
        return PackedStream(list(self.ids), *cols, np.full(len(cols[0]), -1, np.int32))


def _tiled(patterns: list, rows_of: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, ...]:
    """The rows of a sequence of tasks: task t emits `patterns[rows_of[t]]`, rows of fixed
    (op, k, q, peer) (a list of tuples or a block of arrays), its microbatch j[t] filled in.
    Gathered from a (pattern, position) table, so the cost is a few passes over the rows."""
    width = max([len(p[0]) if isinstance(p, tuple) else len(p) for p in patterns] + [1])
    table = np.zeros((4, len(patterns), width), np.int32)
    lengths = np.zeros(len(patterns), np.int64)
    for c, p in enumerate(patterns):
        if isinstance(p, tuple):      # a block: (op, k, j, q, peer)
            cols = np.stack([p[0], p[1], p[3], p[4]]) if len(p[0]) else np.zeros((4, 0), np.int32)
        else:
            cols = np.array(p, dtype=np.int32).reshape(-1, 4).T
        table[:, c, :cols.shape[1]] = cols
        lengths[c] = cols.shape[1]
    per_task = lengths[rows_of]
    starts = np.cumsum(per_task) - per_task
    # Per row: its place in the table, pattern * width + position in the pattern.
    at = np.repeat(rows_of * width - starts, per_task) + np.arange(int(per_task.sum()))
    op, k, q, peer = (np.take(table[i].ravel(), at) for i in range(4))
    return op, k, np.repeat(j.astype(np.int32), per_task), q, peer


def train_stream(schedule: schedules.Schedule, r: int, transfers: Transfers, clip: bool,
                 shared: list[list[tuple[int, int]]] = (), shared_specs: dict | None = None,
                 io: StageIO = StageIO()) -> PackedStream:
    """Slice r's instruction stream for one training step, before Deletes are inserted,
    encoded (runtime/worker/streams.py) and computed from the schedule's task arrays with numpy:
    each kind of task on each of the slice's stages emits a fixed pattern of rows, its
    microbatch filled in.

    `transfers` gives each receive's specs and each send's pieces (see Transfers; for plans
    without layouts, `Transfers.plain(act_specs)`). The streams name programs but do not
    need them, so a dry run can replay a schedule with synthetic programs of declared cost
    under the same names (mpmd/lowering/dryrun.py).

    `shared` groups (stage, leaf) pairs that are one parameter held by several stages (a tied
    embedding): once a stage's gradient is final it sends its shared leaves' gradients to
    the other holders, and before the update each holder sums every holder's part in stage
    order, so all copies get the same total gradient, bit for bit, and stay identical.
    """
    tasks = as_arrays(schedule.slices)
    a, b = int(tasks.offsets[r]), int(tasks.offsets[r + 1])
    stage, mb, kind = tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b]
    out = _TrainRows(schedule, r, transfers, clip, _peers(schedule.num_stages, tuple(map(tuple, shared))),
                     shared_specs or {}, io)
    mine = out.stages
    local = np.full(schedule.num_stages, 0, np.int64)
    local[list(mine)] = np.arange(len(mine))
    # The first and the last gradient task of each stage: the first starts the gradient
    # buffer, after the last it is final.
    grad = kind == KIND_CODES[schedules.WEIGHT if schedule.split_backward else schedules.BACKWARD]
    first = np.zeros(len(stage), np.int64)
    patterns = [out.task(code, k, bool(f)) for code in range(len(KIND_CODES)) for k in mine for f in (0, 1)]
    rows_of = (kind.astype(np.int64) * len(mine) + local[stage]) * 2
    finals = []       # (after which task, pattern): what follows a stage's last gradient task
    for k in mine:
        at = np.flatnonzero(grad & (stage == k))
        if len(at):
            first[at[0]] = 1
            finals.append((int(at[-1]) + 1, len(patterns)))
            patterns.append(out.gradient_final(k))
    rows_of += first
    if finals:        # each as a task of its own, right after the last gradient task
        where, which = zip(*finals)
        rows_of, mb = np.insert(rows_of, where, which), np.insert(mb, where, 0)
    return out.rows.encoded(out.head() + [_tiled(patterns, rows_of, mb)] + out.tail())


class _TrainRows:
    """The row patterns of one slice's training stream: one method per part of the step
    (forward, input gradient, weight gradient, shared-weight exchange, clipping norm,
    update). A transfer is emitted only where producer and consumer sit on different slices."""

    def __init__(self, schedule: schedules.Schedule, r: int, transfers: Transfers, clip: bool, peers, shared_specs,
                 io: StageIO = StageIO()):
        self.r, self.clip, self.peers, self.shared_specs, self.io = r, clip, peers, shared_specs, io
        self.num_microbatches = schedule.num_microbatches
        self.t = transfers
        self.placement = schedule.placement
        self.num_stages, self.num_slices = schedule.num_stages, schedule.num_slices
        self.split = schedule.split_backward
        self.stages = schedule.stages_on(r)
        self.rows = _Rows()

    def _elsewhere(self, k: int) -> bool:
        return self.placement[k] != self.r

    def task(self, code: int, k: int, first: bool) -> list:
        """The rows of one task of kind `code` on stage k (`first`: the stage's first gradient task)."""
        if code == KIND_CODES[schedules.FORWARD]:
            return self.forward(k)
        if code == KIND_CODES[schedules.BACKWARD] and self.split:
            return self.input_grad(k)
        # a full backward (B without split) or a weight gradient (W)
        return self.weight_grad(k, code == KIND_CODES[schedules.BACKWARD], first)

    # -- before the first task ----------------------------------------------------------------
    def head(self) -> list[tuple[np.ndarray, ...]]:
        """A weighted loss: the last stage's slice sums the step's weights first (they read
        the batch only), so every backward can be seeded with 1/total."""
        last = self.num_stages - 1
        if not self.io.weighted or self._elsewhere(last):
            return []
        return [_Rows.block([self.rows(_weight_total(self.num_microbatches), last)])]

    # -- forward --------------------------------------------------------------------------
    def forward(self, k: int) -> list:
        row, t, pl = self.rows, self.t, self.placement
        first, last = k == 0, k == self.num_stages - 1
        a_in = names.inputs(J) if first else names.activation(K, J)
        rows = []
        if not first and self._elsewhere(k - 1):
            rows.append(row(Recv(a_in, 0, names.act_key(K, J), t.acts_in[k], t.act_pieces[k]), k, 0, pl[k - 1]))
        out = names.loss(J) if last else names.activation(Q, J)
        fed = ((names.side(K, J),) if self.io.takes_side(k) else ()) + ((names.targets(J),) if last else ())
        aux = (names.aux(K, J),) if self.io.adds_aux(k) else ()
        # Stage state is read and written by each forward in turn, microbatch 0..m-1.
        state = (names.stage_state(K),) if self.io.carries_state(k) else ()
        rows.append(row(Run(names.program("fwd", K), (names.params(K),) + state + (a_in,) + fed,
                            (out, names.residuals(K, J)) + state + aux, f"F s{K} mb{J}"), k, k + 1))
        if not last and self._elsewhere(k + 1):
            rows.append(row(Send(out, 0, names.act_key(Q, J), t.act_pieces[k + 1]), k, k + 1, pl[k + 1]))
        return rows

    # -- backward -------------------------------------------------------------------------
    def _backward_inputs(self, k: int, receive: bool, rows: list) -> tuple[str, ...]:
        """(params, residuals[, cotangent of the output]); receives the cotangent once, at
        the task that first needs it (B, not W)."""
        if k == self.num_stages - 1:    # the loss: its cotangent is 1/m, or 1/total weight
            return (names.params(K), names.residuals(K, J)) + ((names.weight_sum(),) if self.io.weighted else ())
        d = names.cotangent(K, J)
        if receive and self._elsewhere(k + 1):
            rows.append(self.rows(Recv(d, 0, names.grad_key(K, J), self.t.cts_in[k], self.t.ct_pieces[k]),
                                  k, 0, self.placement[k + 1]))
        return names.params(K), names.residuals(K, J), d

    def _send_input_grad(self, k: int, rows: list) -> None:
        if k > 0 and self._elsewhere(k - 1):
            rows.append(self.rows(Send(names.cotangent(Q, J), 0, names.grad_key(Q, J), self.t.ct_pieces[k - 1]),
                                  k, k - 1, self.placement[k - 1]))

    def input_grad(self, k: int) -> list:
        """Zero-bubble B: the input gradient, and what W needs of B's work, kept until W
        (none for the first stage: its input is data)."""
        rows = []
        base = self._backward_inputs(k, True, rows)
        if k > 0:
            rows.append(self.rows(Run(names.program("bwd_in", K), base, (names.cotangent(Q, J), names.kept(K, J)),
                                      f"B s{K} mb{J}"), k, k - 1))
            self._send_input_grad(k, rows)
        return rows

    def weight_grad(self, k: int, input_grad_too: bool, first: bool) -> list:
        """Accumulate stage k's weight gradient for a microbatch (W), or with input_grad_too
        the full backward (B of a schedule without split backward)."""
        rows = []
        base = self._backward_inputs(k, input_grad_too, rows)
        if self.split and k > 0:
            base += (names.kept(K, J),)
        g = names.grads(K)
        acc = () if first else (g,)
        kind = ("bwd_w_" if self.split else "bwd_") + ("first" if first else "acc")
        dx = (names.cotangent(Q, J),) if input_grad_too and k > 0 else ()
        label = f"{'B' if input_grad_too else 'W'} s{K} mb{J}"
        rows.append(self.rows(Run(names.program(kind, K), base + acc, dx + (g,), label), k, k - 1))
        if input_grad_too:
            self._send_input_grad(k, rows)
        return rows

    def gradient_final(self, k: int) -> tuple[np.ndarray, ...]:
        """The rows after stage k's last gradient task: its one reduction over the batch axes
        when its gradient accumulated unreduced, then what follows a final gradient."""
        final = self._gradient_final(k)
        if not self.io.reduces(k):
            return final
        reduce = _Rows.block([self.rows(Run(names.program("reduce", K), (names.grads(K),), (names.grads(K),),
                                            f"reduce s{K}"), k)])
        return tuple(np.concatenate(c) for c in zip(reduce, final))

    def _gradient_final(self, k: int) -> tuple[np.ndarray, ...]:
        if self.peers[k]:
            # Offer the shared part to the other holders; the norm waits for their parts.
            rows = [self.rows(Run(names.program("shared_out", K), (names.grads(K),), (names.shared(K),),
                                  f"shared out s{K}"), k)]
            rows += [self.rows(Send(names.shared(K), 0, names.shared_key(K, Q), self.shared_specs[(k, q)][1]),
                               k, q, self.placement[q]) for q in self.peers[k] if self._elsewhere(q)]
            return _Rows.block(rows)
        if self.clip:
            # Final, and nothing to add to it: start the norm exchange now so it overlaps
            # with the slice's remaining tasks.
            return self._send_norm(k)
        return _Rows.block([])

    # -- after the last task ------------------------------------------------------------------
    def tail(self) -> list[tuple[np.ndarray, ...]]:
        return self.sum_shared() + self.receive_norms() + [self.update()]

    def sum_shared(self) -> list[tuple[np.ndarray, ...]]:
        """Each holder of a shared parameter sums every holder's part, in stage order."""
        blocks = []
        for k in self.stages:
            if not self.peers[k]:
                continue
            rows = [self.rows(Recv(names.shared(Q), 0, names.shared_key(Q, K), *self.shared_specs[(q, k)]),
                              k, q, self.placement[q])
                    for q in self.peers[k] if self._elsewhere(q)]   # a local peer's part is its own buffer
            parts = tuple(names.shared(q) for q in sorted(self.peers[k] + [k]))
            rows.append(self.rows(Run(names.program("shared_in", K), (names.grads(K),) + parts, (names.grads(K),),
                                      f"shared sum s{K}"), k))
            blocks.append(_Rows.block(rows))
            if self.clip:
                blocks.append(self._send_norm(k))
        return blocks

    def _send_norm(self, k: int) -> tuple[np.ndarray, ...]:
        """Stage k's squared gradient norm, to every other slice (each computes the global norm)."""
        run = self.rows(Run(names.program("sqnorm", K), (names.grads(K),), (names.sqnorm(K),), f"norm s{K}"), k)
        send = self.rows(Send(names.sqnorm(K), 0, names.sqnorm_key(K, Q)), k)[0]
        others = np.delete(np.arange(self.num_slices, dtype=np.int32), self.r)
        n = len(others) + 1
        return (np.concatenate(([run[0]], np.full(n - 1, send))), np.full(n, k, np.int32), np.zeros(n, np.int32),
                np.concatenate(([0], others)), np.concatenate(([0], others)))

    def receive_norms(self) -> list[tuple[np.ndarray, ...]]:
        if not self.clip:
            return []
        placement = np.asarray(self.placement, dtype=np.int32)
        ks = np.flatnonzero(placement != self.r).astype(np.int32)
        op = self.rows(Recv(names.sqnorm(K), 0, names.sqnorm_key(K, Q), SCALAR), 0)[0]
        n = len(ks)
        return [(np.full(n, op, np.int32), ks, np.zeros(n, np.int32), np.full(n, self.r, np.int32), placement[ks])]

    def update(self) -> tuple[np.ndarray, ...]:
        sq = _sqnorms(self.num_stages) if self.clip else ()
        state = (names.params(K), names.opt_state(K))
        return _Rows.block([self.rows(Run(names.program("update", K), state + (names.grads(K),) + sq, state,
                                          f"U s{K}"), k) for k in self.stages])


@functools.lru_cache(maxsize=4)
def _peers(num_stages: int, shared: tuple) -> list[list[int]]:
    """pipeline.shared_peers, once per pipeline rather than once per slice."""
    return shared_peers(num_stages, shared)


@functools.lru_cache(maxsize=4)
def _sqnorms(num_stages: int) -> tuple[str, ...]:
    """Every stage's squared-norm buffer, the update's inputs when clipping (one tuple for
    all slices)."""
    return tuple(names.sqnorm(i) for i in range(num_stages))


def _forward_only(schedule: schedules.Schedule, transfers: Transfers, io: StageIO = StageIO()):
    """Evaluation and prediction plans, every slice's `forward_only_stream`."""
    plans = [forward_only_stream(schedule, r, transfers, io) for r in range(schedule.num_slices)]
    return [e for e, _ in plans], [p for _, p in plans]


def forward_only_stream(schedule: schedules.Schedule, r: int, transfers: Transfers,
                        io: StageIO = StageIO()) -> tuple[PackedStream, PackedStream]:
    """Slice r's evaluation and prediction streams: F tasks only, in (microbatch, stage) order.

    Every dependency F(k-1, j) -> F(k, j) goes forward in that one global order, so no slice
    can wait on a task that waits on it: deadlock-free for any placement. The rows of one
    microbatch are the same for every microbatch, so they are tiled m times.
    """
    S, placement, m = schedule.num_stages, schedule.placement, schedule.num_microbatches
    row = _Rows()
    evaluate, predict = [], []
    for k in schedule.stages_on(r):
        a_in = names.inputs(J) if k == 0 else names.activation(K, J)
        out = names.output(J) if k == S - 1 else names.activation(Q, J)
        rows = []
        if k > 0 and placement[k - 1] != r:
            rows.append(row(Recv(a_in, 0, names.act_key(K, J), transfers.acts_in[k], transfers.act_pieces[k]),
                            k, 0, placement[k - 1]))
        side = (names.side(K, J),) if io.takes_side(k) else ()
        state = (names.stage_state(K),) if io.carries_state(k) else ()
        rows.append(row(Run(names.program("infer", K), (names.params(K),) + state + (a_in,) + side, (out,),
                            f"F s{K} mb{J}"), k, k + 1))
        if k < S - 1 and placement[k + 1] != r:
            rows.append(row(Send(out, 0, names.act_key(Q, J), transfers.act_pieces[k + 1]), k, k + 1, placement[k + 1]))
        evaluate += rows
        predict += rows
        if k == S - 1:
            evaluate.append(row(Run(names.program("loss", K), (out, names.targets(J)), (names.loss(J),),
                                    f"loss mb{J}"), k))
    every = np.arange(m, dtype=np.int32)
    head = []
    if io.weighted and placement[-1] == r:      # the step's total weight, before any loss
        head = [_Rows.block([row(_weight_total(m), S - 1)])]
    return (row.encoded(head + [_tiled([evaluate], np.zeros(m, np.int64), every)]),
            row.encoded([_tiled([predict], np.zeros(m, np.int64), every)]))


def _weight_total(m: int) -> Run:
    """The last stage's sum of a weighted loss's weights over the step's m microbatches (its
    row's stage field fills {k})."""
    return Run(names.program("weight", K), tuple(names.targets(j) for j in range(m)), (names.weight_sum(),),
               f"weight s{K}")


def _is_update(ins: Instruction) -> bool:
    """Part of the optimizer step: the update, the clipping norm and its exchange."""
    if isinstance(ins, Run):
        return names.parse_program(ins.program).kind in ("update", "sqnorm")
    if isinstance(ins, (Send, Recv)):
        return names.parse_key(ins.key).kind == "sqnorm_to"
    return False
