"""Split a backward function into its input-gradient part (B) and the rest (W), with no
work done twice: what zero-bubble schedules need from a stage.

    parts = split(backward, args, num_weight_grads)
    dx, kept = parts.input_grad(*args)          # B: input gradients + what W needs of B's work
    dp = parts.weight_grad(*args, *kept)        # W: only the weight gradients' own work

`backward(*args)` returns a flat tuple: the weight gradients first (num_weight_grads of
them), then the input gradients. It is traced once into a jaxpr (for a stage: the
transposed linear map of its vjp, fed the saved residuals and the output cotangent), then:
- calls into nested jaxprs (jit, closed_call, checkpoint, custom_jvp/vjp calls) are inlined,
  so an op inside `jax.nn.gelu` or a remat block belongs to B or W on its own, not the
  whole call. A checkpoint's recomputation then runs once, in B, and what W needs of it
  (the recomputed inputs of each matmul) is kept from B to W: remat still shrinks what
  the forward saves until B, not what B leaves for W (Llama, 1 block + head, remat="block":
  215 KB of residuals, 1.4 MB kept; stage_costs.memory reports both);
- B is that jaxpr dead-code-eliminated for the input gradients alone;
- W is every equation B does not run, dead-code-eliminated for the weight gradients; the
  values B computes that W reads are B's extra outputs, "kept": the cotangents arriving at
  each weight's use (dy of y = x @ w) and anything else both need. Saved inputs (x) are
  residuals already: W reads them from its own arguments.

So B + W runs each equation of the full backward at most once (B + W FLOPs = the full
backward's, up to XLA fusing differently), at the price of holding `kept` from B until W.
Control flow that cannot be inlined (scan, while, cond) is one equation: if B needs part of
it and W another, W runs it again (correct, not free); none of the models here has any.

Uses partial_eval's dce_jaxpr (private in JAX, reached through mpmd.runtime.compat): the
same DCE jax.jit applies, with its rules for every primitive.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Literal, jaxpr_as_fun

from mpmd.runtime import compat
from mpmd.runtime.compat import convert_constvars_jaxpr, dce_jaxpr

# Primitives whose sub-jaxpr is evaluated inline: plain calls whose boundaries only matter
# for differentiation (already done) or compilation (XLA sees one program either way).
_INLINED = {
    *compat.CALL_PRIMITIVES,
    "checkpoint",
    "remat",
    "remat2",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
}


class Split(NamedTuple):
    input_grad: Callable  # (*args) -> (input grads..., kept...)
    weight_grad: Callable  # (*args, *kept) -> weight grads
    num_input_grads: int
    kept: tuple  # ShapeDtypeStructs of what B hands W


def split(backward: Callable, args: tuple, num_weight_grads: int) -> Split:
    """`args`: flat ShapeDtypeStructs (with shardings where the program has them)."""
    closed = jax.make_jaxpr(backward)(*args)
    # Re-trace through an interpreter that inlines calls: one flat jaxpr of primitives.
    flat = jax.make_jaxpr(lambda *a: _inline(closed.jaxpr, closed.consts, a))(*args)
    consts = list(flat.consts)
    jaxpr = convert_constvars_jaxpr(flat.jaxpr)  # constants become leading inputs
    num_in, num_out = len(jaxpr.invars), len(jaxpr.outvars)
    num_dx = num_out - num_weight_grads
    assert num_dx >= 0, (num_out, num_weight_grads)

    # B: only what the input gradients need.
    b, _ = dce_jaxpr(jaxpr, [i >= num_weight_grads for i in range(num_out)], instantiate=True)
    by_b = {v: None for e in b.eqns for v in e.outvars if not isinstance(v, DropVar)}
    # W: every equation whose results B does not all compute (a control-flow equation B ran
    # only in part is run whole again: its outputs cannot be both inputs and results of W).
    rest = [e for e in jaxpr.eqns if not all(isinstance(v, DropVar) or v in by_b for v in e.outvars)]
    redone = {v for e in rest for v in e.outvars}
    offered = [v for v in by_b if v not in redone]
    w_all = jaxpr.replace(invars=jaxpr.invars + offered, outvars=jaxpr.outvars[:num_weight_grads], eqns=rest)
    w, used = dce_jaxpr(w_all, True, instantiate=[True] * num_in + [False] * len(offered))
    kept = [v for v, u in zip(offered, used[num_in:]) if u]
    b, _ = dce_jaxpr(jaxpr.replace(outvars=jaxpr.outvars[num_weight_grads:] + kept), True, instantiate=True)

    run_b, run_w = jaxpr_as_fun(ClosedJaxpr(b, ())), jaxpr_as_fun(ClosedJaxpr(w, ()))
    return Split(
        input_grad=lambda *a: tuple(run_b(*consts, *a)),
        weight_grad=lambda *a: tuple(run_w(*consts, *a)),
        num_input_grads=num_dx,
        kept=tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in kept),
    )


def _inline(jaxpr, consts, args) -> list:
    """Evaluate `jaxpr` as jax.core.eval_jaxpr does, but step into _INLINED calls."""
    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if eqn.primitive.name in _INLINED else None
        if sub is not None:
            outs = _inline(*compat.closed_parts(sub), ins)
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, DropVar))
    return [read(v) for v in jaxpr.outvars]
