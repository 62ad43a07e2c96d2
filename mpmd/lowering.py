"""Lower pipeline + schedule into runtime programs and one instruction stream per slice.

Every buffer, transfer key and program is named through mpmd/names.py; which slice holds a
stage is the schedule's `placement`. A training stream is emitted task by task by
`_TrainStream`, one method per part of the step (forward, input gradient, weight
gradient, shared-weight exchange, clipping norm, update), so each part reads on its own.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from runtime.instructions import Instruction, Recv, Run, Send, Spec, with_deletes, with_recv_window
from mpmd import names, schedules, sharding, simulate, stage_programs
from mpmd.pipeline import Pipeline, shared_indices, shared_peers
from mpmd.specs import spec
from mpmd.task_arrays import KIND_CODES, as_arrays

SCALAR = (Spec((), "float32"),)


class Layout(NamedTuple):
    """Where everything lies: each slice's mesh, each stage's parameter and optimizer-state
    layouts (mpmd/sharding.py). `Layout.single(...)`: one device per slice, all replicated."""
    meshes: list                  # per slice: sharding.SliceMesh
    params: list                  # per stage: PartitionSpec per parameter leaf
    opt: list                     # per stage: PartitionSpec per optimizer-state leaf

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
    return Layout(list(meshes), params, opt)


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


class Lowered(NamedTuple):
    num_slices: int
    programs: list[dict]                   # per slice: name -> ProgramSpec
    train: list[list[Instruction]]         # per slice: the training step
    grads: list[list[Instruction]]         # per slice: forward + backward only, gradients kept
    eval: list[list[Instruction]]          # per slice: forward only, loss per microbatch
    predict: list[list[Instruction]]       # per slice: forward only, last stage's output kept
    init: list[list[Instruction]]          # per slice: optimizer-state creation
    fetch: dict[int, tuple[str, ...]]      # what the controller reads after a training step
    loss_fetch: dict[int, tuple[str, ...]]  # after a gradient or evaluation run: the losses


def recv_windows(schedule: schedules.Schedule, recv_window: int | None = None) -> tuple[int, ...]:
    """Per slice, how many receives may be outstanding at once (runtime.instructions
    with_recv_window): `recv_window` for every slice, or by default the slice's peak of live
    activations in the schedule (mpmd/simulate.py), so a slice never holds more received,
    not yet used bundles than the activations the schedule itself keeps alive there."""
    if recv_window is not None:
        return (recv_window,) * schedule.num_slices
    return tuple(max(1, n) for n in simulate.simulate(schedule).peak_live_activations)


def lower(pipe: Pipeline, schedule: schedules.Schedule, optimizer, max_grad_norm,
          micro_input_spec, micro_target_spec, layouts: Layout | None = None,
          recv_window: int | None = None) -> Lowered:
    """`recv_window`: receives outstanding at once per slice (see recv_windows)."""
    S, m, P = pipe.num_stages, schedule.num_microbatches, schedule.num_slices
    placement = schedule.placement
    layouts = layouts or Layout.single(pipe, optimizer, P)
    mesh_of = [layouts.meshes[placement[k]] for k in range(S)]     # stage -> its slice's mesh
    acts = pipe.activation_specs(micro_input_spec)          # acts[k] enters stage k
    loss_spec = jax.eval_shape(pipe.loss_fn, acts[-1], micro_target_spec)
    if jax.numpy.shape(loss_spec) != ():
        raise ValueError(f"loss_fn must return a scalar (the mean over the microbatch), got shape {loss_spec.shape}")
    clip = max_grad_norm is not None
    shared = pipe.shared
    param_specs = [tuple(sharding.with_layout(spec(a), lay, mesh_of[k])
                         for a, lay in zip(fn.param_leaves, layouts.params[k])) for k, fn in enumerate(pipe.fns)]

    progs: list[dict] = [{} for _ in range(P)]
    for k, fn in enumerate(pipe.fns):
        last, mesh = k == S - 1, mesh_of[k]
        scalar = sharding.with_layout(loss_spec, jax.sharding.PartitionSpec(), mesh)
        shapes = stage_programs.StageShapes(param_specs[k], _placed(acts[k], mesh),
                                            scalar if last else _placed(acts[k + 1], mesh),
                                            _placed(micro_target_spec, mesh) if last else None)
        here = progs[placement[k]]
        here.update(stage_programs.build(k, fn, shapes, first=k == 0, last=last, loss_fn=pipe.loss_fn,
                                         num_microbatches=m, split_backward=schedule.split_backward))
        here.update(stage_programs.build_forward_only(k, fn, shapes, last=last, loss_fn=pipe.loss_fn,
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
    transfers = Transfers([_laid_out(a, mesh_of[k]) if k < S else () for k, a in enumerate(acts)],
                          [_pieces(a, mesh_of[k - 1]) if 0 < k else ()
                           for k, a in enumerate(acts)],
                          [_laid_out(acts[k + 1], mesh_of[k]) for k in range(S)],
                          [_pieces(acts[k + 1], mesh_of[k + 1]) if k + 1 < S else ()
                           for k in range(S)])
    train = train_streams(schedule, transfers, clip, shared, shared_specs)
    evaluate, predict = _forward_only(schedule, transfers)

    fetch = {placement[-1]: tuple(names.loss(j) for j in range(m))}
    loss_fetch = dict(fetch)
    if clip:   # every slice receives every stage's squared norm; slice 0 reports them
        fetch[0] = fetch.get(0, ()) + tuple(names.sqnorm(k) for k in range(S))
    persistent = {names.params(k) for k in range(S)} | {names.opt_state(k) for k in range(S)}
    # The gradient plan is the training plan minus the optimizer: same programs, no update.
    no_update = [[i for i in s if not _is_update(i)] for s in train]
    all_grads = {names.grads(k) for k in range(S)}
    grads = [with_deletes(s, persistent | all_grads | set(fetch.get(r, ()))) for r, s in enumerate(no_update)]
    train = [with_deletes(s, persistent | set(fetch.get(r, ()))) for r, s in enumerate(train)]
    outputs = {names.output(j) for j in range(m)}
    evaluate = [with_deletes(s, persistent | set(fetch.get(r, ()))) for r, s in enumerate(evaluate)]
    predict = [with_deletes(s, persistent | outputs) for s in predict]
    init = [[Run(names.program("opt_init", k), (names.params(k),), (names.opt_state(k),), f"init s{k}")
             for k in schedule.stages_on(r)] for r in range(P)]
    # Last: the window's post marks are instruction indices, Deletes included.
    windows = recv_windows(schedule, recv_window)
    train, grads, evaluate, predict = ([with_recv_window(s, windows[r]) for r, s in enumerate(plans)]
                                       for plans in (train, grads, evaluate, predict))
    return Lowered(P, progs, train, grads, evaluate, predict, init, fetch, loss_fetch)


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
                  shared: list[list[tuple[int, int]]] = (), shared_specs: dict | None = None
                  ) -> list[list[Instruction]]:
    """One training step's instruction stream per slice, before Deletes are inserted: every
    slice's `train_stream`. For thousands of slices call `train_stream` slice by slice
    instead, so that only one slice's instructions exist at a time."""
    schedule = schedule._replace(slices=as_arrays(schedule.slices))   # converted once
    return [train_stream(schedule, r, transfers, clip, shared, shared_specs)
            for r in range(schedule.num_slices)]


def train_stream(schedule: schedules.Schedule, r: int, transfers: Transfers, clip: bool,
                 shared: list[list[tuple[int, int]]] = (), shared_specs: dict | None = None
                 ) -> list[Instruction]:
    """Slice r's instruction stream for one training step, before Deletes are inserted,
    read straight from the schedule's task arrays (no Task objects).

    `transfers` gives each receive's specs and each send's pieces (see Transfers; for plans
    without layouts, `Transfers.plain(act_specs)`). The streams name programs but do not
    need them, so a dry run can replay a schedule with synthetic programs of declared cost
    under the same names (mpmd/dryrun.py).

    `shared` groups (stage, leaf) pairs that are one parameter held by several stages (a tied
    embedding): once a stage's gradient is final it sends its shared leaves' gradients to
    the other holders, and before the update each holder sums every holder's part in stage
    order, so all copies get the same total gradient, bit for bit, and stay identical.
    """
    tasks = as_arrays(schedule.slices)
    a, b = int(tasks.offsets[r]), int(tasks.offsets[r + 1])
    stage, mb, kind = tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b]
    peers = shared_peers(schedule.num_stages, shared)
    out = _TrainStream(schedule, r, transfers, clip, peers, shared_specs or {}, stage, kind)
    forward, backward = KIND_CODES[schedules.FORWARD], KIND_CODES[schedules.BACKWARD]
    for k, j, code in zip(stage.tolist(), mb.tolist(), kind.tolist()):
        if code == forward:
            out.forward(k, j)
        elif code == backward and schedule.split_backward:
            out.input_grad(k, j)
        else:   # a full backward (B without split) or a weight gradient (W)
            out.weight_grad(k, j, input_grad_too=code == backward)
    out.sum_shared()
    out.receive_norms()
    out.update()
    return out.ops


class _TrainStream:
    """Emits one slice's training stream. Buffers are named by mpmd/names.py; a transfer is
    emitted only where producer and consumer sit on different slices."""

    def __init__(self, schedule: schedules.Schedule, r: int, transfers: Transfers, clip: bool, peers,
                 shared_specs, stage, kind):
        self.r, self.clip, self.peers, self.shared_specs = r, clip, peers, shared_specs
        self.t = transfers
        self.placement = schedule.placement
        self.num_stages, self.num_slices = schedule.num_stages, schedule.num_slices
        self.split = schedule.split_backward
        self.ops: list[Instruction] = []
        self.stages = schedule.stages_on(r)
        # Weight-gradient tasks left per stage; at 0 the stage's gradient is final.
        last = stage[kind == KIND_CODES[schedules.WEIGHT if self.split else schedules.BACKWARD]]
        self.remaining = {k: int(np.count_nonzero(last == k)) for k in self.stages}
        self.accumulating: set[int] = set()     # stages whose gradient buffer exists

    def _elsewhere(self, k: int) -> bool:
        return self.placement[k] != self.r

    # -- forward --------------------------------------------------------------------------
    def forward(self, k: int, j: int) -> None:
        first, last = k == 0, k == self.num_stages - 1
        a_in = names.inputs(j) if first else names.activation(k, j)
        if not first and self._elsewhere(k - 1):
            self.ops.append(Recv(a_in, self.placement[k - 1], names.act_key(k, j), self.t.acts_in[k],
                                 self.t.act_pieces[k]))
        out = names.loss(j) if last else names.activation(k + 1, j)
        targets = (names.targets(j),) if last else ()
        self.ops.append(Run(names.program("fwd", k), (names.params(k), a_in) + targets,
                            (out, names.residuals(k, j)), f"F s{k} mb{j}"))
        if not last and self._elsewhere(k + 1):
            self.ops.append(Send(out, self.placement[k + 1], names.act_key(k + 1, j), self.t.act_pieces[k + 1]))

    # -- backward -------------------------------------------------------------------------
    def _backward_inputs(self, k: int, j: int, receive: bool) -> tuple[str, ...]:
        """(params, residuals[, cotangent of the output]); receives the cotangent once, at
        the task that first needs it (B, not W)."""
        if k == self.num_stages - 1:    # the loss: its cotangent is the constant 1/m
            return names.params(k), names.residuals(k, j)
        d = names.cotangent(k, j)
        if receive and self._elsewhere(k + 1):
            self.ops.append(Recv(d, self.placement[k + 1], names.grad_key(k, j), self.t.cts_in[k], self.t.ct_pieces[k]))
        return names.params(k), names.residuals(k, j), d

    def _send_input_grad(self, k: int, j: int) -> None:
        if k > 0 and self._elsewhere(k - 1):
            self.ops.append(Send(names.cotangent(k - 1, j), self.placement[k - 1], names.grad_key(k - 1, j),
                                 self.t.ct_pieces[k - 1]))

    def input_grad(self, k: int, j: int) -> None:
        """Zero-bubble B: the input gradient, and what W needs of B's work, kept until W
        (none for the first stage: its input is data)."""
        base = self._backward_inputs(k, j, receive=True)
        if k > 0:
            self.ops.append(Run(names.program("bwd_in", k), base, (names.cotangent(k - 1, j), names.kept(k, j)),
                                f"B s{k} mb{j}"))
            self._send_input_grad(k, j)

    def weight_grad(self, k: int, j: int, input_grad_too: bool) -> None:
        """Accumulate stage k's weight gradient for microbatch j (W), or with input_grad_too
        the full backward (B of a schedule without split backward)."""
        base = self._backward_inputs(k, j, receive=input_grad_too)
        if self.split and k > 0:
            base += (names.kept(k, j),)
        g = names.grads(k)
        acc = (g,) if k in self.accumulating else ()
        kind = ("bwd_w_" if self.split else "bwd_") + ("acc" if acc else "first")
        dx = (names.cotangent(k - 1, j),) if input_grad_too and k > 0 else ()
        label = f"{'B' if input_grad_too else 'W'} s{k} mb{j}"
        self.ops.append(Run(names.program(kind, k), base + acc, dx + (g,), label))
        self.accumulating.add(k)
        if input_grad_too:
            self._send_input_grad(k, j)
        self.remaining[k] -= 1
        if self.remaining[k] == 0:
            self._gradient_final(k)

    def _gradient_final(self, k: int) -> None:
        if self.peers[k]:
            # Offer the shared part to the other holders; the norm waits for their parts.
            self.ops.append(Run(names.program("shared_out", k), (names.grads(k),), (names.shared(k),),
                                f"shared out s{k}"))
            self.ops.extend(Send(names.shared(k), self.placement[q], names.shared_key(k, q),
                                 self.shared_specs[(k, q)][1])
                            for q in self.peers[k] if self._elsewhere(q))
        elif self.clip:
            # Final, and nothing to add to it: start the norm exchange now so it overlaps
            # with the slice's remaining tasks.
            self._send_norm(k)

    # -- after the last task ------------------------------------------------------------------
    def sum_shared(self) -> None:
        """Each holder of a shared parameter sums every holder's part, in stage order."""
        for k in self.stages:
            if not self.peers[k]:
                continue
            for q in self.peers[k]:
                if self._elsewhere(q):   # a local peer's part is its own buffer: no transfer
                    self.ops.append(Recv(names.shared(q), self.placement[q], names.shared_key(q, k),
                                         *self.shared_specs[(q, k)]))
            parts = tuple(names.shared(q) for q in sorted(self.peers[k] + [k]))
            self.ops.append(Run(names.program("shared_in", k), (names.grads(k),) + parts, (names.grads(k),),
                                f"shared sum s{k}"))
            if self.clip:
                self._send_norm(k)

    def _send_norm(self, k: int) -> None:
        """Stage k's squared gradient norm, to every other slice (each computes the global norm)."""
        sq = names.sqnorm(k)
        self.ops.append(Run(names.program("sqnorm", k), (names.grads(k),), (sq,), f"norm s{k}"))
        self.ops.extend(Send(sq, q, names.sqnorm_key(k, q)) for q in range(self.num_slices) if q != self.r)

    def receive_norms(self) -> None:
        if self.clip:
            self.ops.extend(Recv(names.sqnorm(k), self.placement[k], names.sqnorm_key(k, self.r), SCALAR)
                            for k in range(self.num_stages) if self._elsewhere(k))

    def update(self) -> None:
        sq = tuple(names.sqnorm(i) for i in range(self.num_stages)) if self.clip else ()
        for k in self.stages:
            state = (names.params(k), names.opt_state(k))
            self.ops.append(Run(names.program("update", k), state + (names.grads(k),) + sq, state, f"U s{k}"))


def _forward_only(schedule: schedules.Schedule, transfers: Transfers):
    """Evaluation and prediction plans, every slice's `forward_only_stream`."""
    plans = [forward_only_stream(schedule, r, transfers) for r in range(schedule.num_slices)]
    return [e for e, _ in plans], [p for _, p in plans]


def forward_only_stream(schedule: schedules.Schedule, r: int, transfers: Transfers):
    """Slice r's evaluation and prediction streams: F tasks only, in (microbatch, stage) order.

    Every dependency F(k-1, j) -> F(k, j) goes forward in that one global order, so no slice
    can wait on a task that waits on it: deadlock-free for any placement.
    """
    S, placement = schedule.num_stages, schedule.placement
    evaluate: list[Instruction] = []
    predict: list[Instruction] = []
    mine = schedule.stages_on(r)
    for j in range(schedule.num_microbatches):
        for k in mine:
            a_in = names.inputs(j) if k == 0 else names.activation(k, j)
            out = names.output(j) if k == S - 1 else names.activation(k + 1, j)
            ops: list[Instruction] = []
            if k > 0 and placement[k - 1] != r:
                ops.append(Recv(a_in, placement[k - 1], names.act_key(k, j), transfers.acts_in[k],
                                transfers.act_pieces[k]))
            ops.append(Run(names.program("infer", k), (names.params(k), a_in), (out,), f"F s{k} mb{j}"))
            if k < S - 1 and placement[k + 1] != r:
                ops.append(Send(out, placement[k + 1], names.act_key(k + 1, j), transfers.act_pieces[k + 1]))
            evaluate += ops
            predict += ops
            if k == S - 1:
                evaluate.append(Run(names.program("loss", k), (out, names.targets(j)), (names.loss(j),),
                                    f"loss mb{j}"))
    return evaluate, predict


def _is_update(ins: Instruction) -> bool:
    """Part of the optimizer step: the update, the clipping norm and its exchange."""
    if isinstance(ins, Run):
        return names.parse_program(ins.program).kind in ("update", "sqnorm")
    if isinstance(ins, (Send, Recv)):
        return names.parse_key(ins.key).kind == "sqnorm_to"
    return False
