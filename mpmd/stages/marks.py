"""Stage marks: end a pipeline stage anywhere inside a model's `__call__` (as JaxPP does).

    def __call__(self, tokens):
        x = skip = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in self.cuts:
                x = mpmd.stage_boundary(x)      # stage ends here
        return self.head(x + skip)

    stages = mpmd.split(model, sample_input=tokens)   # len(cuts) + 1 StageFn records

Outside mpmd the mark is the identity (a primitive whose value, JVP, transpose and batching
rule pass their operands through), so the marked model runs, jits and differentiates exactly
as before.

How the cut works: the model is traced ONCE into a jaxpr (parameters and input as its
arguments). Calls to `jax.jit` functions that contain a mark are inlined; a mark inside
lax.cond / scan / while (or remat, custom_vjp) is an error, since a stage must end exactly
once per step. An equation belongs to the stage of its position: after mark i-1, up to and
including mark i. Equations that do not depend on the model input (a transposed weight, a
causal mask, position embeddings) are recomputed in every stage that needs them instead of
being sent, so a weight used by two stages (a tied embedding) becomes a parameter of both;
`param_index` maps each stage's leaves to the model's global leaves. Every other value
defined before boundary i and read after it (the marked activation, then skip connections
in program order) is sent across it: stage i > 0 takes, and stage i < last returns, that flat
tuple.

Side inputs: the keyword-only parameters of the model's `__call__` (`def __call__(self, x, *,
mask, positions=None)`) that the sample names (`sample_input={"inputs": x, "mask": m}`, a
batch dict; its other keys are ignored) are traced as further jaxpr inputs. Values computed
from side inputs and parameters alone are recomputed like the static ones, so each stage takes
exactly the side inputs its equations read (its StageFn.keywords) straight from the batch,
and nothing of them crosses a cut. A keyword with a default that the sample does not name
keeps its default.

Auxiliary losses: each `mpmd.add_loss(term)` during the trace binds an identity marker on the
term, so its equation sits at the place of the call; the term is an extra output of that
stage's program, and the stage's apply adds it again (mpmd.add_loss) where its caller
collects it, as a module stage's forward would.

Stage state: what the forward changes that is not a parameter (an nnx.Rngs stream's count,
nnx.BatchStat running statistics) is traced as further inputs and outputs; each leaf lives on
the one stage that reads or changes it (a StageState under its path in the model; a stream
used on both sides of a mark is an error), and evaluation runs a second cut of the model in
eval mode (`module.eval()`).

The jaxpr has fixed shapes, so a stage is re-cut for each new microbatch shape (and set of
side inputs): the model is re-traced with the input's leading (batch) axis changed, and the
cut must come out with the same structure (each stage reading no parameter or side input its
sample cut did not), else a ValueError.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import DebugInfo, DropVar, Jaxpr, Literal, Primitive, Var, jaxprs_in_params
from jax.interpreters import ad, batching, mlir

from mpmd.runtime import compat
from mpmd.stages import losses
from mpmd.stages.batch import INPUTS
from mpmd.stages.leaf_paths import path_string
from mpmd.stages.pipeline import StageFn, StageState, carried_leaves, eval_graphdef, keywords_of, logical_axes
from mpmd.stages.specs import describe, spec
from mpmd.stages.costs import Stages, fn_costs


def _identity_primitive(name: str) -> Primitive:
    """A primitive that returns its operands: a marker in the traced jaxpr, carrying no math.
    Tangents pass by it (so it never reaches the linear part of a grad), cotangents pass back
    through it, batch axes stay where they were."""
    p = Primitive(name)
    p.multiple_results = True  # one equation for the whole pytree: one cut point
    p.def_impl(lambda *xs: xs)
    p.def_abstract_eval(lambda *avals: avals)
    mlir.register_lowering(p, lambda ctx, *xs: xs)
    ad.primitive_jvps[p] = lambda primals, tangents: (p.bind(*primals), list(tangents))
    ad.primitive_transposes[p] = lambda cts, *xs: list(cts)
    batching.primitive_batchers[p] = lambda xs, dims: (p.bind(*xs), dims)
    return p


_boundary_p = _identity_primitive("stage_boundary")
# Where a traced model called mpmd.add_loss: the term belongs to the stage this equation sits in.
_aux_p = _identity_primitive("aux_loss")
_MARKERS = (_boundary_p, _aux_p)

# Higher-order primitives whose body is run exactly once per call: safe to inline.
_INLINABLE = compat.CALL_PRIMITIVES


def stage_boundary(x):
    """End the current pipeline stage at `x` (any pytree of arrays); returns `x` unchanged."""
    leaves, tree = jax.tree.flatten(x)
    return jax.tree.unflatten(tree, _boundary_p.bind(*leaves)) if leaves else x


class MarkedSplit(Stages):
    """StageFn records (with `param_index`) of a model cut at its marks; `.costs` in flops."""


def count_marks(model, sample_input) -> int:
    """How many stage boundaries `model(sample_input)` passes (raises for unsupported ones).
    Traced with all of the model's variables as arguments, so a model that changes stage state
    (dropout, batch statistics) or adds losses can be counted, and then cut by its layers."""
    if not isinstance(model, nnx.Module):
        raise ValueError(f"mpmd.split by stage marks needs an nnx.Module, got {type(model).__name__}")
    required = dict(keywords_of(model))
    x, side = _sample_parts(sample_input, required)
    if any(r and k not in side for k, r in required.items()):
        return 0  # not traceable whole without them: a model cut by its layers
    graphdef, state = nnx.split(model)
    with losses.collect_losses():
        closed = jax.make_jaxpr(lambda s, x, side: nnx.merge(graphdef, s)(x, **side))(
            jax.tree.map(spec, state), jax.tree.map(spec, x), jax.tree.map(spec, side)
        )
    jaxpr, _ = _inline_marked_calls(closed.jaxpr, closed.consts)
    return sum(e.primitive is _boundary_p for e in jaxpr.eqns)


def _sample_parts(sample, keywords) -> tuple[Any, dict]:
    """(model input, {keyword: value}): a sample batch dict's `inputs` and its keys naming
    `keywords` (the keyword-only parameters of the model's `__call__`; other keys are
    ignored), or the sample itself as the input."""
    if isinstance(sample, dict) and INPUTS in sample:
        return sample[INPUTS], {k: v for k, v in sample.items() if k in keywords}
    return sample, {}


def split_marked(model, sample_input) -> MarkedSplit:
    """Cut `model` at its `stage_boundary` marks into len(marks) + 1 StageFn records."""
    marked = _Marked(model, sample_input)
    if marked.num_marks == 0:
        raise ValueError(
            f"no mpmd.stage_boundary marks found in {marked.name}; add marks or pass "
            f"num_stages=... for a model exposing .layers()"
        )
    first = marked.cut(marked.sample, marked.side_sample)
    stages = MarkedSplit(
        StageFn(
            marked.stage_apply(k),
            tuple(marked.leaves[i] for i in prog.param_index),
            jax.tree.structure(tuple(prog.param_index)),
            tuple(prog.param_index),
            tuple(marked.axes[i] for i in prog.param_index),
            keywords=marked.stage_keywords[k],
            state=marked.stage_state(k),
        )
        for k, prog in enumerate(first)
    )
    stages.param_paths = [tuple(marked.paths[i] for i in prog.param_index) for prog in first]
    side = [{name: marked.side_sample[name] for name, _ in fn.keywords} or None for fn in stages]
    stages.costs, stages.cost_unit = fn_costs(stages, marked.sample, side), "flops"
    return stages


class _Program(NamedTuple):
    """One stage of one cut: a jaxpr of (its params..., its state leaves..., its input
    leaves..., its side-input leaves...) -> (its outputs..., its new state leaves..., the
    auxiliary-loss terms added in it...)."""

    jaxpr: Jaxpr
    consts: list
    param_index: list[int]
    in_specs: tuple  # ShapeDtypeStructs of the input leaves
    side: tuple  # (keyword, its leaves' specs) of each side input it reads, by name
    state: tuple  # the state leaves it carries (indices into _Marked.state_paths)
    num_aux: int  # how many mpmd.add_loss terms end its outputs
    out_tree: Any  # the model's output treedef (last stage) or None (flat tuple)


class _Marked:
    """A model with marks and its cuts, one per model-input and side-input shapes (traced on
    demand)."""

    def __init__(self, model, sample_input):
        if not isinstance(model, nnx.Module):
            raise ValueError(f"mpmd.split by stage marks needs an nnx.Module, got {type(model).__name__}")
        self.name = type(model).__name__
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.leaves, self.param_tree = jax.tree.flatten(params)
        self.paths = [path_string(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        self.axes = logical_axes(params)
        if any(isinstance(l, jax.ShapeDtypeStruct) for l in self.leaves):
            raise ValueError(
                "mpmd.split by stage marks does not support mpmd.abstract models yet: "
                "build the model concretely, or split an abstract model with num_stages"
            )
        # What a forward changes that is not a parameter (RNG stream counts, batch statistics)
        # is carried as stage state.
        with_paths, self.rest_tree = jax.tree_util.tree_flatten_with_path(rest)
        self.rest_leaves = [l for _, l in with_paths]
        self.carried = carried_leaves(self.rest_leaves)
        self.state_paths = [path_string(with_paths[i][0]) for i in self.carried]
        self.eval_graphdef = eval_graphdef(model)
        self.param_specs = [spec(l) for l in self.leaves]
        self.required = dict(keywords_of(model))  # keyword-only parameter -> it has no default
        x, side = self._sample_parts(sample_input)
        self.sample = jax.tree.map(spec, x)
        self.side_sample = {name: jax.tree.map(spec, side[name]) for name in sorted(side)}
        self.cuts: dict = {}  # (model-input specs, side-input specs) -> its cut
        # Per stage, from the sample's cut: the global leaves it holds, (name, required) of the
        # keywords it reads, the state leaves it carries.
        self.stage_params: list | None = None
        self.stage_keywords: list | None = None
        self.stage_states: list | None = None
        self.traced = self._trace(self.sample, self.side_sample, False)
        self.num_marks = sum(e.primitive is _boundary_p for e in self.traced[0].eqns)

    def _sample_parts(self, sample) -> tuple[Any, dict]:
        x, side = _sample_parts(sample, self.required)
        missing = [k for k, required in self.required.items() if required and k not in side]
        if missing:
            raise ValueError(
                f"{self.name}.__call__ takes the keyword-only parameter(s) {missing} without a "
                f"default (side inputs, fed from the batch keys of their names): pass mpmd.split a "
                f"sample batch naming them, sample_input={{'inputs': x, {missing[0]!r}: ...}}"
            )
        return x, side

    def _trace(self, x_spec, side_spec, evaluating: bool):
        def forward(params, state, x, side):
            rest = list(self.rest_leaves)
            for i, v in zip(self.carried, state):
                rest[i] = v
            model = nnx.merge(
                self.eval_graphdef if evaluating else self.graphdef,
                jax.tree.unflatten(self.param_tree, params),
                jax.tree.unflatten(self.rest_tree, rest),
            )
            # Each added term is marked where it is added: it belongs to the stage of that equation.
            with losses.collect_losses(on_add=lambda v: _aux_p.bind(jnp.asarray(v, jnp.float32))[0]) as aux:
                out = model(x, **side)
            new = jax.tree.leaves(nnx.split(model, nnx.Param, ...)[2])
            return out, [new[i] for i in self.carried], list(aux)

        state = [spec(self.rest_leaves[i]) for i in self.carried]
        closed, (out, _, aux) = jax.make_jaxpr(forward, return_shape=True)(self.param_specs, state, x_spec, side_spec)
        jaxpr, consts = _inline_marked_calls(closed.jaxpr, closed.consts)
        return _dead_code_removed(jaxpr, consts), consts, jax.tree.structure(out), len(aux)

    def cut(self, x_spec, side_spec: dict, evaluating: bool = False) -> list[_Program]:
        key = (evaluating, _key((x_spec, side_spec)))
        if key not in self.cuts:
            sample = key == (False, _key((self.sample, self.side_sample)))
            traced = self.traced if sample else self._trace(x_spec, side_spec, evaluating)
            progs = _cut(*traced, len(self.leaves), side_spec, self.state_paths)
            if self.stage_keywords is None:
                self.stage_params = [p.param_index for p in progs]
                self.stage_keywords = [tuple((name, self.required[name]) for name, _ in p.side) for p in progs]
                self.stage_states = [p.state for p in progs]
            # Another cut may read fewer (a defaulted keyword the batch lacks, eval mode), never more.
            within = all(
                set(p.param_index) <= set(params)
                and {n for n, _ in p.side} <= {n for n, _ in kw}
                and set(p.state) <= set(state)
                for p, params, kw, state in zip(progs, self.stage_params, self.stage_keywords, self.stage_states)
            )
            if not within:
                raise ValueError(
                    f"{self.name} cuts into different stages for input {describe(x_spec)} and side "
                    f"inputs {sorted(side_spec)}{' in eval mode' if evaluating else ''} than for its "
                    f"sample: its stage_boundary marks, and which stages read each parameter, side "
                    f"input and state variable, must not depend on the input shape or the mode"
                )
            self.cuts[key] = progs
        return self.cuts[key]

    def _cut_for(self, k: int, x, side: dict, evaluating: bool) -> _Program:
        """Stage k's program for input x and side inputs `side`. Stage k > 0 sees only the
        values crossing its boundary, and every stage only its own side inputs, so the model
        input and the other stages' side inputs are guessed from their leading (batch) axes."""
        specs = tuple(spec(l) for l in jax.tree.leaves(x))
        given = {name: jax.tree.map(spec, side[name]) for name in sorted(side)}
        mine = _side_key(given)

        def fits(prog):
            names = {n for n, _ in prog.side}
            return (
                prog.in_specs == specs
                and names <= set(given)
                and prog.side == tuple(item for item in mine if item[0] in names)
            )

        for (mode, _), progs in self.cuts.items():
            if mode == evaluating and fits(progs[k]):
                return progs[k]
        own = {name for name, _ in self.stage_keywords[k]}
        for batch in dict.fromkeys(s.shape[0] for s in specs + tuple(jax.tree.leaves(given)) if s.shape):
            resized = lambda s: jax.ShapeDtypeStruct((batch,) + s.shape[1:], s.dtype) if s.shape else s
            guess = jax.tree.map(spec, x) if k == 0 else jax.tree.map(resized, self.sample)
            guess_side = {
                name: given[name] if name in own else jax.tree.map(resized, s)
                for name, s in self.side_sample.items()
                if name in given or name not in own
            }
            prog = self.cut(guess, guess_side, evaluating)[k]
            if fits(prog):
                return prog
        want = self.cut(self.sample, self.side_sample)[k]
        raise ValueError(
            f"stage {k} of {self.name} takes {describe(want.in_specs)} (side inputs "
            f"{[n for n, _ in want.side]}) for the sample input; got {describe(specs)} (side inputs "
            f"{sorted(given)}), which no batch size of the input produces"
        )

    def _run(self, k: int, evaluating: bool):
        """Stage k as (param leaves, its state leaves, x, **side) -> (output, new state leaves)."""
        held, carried = self.stage_params[k], self.stage_states[k]

        def run(param_leaves, state_leaves, x, **side):
            prog = self._cut_for(k, x, side, evaluating)
            params = [param_leaves[held.index(i)] for i in prog.param_index]
            state = [state_leaves[carried.index(i)] for i in prog.state]
            side_leaves = [leaf for name, _ in prog.side for leaf in jax.tree.leaves(side[name])]
            out = jax.core.eval_jaxpr(prog.jaxpr, prog.consts, *params, *state, *jax.tree.leaves(x), *side_leaves)
            num_out = len(out) - len(prog.state) - prog.num_aux
            for term in out[num_out + len(prog.state) :]:  # collected by the caller (mpmd.collect_losses)
                losses.add_loss(term)
            new = list(state_leaves)
            for i, v in zip(prog.state, out[num_out : num_out + len(prog.state)]):
                new[carried.index(i)] = v
            out = out[:num_out]
            return (tuple(out) if prog.out_tree is None else jax.tree.unflatten(prog.out_tree, out)), tuple(new)

        return run

    def stage_state(self, k: int) -> StageState | None:
        """Stage k's StageState: the state leaves its equations read and change, or None."""
        carried = self.stage_states[k]
        if not carried:
            return None
        evaluate = self._run(k, True)
        return StageState(
            tuple(self.rest_leaves[self.carried[i]] for i in carried),
            tuple(self.state_paths[i] for i in carried),
            self._run(k, False),
            lambda p, s, x, **side: evaluate(p, s, x, **side)[0],
        )

    def stage_apply(self, k: int):
        run, initial = self._run(k, False), [self.rest_leaves[self.carried[i]] for i in self.stage_states[k]]
        return lambda param_leaves, x, **side: run(param_leaves, initial, x, **side)[0]


def _cut(
    jaxpr: Jaxpr, consts: list, out_tree, num_aux: int, num_params: int, side_spec: dict, state_paths: list
) -> list[_Program]:
    side_names = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(side_spec)[0]]
    num_state = len(state_paths)
    num_inputs = len(jaxpr.invars) - num_params - num_state - len(side_names)
    params, state_vars = jaxpr.invars[:num_params], jaxpr.invars[num_params : num_params + num_state]
    inputs = jaxpr.invars[num_params + num_state : num_params + num_state + num_inputs]
    side_vars = jaxpr.invars[num_params + num_state + num_inputs :]
    side_of = dict(zip(side_vars, side_names))  # side-input leaf -> its keyword
    state_of = {v: i for i, v in enumerate(state_vars)}  # state leaf -> its index
    num_outs = len(jaxpr.outvars) - num_state - num_aux  # then the new state, the add_loss terms
    model_outs, new_state = jaxpr.outvars[:num_outs], jaxpr.outvars[num_outs : num_outs + num_state]
    eqns = jaxpr.eqns
    num_stages = 1 + sum(e.primitive is _boundary_p for e in eqns)
    # Pass 1: the stage of every equation by position, and which values depend on the input
    # ("dynamic": computed once, in their stage) versus on params/constants/side inputs only
    # ("static": recomputed where needed; a stage reading a side input takes it from the
    # batch). A mark is always dynamic: it is the cut itself; so is an add_loss term, which
    # belongs to the stage it was added in.
    order = {v: i - len(inputs) for i, v in enumerate(inputs)}  # program order of definition
    home = {v: 0 for v in inputs}  # stage defining a dynamic value
    static_eqn: dict[Var, int] = {}  # static value -> its equation
    own: list[list[int]] = [[] for _ in range(num_stages)]
    mark_outs: list[list[Var]] = []
    stage = 0
    for i, e in enumerate(eqns):
        is_mark = e.primitive is _boundary_p
        if not (e.primitive in _MARKERS or e.effects or any(_is_var(a) and a in home for a in e.invars)):
            static_eqn.update((v, i) for v in e.outvars)
            continue
        own[stage].append(i)
        for v in e.outvars:
            home[v], order[v] = stage, i
        if is_mark:
            mark_outs.append(list(e.outvars))
            stage += 1
    for s in range(num_stages):
        if not any(eqns[i].primitive not in _MARKERS for i in own[s]):
            raise ValueError(
                f"stage_boundary marks leave stage {s} empty (no computation before its end): "
                f"two marks with nothing between them, or a mark on the raw input or the output"
            )

    # Pass 2: what each stage reads; dynamic values from earlier stages cross every boundary
    # between their home and the reader; static values pull their equations into the reader.
    live: list[dict[Var, None]] = [{} for _ in range(num_stages - 1)]
    needed: list[set[int]] = [set(idx) for idx in own]
    reads: list[set[str]] = [set() for _ in range(num_stages)]  # side inputs each stage reads
    reads_state: list[set[int]] = [set() for _ in range(num_stages)]

    def read(s: int, atoms) -> None:
        stack = [a for a in atoms if _is_var(a)]
        while stack:
            v = stack.pop()
            if v in home:
                for b in range(home[v], s):
                    live[b][v] = None
            elif v in side_of:
                reads[s].add(side_of[v])
            elif v in state_of:
                reads_state[s].add(state_of[v])
            elif v in static_eqn and static_eqn[v] not in needed[s]:
                needed[s].add(static_eqn[v])
                stack.extend(a for a in eqns[static_eqn[v]].invars if _is_var(a))

    for s in range(num_stages):
        for i in own[s]:
            read(s, eqns[i].invars)
    read(num_stages - 1, model_outs)
    # A state leaf lives on one stage: the one computing its new value from the input (batch
    # statistics), else the one reading it (an RNG count, advanced by weight-like equations
    # that this stage then recomputes).
    for i, v in enumerate(new_state):
        readers = [s for s in range(num_stages) if i in reads_state[s]]
        owner = home[v] if _is_var(v) and v in home else (readers[-1] if readers else None)
        if owner is None:
            continue  # neither read nor changed by any stage: a constant
        read(owner, [v])
        if any(s != owner for s in range(num_stages) if i in reads_state[s]):
            raise ValueError(
                f"the state variable {state_paths[i]} is read or changed by several stages "
                f"({sorted({owner, *readers})}): a stage's state lives on its own slice; give the "
                f"layers of each stage their own nnx.Rngs stream and normalisation layers"
            )

    progs = []
    for s in range(num_stages):
        body = [eqns[i] for i in sorted(needed[s])]
        ins = list(inputs) if s == 0 else _ordered(live[s - 1], mark_outs[s - 1], order)
        side_ins = [v for v in side_vars if side_of[v] in reads[s]]  # flat order of the side dict
        carried = sorted(reads_state[s])
        aux = [eqns[i].outvars[0] for i in own[s] if eqns[i].primitive is _aux_p]
        outs = (
            (list(model_outs) if s == num_stages - 1 else _ordered(live[s], mark_outs[s], order))
            + [new_state[i] for i in carried]
            + aux
        )
        used = {a for e in body for a in e.invars if _is_var(a)} | {a for a in outs if _is_var(a)}
        p_idx = [i for i, v in enumerate(params) if v in used]
        c_idx = [i for i, v in enumerate(jaxpr.constvars) if v in used]
        defined = (
            set(ins)
            | set(side_ins)
            | {state_vars[i] for i in carried}
            | {params[i] for i in p_idx}
            | {jaxpr.constvars[i] for i in c_idx}
            | {v for e in body for v in e.outvars}
        )
        assert used <= defined, f"stage {s} reads values it neither receives nor computes"
        effects = frozenset().union(*(e.effects for e in body))
        sub = compat.new_jaxpr(
            [jaxpr.constvars[i] for i in c_idx],
            [params[i] for i in p_idx] + [state_vars[i] for i in carried] + ins + side_ins,
            outs,
            body,
            effects,
            DebugInfo("mpmd.split", f"stage {s} of {num_stages}", None, None),
            [consts[i] for i in c_idx],
        )
        side = _side_key({name: side_spec[name] for name in sorted(reads[s])})
        progs.append(
            _Program(
                sub,
                [consts[i] for i in c_idx],
                p_idx,
                tuple(_spec_of(v) for v in ins),
                side,
                tuple(carried),
                len(aux),
                out_tree if s == num_stages - 1 else None,
            )
        )
    return progs


def _ordered(live: dict, marked: list, order: dict) -> list[Var]:
    """The values crossing one boundary: the marked activation first, then by definition."""
    return sorted(live, key=lambda v: (v not in marked, order[v], marked.index(v) if v in marked else 0))


def _inline_marked_calls(jaxpr: Jaxpr, consts) -> tuple[Jaxpr, list]:
    """Inline every jit-like call whose body holds a mark; reject marks in control flow."""
    constvars, consts = list(jaxpr.constvars), list(consts)
    subst: dict = {}  # outer var -> the inlined value it now names
    eqns = []
    for e in jaxpr.eqns:
        e = e.replace(invars=[_sub(subst, a) for a in e.invars])
        if not any(_num_marks(j) for j in jaxprs_in_params(e.params)):
            eqns.append(e)
            continue
        name = e.primitive.name
        if name not in _INLINABLE:
            raise ValueError(_nested_error(name))
        body = e.params.get("jaxpr", e.params.get("call_jaxpr"))
        inner, inner_consts = _inline_marked_calls(*compat.closed_parts(body))
        # Fresh variables: the same jitted function called twice must not define a var twice.
        rename = dict(zip(inner.invars, e.invars))
        for v, c in zip(inner.constvars, inner_consts):
            rename[v] = Var(v.aval)
            constvars.append(rename[v])
            consts.append(c)
        for ie in inner.eqns:
            ins = [_sub(rename, a) for a in ie.invars]
            outs = [DropVar(v.aval) if isinstance(v, DropVar) else Var(v.aval) for v in ie.outvars]
            rename.update(zip(ie.outvars, outs))
            eqns.append(ie.replace(invars=ins, outvars=outs))
        subst.update((o, _sub(rename, i)) for o, i in zip(e.outvars, inner.outvars))
    outvars = [_sub(subst, a) for a in jaxpr.outvars]
    return compat.new_jaxpr(constvars, jaxpr.invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info, consts), consts


def _dead_code_removed(jaxpr: Jaxpr, consts) -> Jaxpr:
    """Drop equations whose results are never used (a mark on a discarded value cuts nothing)."""
    used = {a for a in jaxpr.outvars if _is_var(a)}
    kept = []
    for e in reversed(jaxpr.eqns):
        if e.effects or any(v in used for v in e.outvars):
            kept.append(e)
            used.update(a for a in e.invars if _is_var(a))
    return compat.new_jaxpr(
        jaxpr.constvars, jaxpr.invars, jaxpr.outvars, kept[::-1], jaxpr.effects, jaxpr.debug_info, consts
    )


def _num_marks(jaxpr: Jaxpr) -> int:
    return sum(
        (e.primitive is _boundary_p) + sum(_num_marks(j) for j in jaxprs_in_params(e.params)) for e in jaxpr.eqns
    )


def _nested_error(name: str) -> str:
    if name == "cond":
        return "stage_boundary inside lax.cond is not supported: a stage cannot end in only one branch"
    if name in ("scan", "while"):
        return (
            f"stage_boundary inside lax.{'scan' if name == 'scan' else 'while_loop/fori_loop'} is not "
            f"supported: a stage must end exactly once per step; loop in Python to mark inside the loop"
        )
    return f"stage_boundary inside {name} is not supported: move the mark outside it"


def _key(spec_tree):
    return jax.tree.structure(spec_tree), tuple(jax.tree.leaves(spec_tree))


def _side_key(side_spec: dict) -> tuple:
    """(keyword, its leaves' specs) of each side input, by name."""
    return tuple((name, tuple(jax.tree.leaves(side_spec[name]))) for name in sorted(side_spec))


def _is_var(a) -> bool:
    return not isinstance(a, Literal)


def _sub(mapping: dict, a):
    return mapping.get(a, a) if _is_var(a) else a


def _spec_of(v: Var) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
