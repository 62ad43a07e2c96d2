"""A pipeline: ordered stages (nnx.Modules, or the StageFn records mpmd.split cuts from a
model with stage marks) and a loss on the last stage's output.

Each stage becomes a pure function of (flat parameter leaves, input pytree, side inputs) so
it can be traced into programs. What its forward changes that is not a parameter (RNG
stream counts, batch statistics) is its state (StageState): an input and an output of its
forward program, kept on its slice.

Side inputs: a keyword-only parameter of a stage's `__call__` (`def __call__(self, x, *,
positions)`) names a key of the batch; that key's microbatch is fed to the stage's slice
directly (mpmd/stages/batch.py), never through the stages before it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import jax
from flax import nnx
from jax.extend.core import Literal, jaxprs_in_params

from mpmd.stages.leaf_paths import local_paths, path_string, stage_param_paths
from mpmd.stages.specs import describe as _describe, spec as _spec


class StageState(NamedTuple):
    """What a stage changes in its forward that is not a parameter: an nnx.Rngs stream's
    and key (nnx.Dropout draws from it; the key as its raw key data, `carried_values`),
    nnx.BatchStat running statistics, any other non-Param nnx.Variable. Carried as an input
    and an output of the stage's forward program and kept on its slice like its parameters."""

    leaves: tuple  # initial values of the carried leaves
    paths: tuple  # each leaf's path within the stage (`drop.rngs.count`)
    step: Callable  # (param leaves, state leaves, x, **side) -> (output, new state leaves)
    evaluate: Callable  # (param leaves, state leaves, x, **side) -> output, in eval mode


class StageFn(NamedTuple):
    """One stage as a pure function and its initial parameters."""

    apply: Callable[[tuple, Any], Any]  # (param leaves, input pytree) -> output pytree
    param_leaves: tuple  # initial values (arrays or ShapeDtypeStructs)
    param_tree: Any  # treedef of the stage's nnx.Param state
    # For stages cut from one model at its marks: the model's global leaf index of each of
    # param_leaves. A weight used by several stages (tied embedding) has the same index in each.
    param_index: tuple | None = None
    # Per leaf, its logical axis names (Flax metadata `out_sharding`, e.g. ("embed", "mlp")),
    # or None where unannotated: what mpmd.stages.sharding's rules lay out on a slice's mesh.
    param_axes: tuple | None = None
    # The keyword-only parameters its apply takes, as (name, required): batch keys fed to this
    # stage as side inputs (`apply(leaves, x, **side)`); a parameter with a default that no
    # batch key names keeps its default.
    keywords: tuple = ()
    # Its non-parameter variables, when it has any (None: none); `apply` then runs it from
    # their initial values and keeps nothing (shape inference, costs).
    state: StageState | None = None
    # (param leaves, input pytree, **side) -> (output, the parameter leaves after the forward):
    # what shows a forward that changes a parameter (Pipeline.activation_specs refuses it).
    with_params: Callable | None = None


def stage_fn(module: nnx.Module) -> StageFn:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    with_paths, rest_tree = jax.tree_util.tree_flatten_with_path(rest)
    rest_leaves = [l for _, l in with_paths]
    keys = [_key_impl(l) if _is_key(l) else None for l in rest_leaves]

    def merged(graph, p, s):
        # Fresh Variables around the given values, made inside the caller's trace: a forward
        # may then change them (nnx refuses to change Variables of another trace level).
        r = [jax.random.wrap_key_data(v, impl=impl) if impl is not None else v for v, impl in zip(s, keys)]
        return nnx.merge(graph, jax.tree.unflatten(tree, list(p)), jax.tree.unflatten(rest_tree, r))

    def step(p, s, x, **side):
        m = merged(graphdef, p, s)
        out = m(x, **side)
        return out, carried_values(jax.tree.leaves(nnx.split(m, nnx.Param, ...)[2]))

    initial = carried_values(rest_leaves)

    def from_initial(p, x, **side):
        # An abstract model's state has shapes only: any value serves to infer shapes and costs.
        s = [jax.numpy.zeros(l.shape, l.dtype) if isinstance(l, jax.ShapeDtypeStruct) else l for l in initial]
        m = merged(graphdef, p, s)
        return m(x, **side), tuple(jax.tree.leaves(nnx.state(m, nnx.Param)))

    def apply(p, x, **side):
        return from_initial(p, x, **side)[0]

    state = None
    if rest_leaves:
        eval_graph = eval_graphdef(module)
        state = StageState(
            initial,
            tuple(path_string(kp) for kp, _ in with_paths),
            step,
            lambda p, s, x, **side: merged(eval_graph, p, s)(x, **side),
        )
    return StageFn(
        apply,
        tuple(leaves),
        tree,
        param_axes=logical_axes(params),
        keywords=keywords_of(module),
        state=state,
        with_params=from_initial,
    )


def carried_values(leaves) -> tuple:
    """A stage's non-parameter leaves as its programs carry them and checkpoints keep them: a
    PRNG key as its raw key data (uint32; typed keys cross no wire and no Orbax file), any
    other leaf as it is. Abstract leaves (ShapeDtypeStructs) give their shapes."""

    def value(l):
        if not _is_key(l):
            return l
        return jax.eval_shape(jax.random.key_data, l) if isinstance(l, jax.ShapeDtypeStruct) else jax.random.key_data(l)

    return tuple(value(l) for l in leaves)


def _is_key(leaf) -> bool:
    return jax.dtypes.issubdtype(jax.numpy.result_type(leaf), jax.dtypes.prng_key)


def _key_impl(leaf):
    # An abstract key has no public way to its implementation; its dtype carries it.
    return leaf.dtype._impl if isinstance(leaf, jax.ShapeDtypeStruct) else jax.random.key_impl(leaf)


def carried_leaves(rest_leaves) -> list[int]:
    """Which of a marked model's non-parameter leaves it carries as stage state: all but RNG
    stream keys (typed PRNG keys, which no forward changes: constants of its programs, made
    again from the model's seeds; module stages carry them as key data, `carried_values`)."""
    return [i for i, l in enumerate(rest_leaves) if not _is_key(l)]


def eval_graphdef(module: nnx.Module):
    """The graphdef of `module` in eval mode (`module.eval()`: no dropout, running statistics)."""
    evaluating = nnx.clone(module)
    evaluating.eval()
    return nnx.split(evaluating, nnx.Param, ...)[0]


def keywords_of(module) -> tuple:
    """(name, required) of the keyword-only parameters of `module.__call__`; for a stage that
    hands each of its layers their own (mpmd.stages.split.Layers), what its
    `side_input_keywords()` says."""
    if callable(getattr(module, "side_input_keywords", None)):
        return tuple(module.side_input_keywords())
    try:
        signature = inspect.signature(type(module).__call__)
    except (TypeError, ValueError):
        return ()
    return tuple(
        (p.name, p.default is inspect.Parameter.empty)
        for p in signature.parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    )


def logical_axes(params) -> tuple:
    """The logical axis names of each leaf of an nnx.Param state (None: unannotated), in
    jax.tree.leaves order."""
    variables = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    out = []
    for v in variables:
        names = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        out.append(tuple(names) if names else None)
    return tuple(out)


class Pipeline:
    """`stages[i]` consumes `stages[i-1]`'s output; `loss_fn(last_output, targets)` returns the
    scalar mean over a microbatch.

    `shared` lists the parameters held by more than one stage (from StageFn.param_index): each
    group is the (stage, local leaf index) copies of one weight, whose gradients must be summed
    so the copies stay equal. Module stages share nothing.

    `sample_input` (optional, one microbatch or batch of inputs) lets shape mismatches between
    stages be reported here instead of at the first step.

    `param_paths`: per stage, each parameter leaf's path in the model, which checkpoints are
    keyed by (mpmd/stages/leaf_paths.py); taken from what mpmd.split returned, else each stage's own
    paths under `stage<k>/` (`scoped_paths`: such a checkpoint fits only the same stages).
    """

    def __init__(self, stages, loss_fn: Callable, sample_input=None):
        model_paths = getattr(stages, "param_paths", None)  # mpmd.split's Stages carry them
        stages = list(stages)
        if not stages:
            raise ValueError("Pipeline needs at least one stage, got an empty list")
        for i, s in enumerate(stages):
            if not isinstance(s, (nnx.Module, StageFn)):
                raise ValueError(
                    f"stage {i} must be an nnx.Module, got {type(s).__name__} "
                    f"(or a StageFn, as mpmd.split returns for a model with stage marks)"
                )
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable as loss_fn(last_stage_output, targets), got {loss_fn!r}")
        self.stages = stages
        self.loss_fn = loss_fn
        self.fns = [s if isinstance(s, StageFn) else stage_fn(s) for s in stages]
        self.shared = shared_params(self.fns)
        self.param_paths, self.scoped_paths = stage_param_paths(self.fns, model_paths)
        self._traced: dict = {}  # activation_specs by (input, side inputs) specs
        # With side inputs a stage cannot be traced before a batch gives their shapes.
        if sample_input is not None and not any(required for fn in self.fns for _, required in fn.keywords):
            self.activation_specs(jax.tree.map(_spec, sample_input))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def activation_specs(self, input_spec, side_specs=None) -> list:
        """Abstract input of every stage plus the last output: specs[i] enters stage i.
        `side_specs`: per stage, {batch key: spec} of its side inputs (None: none).

        Raises ValueError naming the stage whose input does not fit. Traced once per distinct
        `(input_spec, side_specs)`: the lowering, the cost model, the memory estimate and the
        batch plan ask alike.
        """
        leaves, tree = jax.tree.flatten((input_spec, side_specs))
        try:
            key = (tree, tuple(leaves))
            hash(key)
        except TypeError:  # a leaf that is not a spec: traced every time
            key = None
        if key is not None and key in self._traced:
            return list(self._traced[key])
        specs = self._activation_specs(input_spec, side_specs)
        if key is not None:
            self._traced[key] = tuple(specs)
        return specs

    def _activation_specs(self, input_spec, side_specs) -> list:
        specs = [input_spec]
        for i, fn in enumerate(self.fns):
            param_specs = tuple(jax.tree.map(_spec, fn.param_leaves))
            side = (side_specs[i] if side_specs else None) or {}
            name = type(self.stages[i]).__name__
            traced = fn.with_params or (lambda p, x, **s: (fn.apply(p, x, **s), p))
            try:
                closed, (out, _) = jax.make_jaxpr(lambda p, x, s: traced(p, x, **s), return_shape=True)(
                    param_specs, specs[-1], side
                )
            except Exception as e:  # shape errors surface as TypeError/ValueError from inside Flax
                got = _describe(specs[-1])
                where = "the pipeline input" if i == 0 else f"stage {i - 1}'s output"
                raise ValueError(
                    f"stage {i} ({name}) cannot take {where} {got}: {type(e).__name__}: {str(e).splitlines()[0]}"
                ) from None
            callback = host_callback(closed.jaxpr)
            if callback is not None:
                raise ValueError(
                    f"stage {i} ({name}) calls the host ({callback}: jax.debug.print, "
                    f"jax.debug.callback, jax.pure_callback or io_callback): a stage's programs "
                    f"are exported to its workers, which cannot call back into this process. "
                    f"Remove the callback from the stage (return a value from the stage to "
                    f"inspect it)"
                )
            n = len(param_specs)
            origin = _Origins()
            origins = [origin(closed.jaxpr, v) for v in (closed.jaxpr.outvars[-n:] if n else [])]
            changed = [j for j, o in enumerate(origins) if o is not _UNSEEN and o is not closed.jaxpr.invars[j]]
            if changed:
                raise ValueError(
                    f"stage {i} ({name}) changes its parameter {local_paths(fn)[changed[0]]!r} in its "
                    f"forward: parameters change only by the optimizer's update. Keep what the "
                    f"forward updates in another nnx.Variable (it is then stage state, carried on "
                    f"the stage's slice), not in an nnx.Param"
                )
            specs.append(out)
        return specs


_CALLBACKS = ("debug_callback", "debug_print", "pure_callback", "io_callback", "callback")


def host_callback(jaxpr) -> str | None:
    """The name of the first host-callback primitive in `jaxpr` (nested jaxprs included)."""
    for e in jaxpr.eqns:
        if e.primitive.name in _CALLBACKS:
            return e.primitive.name
        for sub in jaxprs_in_params(e.params):
            found = host_callback(sub)
            if found is not None:
                return found
    return None


_UNSEEN = object()


class _Origins:
    """origin(jaxpr, var): the input of `jaxpr` that `var` is, unchanged through calls (jit,
    nnx.remat's checkpoint) that return some of their inputs as they are; None where it is
    computed (or a literal); _UNSEEN where it comes out of a call this cannot see into. Each
    jaxpr's map of who produces what is built once, however many outputs are asked about."""

    def __init__(self):
        self._producers: dict[int, tuple] = {}

    def _producer(self, jaxpr) -> dict:
        if id(jaxpr) not in self._producers:
            self._producers[id(jaxpr)] = (jaxpr, {v: (e, j) for e in jaxpr.eqns for j, v in enumerate(e.outvars)})
        return self._producers[id(jaxpr)][1]

    def __call__(self, jaxpr, var):
        producer = self._producer(jaxpr)
        while not isinstance(var, Literal) and var not in jaxpr.invars:
            if var not in producer:
                return None
            e, j = producer[var]
            subs = list(jaxprs_in_params(e.params))
            if not subs:
                return None
            sub = subs[0]
            if len(subs) > 1 or len(sub.invars) != len(e.invars) or len(sub.outvars) != len(e.outvars):
                return _UNSEEN
            inner = self(sub, sub.outvars[j])
            if inner is None or inner is _UNSEEN:
                return inner
            var = e.invars[sub.invars.index(inner)]
        return None if isinstance(var, Literal) else var


def shared_params(fns) -> list[list[tuple[int, int]]]:
    """Groups of (stage, local leaf index) that are one global parameter, by global index."""
    where: dict[int, list[tuple[int, int]]] = {}
    for k, fn in enumerate(fns):
        for j, g in enumerate(fn.param_index or ()):
            where.setdefault(g, []).append((k, j))
    return [where[g] for g in sorted(where) if len(where[g]) > 1]


def shared_indices(S: int, shared) -> list[list[int]]:
    """Per stage, its local leaf indices that belong to a shared group, ascending."""
    idx: list[set[int]] = [set() for _ in range(S)]
    for group in shared:
        for k, i in group:
            idx[k].add(i)
    return [sorted(x) for x in idx]


def shared_peers(S: int, shared) -> list[list[int]]:
    """Per stage, the other stages it shares a parameter with, ascending."""
    peers: list[set[int]] = [set() for _ in range(S)]
    for group in shared:
        stages = {k for k, _ in group}
        for k in stages:
            peers[k] |= stages - {k}
    return [sorted(x) for x in peers]
