"""The programs one stage runs, traced on the controller and exported with `jax.export`.

Forward returns the activation and the vjp residuals; the backward programs rebuild the vjp
from those residuals, so nothing is recomputed. Residuals that are the stage's own
parameters are not stored per microbatch: the backward programs take the parameter bundle
and put them back in place (a stage would otherwise keep one copy of its weights per
microbatch in flight).

Backward comes in three forms:
- "full"  (GPipe, 1F1B): input gradient and weight gradient together;
- "input" (zero-bubble B): the input gradient, plus "kept": the values it computed on the
  way that the weight gradient also needs (the cotangent at each weight's use);
- "weight" (zero-bubble W): the weight gradient from the residuals, the cotangent and B's
  kept values, doing only the work B did not (mpmd/stages/backward_split.py cuts the backward's
  jaxpr), so B + W costs one full backward. The first stage has no B (its input is data):
  its W is the whole weight-gradient computation.
Weight gradients are accumulated into the stage's gradient bundle; the first microbatch
to arrive creates it ("first"), so no zero-fill program is needed.

The pipelined loss is the mean of the m microbatch losses, equal to the unpipelined
mean over the batch for equal microbatches; hence the last stage's cotangent is 1/m. A
weighted loss (`loss_fn` returns (loss_sum, weight)) is sum(loss_sum) / sum(weight) over the
step: its total weight is computed first from the batch (weight{k}) and the last stage's
cotangent is 1/total. Auxiliary losses a stage adds (mpmd.add_loss) are a second output of
its forward, with cotangent 1/m. Only floating-point values crossing a cut carry cotangents
back: integer and boolean leaves go forward only.

Gradients kept unreduced (mpmd/stages/partials.py). On a slice that splits the microbatch N
ways, a stage that allows it (`partials.problem`) is traced per batch group instead: its
forward and backward are vmapped over N groups of B/N rows, its weight gradients and their
accumulator are partials (N, *shape) made with no communication, and reduce{k} sums them
once, after the stage's last gradient task. The last stage's loss is applied to the joined
output, as unpipelined.

Layouts. Every spec handed in carries its sharding on the slice's AbstractMesh (see
mpmd/stages/sharding.py); each program returns its outputs in the layouts of what they are:
gradients like their parameters, input gradients like the stage's input, scalars
replicated. Residuals and kept values are left to XLA: they never leave the slice.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpmd.runtime.worker import programs
from mpmd.stages import backward_split, losses
from mpmd.stages import names, partials
from mpmd.stages.specs import spec
from mpmd.stages.pipeline import StageFn, shared_indices, shared_peers


class StageShapes(NamedTuple):
    params: tuple  # ShapeDtypeStructs of the parameter leaves
    x: Any  # pytree of ShapeDtypeStructs entering the stage (one microbatch)
    y: Any  # pytree leaving it (or the loss, for the last stage)
    targets: Any  # what the loss reads of the batch, last stage only (else None)
    side: Any = None  # {batch key: spec} of the stage's side inputs (None: none)
    weighted: bool = False  # last stage: the loss returns (loss_sum, weight)
    aux: bool = False  # the stage adds auxiliary losses (mpmd.add_loss)
    state: tuple | None = None  # specs of its carried state leaves (StageState), or None


def _bundle(tree) -> tuple:
    return tuple(jax.tree.leaves(tree))


def _layouts(tree) -> tuple:
    """The shardings of a pytree of specs, as a bundle (what out_shardings takes)."""
    return tuple(s.sharding for s in jax.tree.leaves(tree))


def _replicated(specs) -> jax.sharding.NamedSharding:
    """Replicated on the mesh the given specs lie on (for scalars); None (left to XLA) for
    unplaced specs (costs.measure prices programs before any layout exists)."""
    mesh = next((s.sharding.mesh for s in jax.tree.leaves(specs) if s.sharding is not None), None)
    return None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _unplaced(tree):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), tree)


def differentiable(leaf) -> bool:
    """Whether a value crossing a cut carries a cotangent back: floating point only. Integer
    and boolean leaves (positions, masks, token ids) go forward as values and nothing returns."""
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


def _diff_only(leaves) -> tuple:
    return tuple(l for l in leaves if differentiable(l))


def call_stage(fn: StageFn, p, x, side, state=None):
    """(output, the sum of the auxiliary losses it added or None, its new state leaves): the
    stage applied, from `state` when it has state (else its state is ())."""
    with losses.collect_losses() as added:
        if fn.state is not None:
            out, new = fn.state.step(p, state, x, **side)
        else:
            out, new = (fn.apply(p, x, **side) if side else fn.apply(p, x)), ()
    return out, losses.total(added), new


def adds_losses(fn: StageFn, params, x, side) -> bool:
    """Whether the stage calls mpmd.add_loss (traced only)."""
    found = []
    state = jax.tree.map(spec, fn.state.leaves) if fn.state is not None else None

    def probe(p, x, s, st):
        out, aux, _ = call_stage(fn, p, x, s, st)
        found.append(aux is not None)
        return out

    jax.eval_shape(probe, _unplaced(params), _unplaced(x), _unplaced(side or {}), state)
    return found[0]


def _forward(fn: StageFn, shapes: StageShapes, first: bool, last: bool, loss_fn: Callable | None):
    """(forward, layout): forward(params, xb[, sb][, tb]) -> (output bundle, stored residuals
    [, aux loss]), and the dict it fills when traced with how to rebuild the vjp from params
    and residuals. What is differentiated is the stage's output (the loss, or a weighted
    loss's sum, on the last stage), paired with its auxiliary losses' sum when it adds some."""
    x_tree = jax.tree.structure(shapes.x)
    s_tree = jax.tree.structure(shapes.side) if shapes.side else None
    t_tree = jax.tree.structure(shapes.targets) if last else None

    def objective(p, x, s, t, st):
        out, aux, new_state = call_stage(fn, p, x, s, st)
        if last:
            out = loss_fn(out, t)
            out = out[0] if shapes.weighted else out
        return ((out, aux) if shapes.aux else out), new_state

    def vjp_of(p, x, s, t, st):
        # The first stage's input is data (often integer tokens): no gradient flows into it.
        # The stage's new state is a result, not differentiated.
        if first:
            return jax.vjp(lambda p: objective(p, x, s, t, st), p, has_aux=True)
        return jax.vjp(lambda p, x: objective(p, x, s, t, st), p, x, has_aux=True)

    layout: dict[str, Any] = {}

    def forward(params, *rest):
        p = tuple(params)
        st, rest = (tuple(rest[0]), rest[1:]) if shapes.state is not None else (None, rest)
        xb, rest = rest[0], rest[1:]
        x = jax.tree.unflatten(x_tree, list(xb))
        s = jax.tree.unflatten(s_tree, list(rest[0])) if s_tree is not None else {}
        t = jax.tree.unflatten(t_tree, list(rest[-1])) if last else None
        out, vjp, new_state = vjp_of(p, x, s, t, st)
        stored = _residuals(vjp, p, layout)
        kept_state = (tuple(new_state),) if shapes.state is not None else ()
        if shapes.aux:
            out, aux = out
            return (_bundle(out), tuple(stored), *kept_state, (aux,))
        return (_bundle(out), tuple(stored), *kept_state)

    return forward, layout


def _residuals(vjp, p: tuple, layout: dict) -> list:
    """What of a vjp's residuals the forward stores: all but the parameters `p`, which the
    backward puts back; records in `layout` how to rebuild the vjp (slot j of its residual
    list: ("p", i) = parameter i, ("r", n) = stored residual n)."""
    leaves, vjp_tree = jax.tree.flatten(vjp)
    where = {id(a): i for i, a in enumerate(p)}
    slots, stored = [], []
    for leaf in leaves:
        if id(leaf) in where:
            slots.append(("p", where[id(leaf)]))
        else:
            slots.append(("r", len(stored)))
            stored.append(leaf)
    layout.update(vjp_tree=vjp_tree, slots=slots)
    return stored


def _rebuilt(layout: dict, params, res):
    """The vjp from its stored residuals and the parameters (see _residuals)."""
    return jax.tree.unflatten(layout["vjp_tree"], [params[i] if kind == "p" else res[i] for kind, i in layout["slots"]])


def _last_cotangent(shapes: StageShapes, gb, num_microbatches: int):
    """The loss's cotangent: a mean loss's is 1/m (the pipelined loss is the mean of m
    microbatch losses); a weighted loss's sum's is 1/(total weight of the step)."""
    return (
        (1.0 / gb[0]).astype(shapes.y.dtype) if shapes.weighted else jnp.asarray(1.0 / num_microbatches, shapes.y.dtype)
    )


def _cotangent_tree(y_leaves, y_tree, given):
    """The output's cotangent pytree: the given leaves where the output is differentiable,
    float0 zeros where it is not."""
    given = iter(given)
    return jax.tree.unflatten(
        y_tree, [next(given) if differentiable(l) else np.zeros(l.shape, jax.dtypes.float0) for l in y_leaves]
    )


def _grouped(
    fn: StageFn, shapes: StageShapes, first: bool, last: bool, loss_fn: Callable | None, num_microbatches: int, mesh
):
    """_backward's (forward, residual specs, cotangents) for a stage vmapped over the batch
    groups of `mesh` (mpmd/stages/partials.py): the forward stores each group's residuals
    (n, ...) and, on the last stage, the loss's, the loss applied to the groups' joined
    output; the weight gradients cotangents returns are partials (n, *shape), one per group."""
    n = mesh.batch_ways
    x_tree = jax.tree.structure(shapes.x)
    s_tree = jax.tree.structure(shapes.side) if shapes.side else None
    t_tree = jax.tree.structure(shapes.targets) if last else None
    x_diff = [differentiable(l) for l in jax.tree.leaves(shapes.x)]
    layout: dict[str, Any] = {}

    def forward(params, xb, *rest):
        p = tuple(params)
        x = jax.tree.unflatten(x_tree, list(xb))
        s = jax.tree.unflatten(s_tree, list(rest[0])) if s_tree is not None else {}

        def group(xg, sg):
            apply = (lambda p: call_stage(fn, p, xg, sg)[0]) if first else (lambda p, x: call_stage(fn, p, x, sg)[0])
            y, vjp = jax.vjp(apply, p) if first else jax.vjp(apply, p, xg)
            layout["y"] = jax.tree.map(spec, y)
            return y, tuple(_residuals(vjp, p, layout))

        y, stored = jax.vmap(group)(partials.split(x, n), partials.split(s, n))
        y, stored = partials.join(y), partials.per_device(stored, mesh, shapes.params)
        layout["num_group_res"] = len(stored)
        if not last:
            return _bundle(y), stored
        t = jax.tree.unflatten(t_tree, list(rest[-1]))
        loss, loss_vjp = jax.vjp(lambda y: (lambda v: v[0] if shapes.weighted else v)(loss_fn(y, t)), y)
        leaves, layout["loss_tree"] = jax.tree.flatten(loss_vjp)
        return (loss,), stored + tuple(leaves)

    res_specs = _unplaced(jax.eval_shape(forward, *_forward_args(shapes, last))[1])
    y_leaves, y_tree = jax.tree.flatten(layout["y"])  # one group's output

    def cotangents(params, res, gb):
        group_res, loss_res = res[: layout["num_group_res"]], res[layout["num_group_res"] :]
        if last:
            (dy,) = jax.tree.unflatten(layout["loss_tree"], list(loss_res))(
                _last_cotangent(shapes, gb, num_microbatches)
            )
            gb = tuple(d for d, l in zip(jax.tree.leaves(dy), y_leaves) if differentiable(l))

        def group(res_g, given):
            dp, *dx = _rebuilt(layout, params, res_g)(_cotangent_tree(y_leaves, y_tree, given))
            return tuple(dp), (() if first else tuple(d for d, keep in zip(jax.tree.leaves(dx[0]), x_diff) if keep))

        dp, dx = jax.vmap(group)(tuple(group_res), partials.split(tuple(gb), n))
        return dp, (None if first else partials.join(dx))

    return forward, res_specs, cotangents


def _forward_args(shapes: StageShapes, last: bool) -> tuple:
    return (
        shapes.params,
        *((shapes.state,) if shapes.state is not None else ()),
        _bundle(shapes.x),
        *((_bundle(shapes.side),) if shapes.side else ()),
        *((_bundle(shapes.targets),) if last else ()),
    )


def _backward(
    fn: StageFn, shapes: StageShapes, first: bool, last: bool, loss_fn: Callable | None, num_microbatches: int
):
    """(forward, residual specs, cotangents): cotangents(params, res, g) -> (param grads, input
    grad bundle or None) rebuilds the vjp from the forward's residuals, so nothing is
    recomputed. `g` is the output's cotangent bundle (its differentiable leaves); on the last
    stage, a weighted loss's total weight (else nothing)."""
    y_leaves, y_tree = jax.tree.flatten(shapes.y)
    forward, layout = _forward(fn, shapes, first, last, loss_fn)
    res_specs = _unplaced(jax.eval_shape(forward, *_forward_args(shapes, last))[1])
    x_diff = [differentiable(l) for l in jax.tree.leaves(shapes.x)]

    def cotangents(params, res, gb):
        vjp = _rebuilt(layout, params, res)
        ct = _last_cotangent(shapes, gb, num_microbatches) if last else _cotangent_tree(y_leaves, y_tree, gb)
        if shapes.aux:  # each microbatch's auxiliary losses weigh 1/m in the objective
            ct = (ct, jnp.asarray(1.0 / num_microbatches, jnp.float32))
        dp, *dx = vjp(ct)
        if first:
            return dp, None
        return dp, tuple(d for d, keep in zip(jax.tree.leaves(dx[0]), x_diff) if keep)

    return forward, res_specs, cotangents


def _split(cotangents, param_specs: tuple, res_specs: tuple, g_args: tuple) -> backward_split.Split:
    """The backward cut into B (input gradient + what W needs of its work) and W."""
    n_p, n_r = len(param_specs), len(res_specs)

    def flat(*a):
        dp, dx = cotangents(a[:n_p], a[n_p : n_p + n_r], a[n_p + n_r :])
        return tuple(dp) + (dx or ())

    return backward_split.split(flat, (*param_specs, *res_specs, *_bundle(g_args)), n_p)


def _g_args(shapes: StageShapes, last: bool) -> tuple:
    """The backward's cotangent argument: the output's differentiable leaves; for the last
    stage none (a mean loss's cotangent is 1/m), or a weighted loss's total weight."""
    if last:
        return ((_scalar_like(shapes.y),),) if shapes.weighted else ()
    return (_diff_only(jax.tree.leaves(shapes.y)),)


def _scalar_like(spec) -> jax.ShapeDtypeStruct:
    """A float32 scalar replicated where `spec` lies."""
    return jax.ShapeDtypeStruct((), jnp.float32, sharding=getattr(spec, "sharding", None))


def saved_specs(
    fn: StageFn, shapes: StageShapes, *, first: bool, last: bool, loss_fn: Callable | None, split_backward: bool = True
) -> tuple[tuple, tuple]:
    """ShapeDtypeStructs, per microbatch, of (residuals, kept), traced only (nothing is
    allocated): what stage k's forward stores for its backward (its vjp residuals minus its
    own parameters: the saved activations rematerialisation trades for recomputation), and
    what its B keeps for its W in a split-backward schedule (mpmd/stages/backward_split.py),
    held from B until W runs. `kept` is empty for the first stage (its B does nothing) and
    unless `split_backward` (finding it out traces the backward too)."""
    _, res_specs, cotangents = _backward(fn, shapes, first, last, loss_fn, 1)
    if first or not split_backward:
        return res_specs, ()
    return res_specs, _split(cotangents, shapes.params, res_specs, _g_args(shapes, last)).kept


def build(
    k: int,
    fn: StageFn,
    shapes: StageShapes,
    *,
    first: bool,
    last: bool,
    loss_fn: Callable | None,
    num_microbatches: int,
    split_backward: bool,
    partial=None,
    grad_specs: tuple | None = None,
    kinds: frozenset | None = None,
) -> dict:
    """Export forward and backward programs for stage k, named by mpmd/stages/names.py.
    `partial`: the slice's SliceMesh when the stage keeps its gradients unreduced over the
    batch axes (mpmd/stages/partials.py; then build_reduce gives reduce{k}), else None.
    `grad_specs`: the parameters as the gradients lie, where the programs take them in
    another layout (gathered over fsdp once a step: mpmd/stages/gather.py); default shapes.params.
    `kinds`: export only programs of these kinds ("fwd", "bwd_in", ...; None: all), as the
    cost model prices a few of them."""
    grad_specs = shapes.params if grad_specs is None else grad_specs
    if partial is None:
        forward, res_specs, cotangents = _backward(fn, shapes, first, last, loss_fn, num_microbatches)
    else:
        forward, res_specs, cotangents = _grouped(fn, shapes, first, last, loss_fn, num_microbatches, partial)
        grad_specs = partials.partial_specs(grad_specs, partial)
    fwd_args = _forward_args(shapes, last)
    p_out, y_out = _layouts(grad_specs), _layouts(shapes.y)
    x_out = tuple(l.sharding for l in jax.tree.leaves(shapes.x) if differentiable(l))
    aux_out = ((_replicated((shapes.params, shapes.x)),),) if shapes.aux else ()
    state_out = (_layouts(shapes.state),) if shapes.state is not None else ()
    specs = {}

    def export(kind: str, f, *args, out_shardings) -> None:
        if kinds is None or kind in kinds:
            specs[names.program(kind, k)] = programs.exported(f, *args, out_shardings=out_shardings)

    export("fwd", forward, *fwd_args, out_shardings=(y_out, None, *state_out, *aux_out))
    g_args = _g_args(shapes, last)

    def accumulated(dp, acc):
        return tuple(a + d for a, d in zip(acc[0], dp)) if acc else tuple(dp)

    def full_grad(params, res, *rest):
        n = len(g_args)
        g, acc = (rest[0] if n else ()), rest[n:]
        dp, dx = cotangents(params, res, g)
        return ((dx,) if not first else ()) + (accumulated(dp, acc),)

    base = (shapes.params, res_specs, *g_args)
    acc = (grad_specs,)
    full_out = ((x_out,) if not first else ()) + (p_out,)
    if not split_backward:
        export("bwd_first", full_grad, *base, out_shardings=full_out)
        export("bwd_acc", full_grad, *base, *acc, out_shardings=full_out)
        return specs

    parts = _split(cotangents, shapes.params, res_specs, g_args)
    kept = (parts.kept,) if not first else ()  # the first stage has no B: W does it all

    def input_grad(params, res, *g):
        out = parts.input_grad(*params, *res, *(g[0] if g else ()))
        return out[: parts.num_input_grads], out[parts.num_input_grads :]

    def weight_grad(params, res, *rest):
        n = len(g_args)
        g, rest = (rest[0] if n else ()), rest[n:]
        mine, acc = (rest[0], rest[1:]) if not first else ((), rest)
        return (accumulated(parts.weight_grad(*params, *res, *g, *mine), acc),)

    if not first:
        export("bwd_in", input_grad, *base, out_shardings=(x_out, None))
    export("bwd_w_first", weight_grad, *base, *kept, out_shardings=(p_out,))
    export("bwd_w_acc", weight_grad, *base, *kept, *acc, out_shardings=(p_out,))
    return specs


def build_reduce(k: int, param_specs: tuple, mesh) -> dict:
    """reduce{k}: stage k's gradients from their partials (mpmd/stages/partials.py), summed over
    the batch groups into the parameters' layouts: XLA's one all-reduce over data (reduce-
    scatter over fsdp) per step, over a buffer per dtype and layout (partials.pack_key)."""
    layouts = [s.sharding.spec for s in param_specs]

    def reduce(grads):
        return (partials.reduced(grads, layouts, mesh),)

    return {
        names.program("reduce", k): programs.exported(
            reduce, partials.partial_specs(param_specs, mesh), out_shardings=(_layouts(param_specs),)
        )
    }


def build_forward_only(
    k: int, fn: StageFn, shapes: StageShapes, *, last: bool, loss_fn: Callable, y_specs=None
) -> dict:
    """Forward without residuals (evaluation, sampling): infer{k}, and loss{k} on the last stage
    (a weighted loss's sum). Auxiliary losses are not part of an evaluation's loss.
    `y_specs`: the stage output's specs with their layouts (for the last stage, the model's
    output, which shapes.y, the loss, does not describe)."""
    x_tree = jax.tree.structure(shapes.x)
    s_tree = jax.tree.structure(shapes.side) if shapes.side else None

    def infer(params, *rest):
        st, rest = (tuple(rest[0]), rest[1:]) if shapes.state is not None else (None, rest)
        x = jax.tree.unflatten(x_tree, list(rest[0]))
        s = jax.tree.unflatten(s_tree, list(rest[1])) if len(rest) > 1 else {}
        if fn.state is not None:  # eval mode: no dropout, running statistics; nothing kept
            return (_bundle(fn.state.evaluate(tuple(params), st, x, **s)),)
        return (_bundle(call_stage(fn, tuple(params), x, s)[0]),)

    # The output keeps the stage input's batch layout; a last stage's output (logits) is laid
    # out like an activation of its shape would be.
    y_out = _layouts(y_specs) if y_specs is not None else None
    side_args = (_bundle(shapes.side),) if shapes.side else ()
    state_args = (shapes.state,) if shapes.state is not None else ()
    specs = {
        names.program("infer", k): programs.exported(
            infer, shapes.params, *state_args, _bundle(shapes.x), *side_args, out_shardings=(y_out,)
        )
    }
    if last:
        y_def, t_def = jax.tree.structure(y_specs), jax.tree.structure(shapes.targets)

        def loss(yb, tb):
            value = loss_fn(jax.tree.unflatten(y_def, list(yb)), jax.tree.unflatten(t_def, list(tb)))
            return ((value[0] if shapes.weighted else value,),)

        specs[names.program("loss", k)] = programs.exported(
            loss,
            tuple(_bundle(y_specs)),
            _bundle(shapes.targets),
            out_shardings=((_replicated((shapes.params, shapes.x)),),),
        )
    return specs


def build_weight(k: int, shapes: StageShapes, *, loss_fn: Callable, num_microbatches: int, y_specs) -> dict:
    """weight{k} (last stage, weighted loss): the step's total weight, the sum over its m
    microbatches in order of the weight the loss returns. The weight reads the batch only (see
    mpmd/stages/batch.py), so it is known before any forward runs and every backward can be
    seeded with 1/total."""
    y_def, t_def = jax.tree.structure(y_specs), jax.tree.structure(shapes.targets)
    y_zero = [jnp.zeros(l.shape, l.dtype) for l in jax.tree.leaves(y_specs)]

    def weight(*tbs):
        total = jnp.float32(0)
        for tb in tbs:
            w = loss_fn(jax.tree.unflatten(y_def, y_zero), jax.tree.unflatten(t_def, list(tb)))[1]
            total = total + jnp.asarray(w, jnp.float32)
        return ((total,),)

    args = [_bundle(shapes.targets)] * num_microbatches
    return {
        names.program("weight", k): programs.exported(
            weight, *args, out_shardings=((_replicated((shapes.params, shapes.x)),),)
        )
    }


def build_shared(k: int, param_specs: list[tuple], shared) -> dict:
    """shared_out{k}: the stage's shared leaves' gradients (its "part"); shared_in{k}: for each
    shared leaf, every holder's gradient summed in stage order (the same sum, bit for bit, on
    every holder), written back into the stage's gradient. `param_specs` is per stage."""
    S = len(param_specs)
    idx = shared_indices(S, shared)
    holders = sorted(shared_peers(S, shared)[k] + [k])
    pos = {s: {i: n for n, i in enumerate(idx[s])} for s in holders}
    terms = {
        i: sorted((s, pos[s][j]) for s, j in group)  # local leaf -> holders' terms
        for group in shared
        for t, i in group
        if t == k
    }

    def shared_out(grads):
        return (tuple(grads[i] for i in idx[k]),)

    def shared_in(grads, *parts):
        part_of = dict(zip(holders, parts))
        out = list(grads)
        for i, ts in terms.items():
            total = part_of[ts[0][0]][ts[0][1]]
            for s, n in ts[1:]:
                total = total + part_of[s][n]
            out[i] = total
        return (tuple(out),)

    # Another holder's part arrives in whatever layout its receive chose (lowering lays it
    # out like the local copy of the weight): its specs leave the layout open.
    parts = [
        tuple(param_specs[k][i] for i in idx[k]) if s == k else _unplaced(tuple(param_specs[s][i] for i in idx[s]))
        for s in holders
    ]
    mine = tuple(param_specs[k][i].sharding for i in idx[k])
    return {
        names.program("shared_out", k): programs.exported(shared_out, param_specs[k], out_shardings=(mine,)),
        names.program("shared_in", k): programs.exported(
            shared_in, param_specs[k], *parts, out_shardings=(_layouts(param_specs[k]),)
        ),
    }


def build_optimizer(
    k: int,
    fn: StageFn,
    param_specs: tuple,
    optimizer: optax.GradientTransformation,
    num_stages: int,
    max_grad_norm: float | None,
    not_counted=(),
    opt_layouts=None,
) -> dict:
    """Export opt_init{k}, update{k} and (when clipping) sqnorm{k}.

    `opt_layouts`: the shardings of the optimizer-state leaves (mpmd.stages.sharding.optimizer_layouts).
    Clipping follows optax.clip_by_global_norm over ALL stages' gradients: every slice gets
    every stage's squared norm and sums them in stage order, so each stage scales by the same
    global factor (clipping each stage by its own norm would change the update direction).
    `not_counted`: leaves whose gradient another stage already counts (shared parameters).
    """
    tree = fn.param_tree

    def opt_init(params):
        return (tuple(jax.tree.leaves(optimizer.init(jax.tree.unflatten(tree, list(params))))),)

    (opt_specs,) = jax.eval_shape(opt_init, param_specs)
    opt_tree = jax.tree.structure(optimizer.init(jax.tree.unflatten(tree, list(param_specs))))

    def update(params, opt, grads, *sqnorms):
        p = jax.tree.unflatten(tree, list(params))
        g = jax.tree.unflatten(tree, list(grads))
        if max_grad_norm is not None:
            g_norm = jnp.sqrt(sum(s[0] for s in sqnorms))
            trigger = g_norm < max_grad_norm
            g = jax.tree.map(lambda t: jnp.where(trigger, t, (t / g_norm.astype(t.dtype)) * max_grad_norm), g)
        updates, opt_state = optimizer.update(g, jax.tree.unflatten(opt_tree, list(opt)), p)
        p = optax.apply_updates(p, updates)
        return tuple(jax.tree.leaves(p)), tuple(jax.tree.leaves(opt_state))

    # A shared parameter's gradient lives on each holder; the global norm counts it once.
    counted = [i for i in range(len(param_specs)) if i not in set(not_counted)]

    def sqnorm(grads):
        return ((sum((jnp.sum(jnp.square(grads[i])) for i in counted), jnp.float32(0)),),)

    p_out = _layouts(param_specs)
    o_out = tuple(opt_layouts) if opt_layouts is not None else tuple(None for _ in jax.tree.leaves(opt_specs))
    opt_specs = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=o) for s, o in zip(opt_specs, o_out))
    replicated = _replicated(param_specs) if param_specs else None
    scalar = (jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),)
    specs = {
        names.program("opt_init", k): programs.exported(opt_init, param_specs, out_shardings=(o_out,)),
        names.program("update", k): programs.exported(
            update,
            param_specs,
            opt_specs,
            param_specs,
            *([scalar] * num_stages if max_grad_norm is not None else []),
            out_shardings=(p_out, o_out),
        ),
    }
    if max_grad_norm is not None:
        specs[names.program("sqnorm", k)] = programs.exported(sqnorm, param_specs, out_shardings=((replicated,),))
    return specs
