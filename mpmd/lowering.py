"""Lower pipeline + schedule into runtime programs and one instruction stream per slice.

Buffer names on a slice (k = stage, j = microbatch):
  p{k} o{k}   parameters and optimizer state (persistent)     g{k}  accumulated gradients
  x/{j}       microbatch input (fed to stage 0's slice)        t/{j} targets (last stage's slice)
  a{k}/{j}    activation entering stage k                      r{k}/{j} stage k's residuals
  d{k}/{j}    cotangent of stage k's output                    loss/{j} last stage's loss
  sq{k}       squared norm of stage k's gradients (only when clipping)
Transfer keys name the value ("act{k}/{j}", "grad{k}/{j}"; "sq{k}/to{q}" for the norm sent to
every slice, since a key is consumed by one receive), so
sender and receiver derive the same key from the plan; the executor prefixes the step.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from runtime.instructions import Instruction, Recv, Run, Send, Spec, with_deletes
from mpmd import schedules, stage_programs
from mpmd.pipeline import Pipeline, shared_indices, shared_peers


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
    param_home: list[int]                  # slice of each stage
    opt_specs: list[tuple]                 # per stage


def _specs(tree) -> tuple[Spec, ...]:
    return tuple(Spec(tuple(l.shape), jax.numpy.dtype(l.dtype).name) for l in jax.tree.leaves(tree))


def lower(pipe: Pipeline, schedule: schedules.Schedule, optimizer, max_grad_norm,
          micro_input_spec, micro_target_spec) -> Lowered:
    S = pipe.num_stages
    m = schedule.num_microbatches
    P = len(schedule.slices)
    home = [schedules.slice_of(k, P) for k in range(S)]
    acts = pipe.activation_specs(micro_input_spec)          # acts[k] enters stage k
    loss_spec = jax.eval_shape(pipe.loss_fn, acts[-1], micro_target_spec)
    if jax.numpy.shape(loss_spec) != ():
        raise ValueError(f"loss_fn must return a scalar (the mean over the microbatch), got shape {loss_spec.shape}")
    clip = max_grad_norm is not None

    progs: list[dict] = [{} for _ in range(P)]
    opt_specs = []
    for k, fn in enumerate(pipe.fns):
        last = k == S - 1
        param_specs = tuple(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), fn.param_leaves))
        shapes = stage_programs.StageShapes(param_specs, acts[k], loss_spec if last else acts[k + 1],
                                            micro_target_spec if last else None)
        built = stage_programs.build(k, fn, shapes, first=k == 0, last=last, loss_fn=pipe.loss_fn,
                                     num_microbatches=m, split_backward=schedule.split_backward)
        not_counted = [i for g in getattr(pipe, "shared", []) for s, i in g if s == k and s != min(t for t, _ in g)]
        opt, o_specs = stage_programs.build_optimizer(k, fn, param_specs, optimizer, S, max_grad_norm, not_counted)
        progs[home[k]].update(built.specs)
        progs[home[k]].update(stage_programs.build_forward_only(k, fn, shapes, last=last, loss_fn=pipe.loss_fn))
        progs[home[k]].update(opt)
        opt_specs.append(o_specs)

    act_specs = [_specs(a) for a in acts]
    shared = getattr(pipe, "shared", [])
    param_specs = [tuple(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), fn.param_leaves))
                   for fn in pipe.fns]
    shared_specs = {}
    for k, idx in enumerate(shared_indices(S, shared)):
        if idx:
            shared_specs[k] = tuple(Spec(tuple(param_specs[k][i].shape), jax.numpy.dtype(param_specs[k][i].dtype).name)
                                    for i in idx)
            progs[home[k]].update(stage_programs.build_shared(k, param_specs, shared))
    train = train_streams(schedule, act_specs, clip, shared, shared_specs)
    evaluate, predict = _forward_only(S, m, P, home, act_specs)
    fetch = {home[S - 1]: tuple(f"loss/{j}" for j in range(m))}
    loss_fetch = dict(fetch)
    if clip:
        fetch[0] = fetch.get(0, ()) + tuple(f"sq{k}" for k in range(S))
    persistent = {f"p{k}" for k in range(S)} | {f"o{k}" for k in range(S)}
    # The gradient plan is the training plan minus the optimizer: same programs, no update.
    no_update = [[i for i in s if not (isinstance(i, (Run, Send, Recv)) and _is_update(i))] for s in train]
    grads = [with_deletes(s, persistent | {f"g{k}" for k in range(S)} | set(fetch.get(r, ())))
             for r, s in enumerate(no_update)]
    train = [with_deletes(s, persistent | set(fetch.get(r, ()))) for r, s in enumerate(train)]
    outputs = {f"out/{j}" for j in range(m)}
    evaluate = [with_deletes(s, persistent | set(fetch.get(r, ()))) for r, s in enumerate(evaluate)]
    predict = [with_deletes(s, persistent | outputs) for s in predict]
    init = [[Run(f"opt_init{k}", (f"p{k}",), (f"o{k}",), f"init s{k}") for k in range(S) if home[k] == r]
            for r in range(P)]
    return Lowered(P, progs, train, grads, evaluate, predict, init, fetch, loss_fetch, home, opt_specs)


def train_streams(schedule: schedules.Schedule, act_specs: list[tuple[Spec, ...]], clip: bool,
                  shared: list[list[tuple[int, int]]] = (), shared_specs: dict | None = None
                  ) -> list[list[Instruction]]:
    """One training step's instruction stream per slice, before Deletes are inserted.

    `act_specs[k]` is the bundle entering stage k (k = num_stages: the last output). The
    streams name programs but do not need them, so a dry run can replay a schedule with
    synthetic programs of declared cost under the same names (mpmd/dryrun.py).

    `shared` groups (stage, leaf) pairs that are one parameter held by several stages (a tied
    embedding): once a stage's gradient is final it sends its shared leaves' gradients to
    the other holders, and before the update each holder sums every holder's part in stage
    order, so all copies get the same total gradient, bit for bit, and stay identical.
    """
    S, P = schedule.num_stages, len(schedule.slices)
    home = [schedules.slice_of(k, P) for k in range(S)]
    peers = shared_peers(S, shared)
    scalar = (Spec((), "float32"),)
    train: list[list[Instruction]] = []
    for r, tasks in enumerate(schedule.slices):
        s: list[Instruction] = []
        grads_started: set[int] = set()
        # (a local peer's part is its own buffer sh{q}: no transfer)
        remaining = {k: sum(1 for t in tasks if t.stage == k and t.kind == ("W" if schedule.split_backward else "B"))
                     for k in range(S) if home[k] == r}
        for t in tasks:
            k, j = t.stage, t.microbatch
            first, last = k == 0, k == S - 1
            if t.kind == "F":
                a_in = "x/" + str(j) if first else f"a{k}/{j}"
                if not first and home[k - 1] != r:
                    s.append(Recv(a_in, home[k - 1], f"act{k}/{j}", act_specs[k]))
                out = f"loss/{j}" if last else f"a{k + 1}/{j}"
                s.append(Run(f"fwd{k}", (f"p{k}", a_in) + ((f"t/{j}",) if last else ()),
                             (out, f"r{k}/{j}"), f"F s{k} mb{j}"))
                if not last and home[k + 1] != r:
                    s.append(Send(out, home[k + 1], f"act{k + 1}/{j}"))
                continue
            g_in: tuple[str, ...] = ()
            if not last:
                g_in = (f"d{k}/{j}",)
                if home[k + 1] != r and t.kind == "B":
                    s.append(Recv(g_in[0], home[k + 1], f"grad{k}/{j}", act_specs[k + 1]))
            base = (f"p{k}", f"r{k}/{j}") + g_in
            if t.kind == "B" and schedule.split_backward:
                if not first:
                    s.append(Run(f"bwd_in{k}", base, (f"d{k - 1}/{j}",), f"B s{k} mb{j}"))
                    _send_grad(s, k, j, home, r)
                continue
            acc = (f"g{k}",) if k in grads_started else ()
            variant = ("bwd_w_" if schedule.split_backward else "bwd_") + ("acc" if acc else "first")
            outs = ((f"d{k - 1}/{j}",) if not first and t.kind == "B" else ()) + (f"g{k}",)
            s.append(Run(f"{variant}{k}", base + acc, outs, f"{t.kind} s{k} mb{j}"))
            grads_started.add(k)
            if t.kind == "B":
                _send_grad(s, k, j, home, r)
            remaining[k] -= 1
            if remaining[k] == 0 and peers[k]:
                # This stage's gradient is final: offer its shared part to the other holders.
                s.append(Run(f"shared_out{k}", (f"g{k}",), (f"sh{k}",), f"shared out s{k}"))
                s.extend(Send(f"sh{k}", home[q], f"sh{k}/to{q}") for q in peers[k] if home[q] != r)
            if remaining[k] == 0 and clip and not peers[k]:
                # Final, and nothing to add to it: start the norm exchange now so it overlaps
                # with the slice's remaining tasks.
                s.append(Run(f"sqnorm{k}", (f"g{k}",), (f"sq{k}",), f"norm s{k}"))
                s.extend(Send(f"sq{k}", q, f"sq{k}/to{q}") for q in range(P) if q != r)
        for k in range(S):
            if home[k] == r and peers[k]:
                for q in peers[k]:
                    if home[q] != r:
                        s.append(Recv(f"sh{q}", home[q], f"sh{q}/to{k}", shared_specs[q]))
                parts = tuple(f"sh{q}" for q in sorted(peers[k] + [k]))
                s.append(Run(f"shared_in{k}", (f"g{k}",) + parts, (f"g{k}",), f"shared sum s{k}"))
                if clip:
                    s.append(Run(f"sqnorm{k}", (f"g{k}",), (f"sq{k}",), f"norm s{k}"))
                    s.extend(Send(f"sq{k}", q, f"sq{k}/to{q}") for q in range(P) if q != r)
        for k in range(S):
            if clip and home[k] != r:
                s.append(Recv(f"sq{k}", home[k], f"sq{k}/to{r}", scalar))
        for k in range(S):
            if home[k] == r:
                sq = tuple(f"sq{i}" for i in range(S)) if clip else ()
                s.append(Run(f"update{k}", (f"p{k}", f"o{k}", f"g{k}") + sq, (f"p{k}", f"o{k}"), f"U s{k}"))
        train.append(s)

    return train


def _forward_only(S, m, P, home, act_specs):
    """Evaluation and prediction plans: F tasks only, each slice in (microbatch, stage) order.

    Every dependency F(k-1, j) -> F(k, j) goes forward in that one global order, so no slice
    can wait on a task that waits on it: deadlock-free for any placement.
    """
    evaluate: list[list[Instruction]] = [[] for _ in range(P)]
    predict: list[list[Instruction]] = [[] for _ in range(P)]
    for j in range(m):
        for k in range(S):
            r = home[k]
            a_in = f"x/{j}" if k == 0 else f"a{k}/{j}"
            out = f"out/{j}" if k == S - 1 else f"a{k + 1}/{j}"
            ops: list[Instruction] = []
            if k > 0 and home[k - 1] != r:
                ops.append(Recv(a_in, home[k - 1], f"act{k}/{j}", act_specs[k]))
            ops.append(Run(f"infer{k}", (f"p{k}", a_in), (out,), f"F s{k} mb{j}"))
            if k < S - 1 and home[k + 1] != r:
                ops.append(Send(out, home[k + 1], f"act{k + 1}/{j}"))
            evaluate[r] += ops
            predict[r] += ops
            if k == S - 1:
                evaluate[r].append(Run(f"loss{k}", (out, f"t/{j}"), (f"loss/{j}",), f"loss mb{j}"))
    return evaluate, predict


def _is_update(ins) -> bool:
    if isinstance(ins, Run):
        return ins.program.startswith(("update", "sqnorm"))
    return ins.key.startswith("sq")


def _send_grad(s: list, k: int, j: int, home: list[int], r: int) -> None:
    if k > 0 and home[k - 1] != r:
        s.append(Send(f"d{k - 1}/{j}", home[k - 1], f"grad{k - 1}/{j}"))
