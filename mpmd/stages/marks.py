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

The jaxpr has fixed shapes, so a stage is re-cut for each new microbatch shape: the model is
re-traced with the input's leading (batch) axis changed, and the cut must come out with the
same structure (same params per stage), else a ValueError.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.extend.core import ClosedJaxpr, DebugInfo, DropVar, Jaxpr, Literal, Primitive, Var, jaxprs_in_params
from jax.interpreters import ad, batching, mlir

from mpmd.stages import losses
from mpmd.stages.leaf_paths import path_string
from mpmd.stages.pipeline import StageFn, logical_axes
from mpmd.stages.specs import describe, spec
from mpmd.stages.costs import Stages, fn_costs

_boundary_p = Primitive("stage_boundary")
_boundary_p.multiple_results = True   # one equation for the whole pytree: one cut point
_boundary_p.def_impl(lambda *xs: xs)
_boundary_p.def_abstract_eval(lambda *avals: avals)
mlir.register_lowering(_boundary_p, lambda ctx, *xs: xs)
# The mark carries no math: tangents pass by it (so it never reaches the linear part of a
# grad), cotangents pass back through it, batch axes stay where they were.
ad.primitive_jvps[_boundary_p] = lambda primals, tangents: (_boundary_p.bind(*primals), list(tangents))
ad.primitive_transposes[_boundary_p] = lambda cts, *xs: list(cts)
batching.primitive_batchers[_boundary_p] = lambda xs, dims: (_boundary_p.bind(*xs), dims)

# Higher-order primitives whose body is run exactly once per call: safe to inline.
_INLINABLE = ("jit", "pjit", "closed_call", "core_call")


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
    graphdef, state = nnx.split(model)
    with losses.collect_losses():
        closed = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(
            jax.tree.map(spec, state), jax.tree.map(spec, sample_input))
    jaxpr, _ = _inline_marked_calls(closed.jaxpr, closed.consts)
    return sum(e.primitive is _boundary_p for e in jaxpr.eqns)


def split_marked(model, sample_input) -> MarkedSplit:
    """Cut `model` at its `stage_boundary` marks into len(marks) + 1 StageFn records."""
    marked = _Marked(model, sample_input)
    if marked.num_marks == 0:
        raise ValueError(f"no mpmd.stage_boundary marks found in {marked.name}; add marks or pass "
                         f"num_stages=... for a model exposing .layers()")
    first = marked.cut(marked.sample)
    stages = MarkedSplit(
        StageFn(marked.stage_apply(k), tuple(marked.leaves[i] for i in prog.param_index),
                jax.tree.structure(tuple(prog.param_index)), tuple(prog.param_index),
                tuple(marked.axes[i] for i in prog.param_index))
        for k, prog in enumerate(first))
    stages.param_paths = [tuple(marked.paths[i] for i in prog.param_index) for prog in first]
    stages.costs, stages.cost_unit = fn_costs(stages, marked.sample), "flops"
    return stages


class _Program(NamedTuple):
    """One stage of one cut: a jaxpr of (its params..., its input leaves...) -> outputs."""
    jaxpr: Jaxpr
    consts: list
    param_index: list[int]
    in_specs: tuple           # ShapeDtypeStructs of the input leaves
    out_tree: Any             # the model's output treedef (last stage) or None (flat tuple)


class _Marked:
    """A model with marks and its cuts, one per model-input shape (traced on demand)."""

    def __init__(self, model, sample_input):
        if not isinstance(model, nnx.Module):
            raise ValueError(f"mpmd.split by stage marks needs an nnx.Module, got {type(model).__name__}")
        self.name = type(model).__name__
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.leaves, self.param_tree = jax.tree.flatten(params)
        self.paths = [path_string(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        self.axes = logical_axes(params)
        if any(isinstance(l, jax.ShapeDtypeStruct) for l in self.leaves):
            raise ValueError("mpmd.split by stage marks does not support mpmd.abstract models yet: "
                             "build the model concretely, or split an abstract model with num_stages")
        self.param_specs = [spec(l) for l in self.leaves]
        self.sample = jax.tree.map(spec, sample_input)
        self.cuts: dict = {}          # model-input specs -> its cut
        self.jaxpr, self.consts, self.out_tree = self._trace(self.sample)
        self.num_marks = sum(e.primitive is _boundary_p for e in self.jaxpr.eqns)

    def _trace(self, x_spec):
        def forward(params, x):
            return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_tree, params), self.rest)(x)
        with losses.refusing_losses():
            try:
                closed, out = jax.make_jaxpr(forward, return_shape=True)(self.param_specs, x_spec)
            except Exception as e:
                if type(e).__name__ == "TraceContextError":
                    raise ValueError(f"{self.name} changes a variable that is not a parameter in its forward "
                                     f"(an nnx.Rngs stream, as nnx.Dropout draws from, or nnx.BatchStat running "
                                     f"statistics): a model cut at stage marks cannot carry stage state yet; run "
                                     f"such layers deterministically or leave them out") from None
                raise
        jaxpr, consts = _inline_marked_calls(closed.jaxpr, closed.consts)
        return _dead_code_removed(jaxpr), consts, jax.tree.structure(out)

    def cut(self, x_spec) -> list[_Program]:
        key = _key(x_spec)
        if key not in self.cuts:
            traced = (self.jaxpr, self.consts, self.out_tree) if key == _key(self.sample) else self._trace(x_spec)
            jaxpr, consts, out_tree = traced
            progs = _cut(jaxpr, consts, len(self.leaves), out_tree)
            if self.cuts and [p.param_index for p in progs] != [p.param_index for p in next(iter(self.cuts.values()))]:
                raise ValueError(f"{self.name} cuts into different stages for input {describe(x_spec)}: "
                                 f"its stage_boundary marks must not depend on the input shape")
            self.cuts[key] = progs
        return self.cuts[key]

    def _cut_for(self, k: int, x) -> _Program:
        """Stage k's program for input x. Stage k > 0 sees only the values crossing its
        boundary, so the model input is guessed from their leading (batch) axes."""
        specs = tuple(spec(l) for l in jax.tree.leaves(x))
        if k == 0:
            return self.cut(jax.tree.map(spec, x))[0]
        for progs in self.cuts.values():
            if progs[k].in_specs == specs:
                return progs[k]
        for batch in dict.fromkeys(s.shape[0] for s in specs if s.shape):
            guess = jax.tree.map(lambda s: jax.ShapeDtypeStruct((batch,) + s.shape[1:], s.dtype) if s.shape else s,
                                 self.sample)
            prog = self.cut(guess)[k]
            if prog.in_specs == specs:
                return prog
        raise ValueError(f"stage {k} of {self.name} takes {describe(self.cut(self.sample)[k].in_specs)} for the "
                         f"sample input; got {describe(specs)}, which no batch size of the input produces")

    def stage_apply(self, k: int):
        def apply(param_leaves, x):
            prog = self._cut_for(k, x)
            out = jax.core.eval_jaxpr(prog.jaxpr, prog.consts, *param_leaves, *jax.tree.leaves(x))
            return tuple(out) if prog.out_tree is None else jax.tree.unflatten(prog.out_tree, out)
        return apply


def _cut(jaxpr: Jaxpr, consts: list, num_params: int, out_tree) -> list[_Program]:
    params, inputs = jaxpr.invars[:num_params], jaxpr.invars[num_params:]
    eqns = jaxpr.eqns
    num_stages = 1 + sum(e.primitive is _boundary_p for e in eqns)
    # Pass 1: the stage of every equation by position, and which values depend on the input
    # ("dynamic": computed once, in their stage) versus on params/constants only ("static":
    # recomputed where needed). A mark is always dynamic: it is the cut itself.
    order = {v: i - len(inputs) for i, v in enumerate(inputs)}    # program order of definition
    home = {v: 0 for v in inputs}                                 # stage defining a dynamic value
    static_eqn: dict[Var, int] = {}                               # static value -> its equation
    own: list[list[int]] = [[] for _ in range(num_stages)]
    mark_outs: list[list[Var]] = []
    stage = 0
    for i, e in enumerate(eqns):
        is_mark = e.primitive is _boundary_p
        if not (is_mark or e.effects or any(_is_var(a) and a in home for a in e.invars)):
            static_eqn.update((v, i) for v in e.outvars)
            continue
        own[stage].append(i)
        for v in e.outvars:
            home[v], order[v] = stage, i
        if is_mark:
            mark_outs.append(list(e.outvars))
            stage += 1
    for s in range(num_stages):
        if not any(eqns[i].primitive is not _boundary_p for i in own[s]):
            raise ValueError(f"stage_boundary marks leave stage {s} empty (no computation before its end): "
                             f"two marks with nothing between them, or a mark on the raw input or the output")

    # Pass 2: what each stage reads; dynamic values from earlier stages cross every boundary
    # between their home and the reader; static values pull their equations into the reader.
    live: list[dict[Var, None]] = [{} for _ in range(num_stages - 1)]
    needed: list[set[int]] = [set(idx) for idx in own]

    def read(s: int, atoms) -> None:
        stack = [a for a in atoms if _is_var(a)]
        while stack:
            v = stack.pop()
            if v in home:
                for b in range(home[v], s):
                    live[b][v] = None
            elif v in static_eqn and static_eqn[v] not in needed[s]:
                needed[s].add(static_eqn[v])
                stack.extend(a for a in eqns[static_eqn[v]].invars if _is_var(a))

    for s in range(num_stages):
        for i in own[s]:
            read(s, eqns[i].invars)
    read(num_stages - 1, jaxpr.outvars)

    progs = []
    for s in range(num_stages):
        body = [eqns[i] for i in sorted(needed[s])]
        ins = list(inputs) if s == 0 else _ordered(live[s - 1], mark_outs[s - 1], order)
        outs = list(jaxpr.outvars) if s == num_stages - 1 else _ordered(live[s], mark_outs[s], order)
        used = {a for e in body for a in e.invars if _is_var(a)} | {a for a in outs if _is_var(a)}
        p_idx = [i for i, v in enumerate(params) if v in used]
        c_idx = [i for i, v in enumerate(jaxpr.constvars) if v in used]
        defined = set(ins) | {params[i] for i in p_idx} | {jaxpr.constvars[i] for i in c_idx} | \
            {v for e in body for v in e.outvars}
        assert used <= defined, f"stage {s} reads values it neither receives nor computes"
        effects = frozenset().union(*(e.effects for e in body))
        sub = Jaxpr([jaxpr.constvars[i] for i in c_idx], [params[i] for i in p_idx] + ins, outs, body, effects,
                    DebugInfo("mpmd.split", f"stage {s} of {num_stages}", None, None))
        progs.append(_Program(sub, [consts[i] for i in c_idx], p_idx, tuple(_spec_of(v) for v in ins),
                              out_tree if s == num_stages - 1 else None))
    return progs


def _ordered(live: dict, marked: list, order: dict) -> list[Var]:
    """The values crossing one boundary: the marked activation first, then by definition."""
    return sorted(live, key=lambda v: (v not in marked, order[v], marked.index(v) if v in marked else 0))


def _inline_marked_calls(jaxpr: Jaxpr, consts) -> tuple[Jaxpr, list]:
    """Inline every jit-like call whose body holds a mark; reject marks in control flow."""
    constvars, consts = list(jaxpr.constvars), list(consts)
    subst: dict = {}               # outer var -> the inlined value it now names
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
        inner, inner_consts = _inline_marked_calls(*((body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr)
                                                      else (body, [])))
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
    return Jaxpr(constvars, jaxpr.invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info), consts


def _dead_code_removed(jaxpr: Jaxpr) -> Jaxpr:
    """Drop equations whose results are never used (a mark on a discarded value cuts nothing)."""
    used = {a for a in jaxpr.outvars if _is_var(a)}
    kept = []
    for e in reversed(jaxpr.eqns):
        if e.effects or any(v in used for v in e.outvars):
            kept.append(e)
            used.update(a for a in e.invars if _is_var(a))
    return Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, kept[::-1], jaxpr.effects, jaxpr.debug_info)


def _num_marks(jaxpr: Jaxpr) -> int:
    return sum((e.primitive is _boundary_p) + sum(_num_marks(j) for j in jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def _nested_error(name: str) -> str:
    if name == "cond":
        return "stage_boundary inside lax.cond is not supported: a stage cannot end in only one branch"
    if name in ("scan", "while"):
        return (f"stage_boundary inside lax.{'scan' if name == 'scan' else 'while_loop/fori_loop'} is not "
                f"supported: a stage must end exactly once per step; loop in Python to mark inside the loop")
    return f"stage_boundary inside {name} is not supported: move the mark outside it"


def _key(spec_tree):
    return jax.tree.structure(spec_tree), tuple(jax.tree.leaves(spec_tree))


def _is_var(a) -> bool:
    return not isinstance(a, Literal)


def _sub(mapping: dict, a):
    return mapping.get(a, a) if _is_var(a) else a


def _spec_of(v: Var) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
