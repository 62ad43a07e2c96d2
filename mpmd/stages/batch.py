"""A batch, as the pipeline takes it: a dict of arrays with the global batch on axis 0.

    trainer.step({"inputs": tokens, "targets": labels, "mask": mask, "positions": pos})
    trainer.step(tokens, labels)           # shorthand: {"inputs": tokens, "targets": labels}

Every key is cut into the same microbatches along axis 0, and each goes only where it is read:
- `inputs` is the first stage's positional input;
- a keyword-only parameter of a stage's `__call__` (`def __call__(self, x, *, positions)`)
  names a key fed to that stage's slice directly (a side input), never through the stages
  before it;
- the loss reads the rest: `loss_fn(outputs, batch)` gets the microbatch's dict (for the
  shorthand, `loss_fn(outputs, targets)` as before). Only the keys it reads are sent, found by
  tracing it; a key nobody reads is not sent at all.

The loss returns a scalar (the microbatch's mean: the step's loss is the mean over
microbatches) or a pair `(loss_sum, weight)`: then the step's objective is
sum(loss_sum) / sum(weight) over every microbatch (and every data-parallel shard), the
unpipelined model's weighted mean over the whole batch whatever the microbatch count. The
weight must depend on the batch only (a count of real tokens: `mask.sum()`), not on the
outputs, so the step's total weight is known before any forward runs.

`plan` turns one microbatch's specs into a BatchPlan: what the lowering builds programs from
and the dispatcher cuts feeds by.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from mpmd.stages.specs import describe

INPUTS, TARGETS = "inputs", "targets"


class BatchPlan(NamedTuple):
    """Where the keys of one microbatch go, and the loss as the programs call it."""

    inputs: Any  # specs entering the first stage
    targets: Any  # specs the loss reads: the targets (shorthand) or {key: spec}
    side: tuple  # per stage: {key: spec} of its side inputs, or None
    loss_fn: Callable  # loss(outputs, targets) as the last stage's programs call it
    weighted: bool  # the loss returns (loss_sum, weight)
    pair: bool  # given as step(inputs, targets)
    loss_keys: tuple  # the batch keys in `targets` (shorthand: ("targets",))

    @property
    def side_keys(self) -> tuple:
        """Per stage, the batch keys fed to it as side inputs."""
        return tuple(tuple(s) if s else () for s in self.side)


def as_batch(batch, targets=None, *, what: str = "step") -> tuple[dict, bool]:
    """(batch dict, given as a pair): `what(batch)` with a dict, or `what(inputs, targets)`."""
    if targets is not None:
        if isinstance(batch, dict) and INPUTS in batch:
            raise ValueError(
                f"{what}(batch, targets): give either one batch dict (with the targets as one "
                f"of its keys) or inputs and targets, not a batch dict and targets"
            )
        return {INPUTS: batch, TARGETS: targets}, True
    if not isinstance(batch, dict) or INPUTS not in batch:
        got = f"a dict with keys {sorted(map(str, batch))}" if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(
            f"{what} takes a batch dict with an 'inputs' key (the first stage's input; other keys "
            f"are side inputs and what the loss reads), or {what}(inputs, targets); got {got}"
        )
    bad = [k for k in batch if not isinstance(k, str)]
    if bad:
        raise ValueError(f"batch keys must be strings, got {bad!r}")
    return dict(batch), False


def micro_specs(batch: dict, num_microbatches: int) -> dict:
    """{key: specs of one microbatch}; ValueError naming a key whose leaves do not have the
    batch on axis 0, or a batch that num_microbatches does not divide."""
    m = num_microbatches
    sizes = {}
    for key, value in batch.items():
        for leaf in jax.tree.leaves(value):
            sizes.setdefault(key, set()).add(jnp.shape(leaf)[0] if jnp.ndim(leaf) else None)
    inputs = sizes.get(INPUTS, set())
    if len(inputs) != 1 or None in inputs:
        raise ValueError(
            f"batch['inputs'] must have the global batch on axis 0 of every leaf, got leading "
            f"sizes {sorted(map(str, inputs))}"
        )
    (size,) = inputs
    for key, got in sizes.items():
        if got != {size}:
            raise ValueError(
                f"batch[{key!r}] must have the global batch ({size}, as batch['inputs']) on axis 0 "
                f"of every leaf, got leading sizes {sorted(map(str, got))}: every key is cut into "
                f"the same microbatches"
            )
    if size % m:
        ok = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"batch size {size} is not divisible by num_microbatches={m}; allowed num_microbatches for this batch: {ok}"
        )
    micro = lambda x: jax.ShapeDtypeStruct((size // m,) + jnp.shape(x)[1:], jnp.result_type(x))
    return {key: jax.tree.map(micro, value) for key, value in batch.items()}


def plan(pipe, specs: dict, pair: bool) -> BatchPlan:
    """The BatchPlan of one microbatch with these specs ({key: specs}, from micro_specs)."""
    keys = sorted(specs)
    side = []
    for k, fn in enumerate(pipe.fns):
        mine = {}
        for name, required in fn.keywords:
            if name in specs:
                mine[name] = specs[name]
            elif required:
                raise ValueError(
                    f"stage {k} ({type(pipe.stages[k]).__name__}) takes the keyword-only parameter "
                    f"{name!r}, which is no key of the batch; the batch has {keys} (a keyword-only "
                    f"parameter of a stage's __call__ is fed the batch key of its name)"
                )
        side.append(mine or None)
    acts = pipe.activation_specs(specs[INPUTS], side)
    if pair:
        loss, targets, loss_keys = pipe.loss_fn, specs[TARGETS], (TARGETS,)
    else:
        loss, targets, loss_keys = _pruned_loss(pipe.loss_fn, acts[-1], specs)
    out = jax.eval_shape(loss, acts[-1], targets)
    weighted = _is_pair(out)
    if not weighted and jnp.shape(out) != ():
        raise ValueError(
            f"loss_fn must return a scalar (the mean over the microbatch) or a pair "
            f"(loss_sum, weight), got {describe(out)}"
        )
    if weighted:
        _check_weight(loss, acts[-1], targets)
    return BatchPlan(specs[INPUTS], targets, tuple(side), loss, weighted, pair, loss_keys)


def _is_pair(out) -> bool:
    return (
        isinstance(out, (tuple, list))
        and len(out) == 2
        and all(isinstance(o, jax.ShapeDtypeStruct) and o.shape == () for o in out)
    )


def _pruned_loss(loss_fn, y_spec, specs: dict):
    """(loss over the keys it reads, their specs, those keys): `loss_fn(outputs, batch)` traced
    once to find which keys it reads; the others are zeros inside the program (never read)."""
    closed = jax.make_jaxpr(loss_fn)(y_spec, specs)
    jaxpr = closed.jaxpr
    read = {a for e in jaxpr.eqns for a in e.invars if not isinstance(a, Literal)}
    read |= {a for a in jaxpr.outvars if not isinstance(a, Literal)}
    n_y = len(jax.tree.leaves(y_spec))
    batch_vars = jaxpr.invars[n_y:]
    paths = jax.tree_util.tree_flatten_with_path(specs)[0]
    used = sorted({path[0].key for (path, _), v in zip(paths, batch_vars) if v in read})
    unused = {k: v for k, v in specs.items() if k not in used}

    def loss(outputs, given: dict):
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), unused)
        return loss_fn(outputs, {**zeros, **given})

    return loss, {k: specs[k] for k in used}, tuple(used)


def _check_weight(loss, y_spec, targets) -> None:
    """ValueError when a weighted loss's weight depends on the outputs (it must be known from
    the batch before the step's forwards run)."""
    closed = jax.make_jaxpr(lambda y, t: loss(y, t)[1])(y_spec, targets)
    jaxpr = closed.jaxpr
    tainted = set(jaxpr.invars[: len(jax.tree.leaves(y_spec))])
    for e in jaxpr.eqns:
        if any(not isinstance(a, Literal) and a in tainted for a in e.invars):
            tainted.update(e.outvars)
    if any(not isinstance(a, Literal) and a in tainted for a in jaxpr.outvars):
        raise ValueError(
            "loss_fn returns (loss_sum, weight) with a weight that depends on the model's outputs; "
            "the weight must be a function of the batch only (e.g. mask.sum(), the count of real "
            "tokens), so the step's total weight is known before its forwards run"
        )
