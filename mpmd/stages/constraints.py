"""Sharding constraints inside a stage program, by logical axis names:

    y = mpmd.constrain(x, "batch", "expert", None, None)    # one name (or None) per dimension

lays `x` out on the slice's mesh as the names say, so that XLA moves data there (an
all-to-all when a dimension's mesh axis moves to another dimension: models/moe.py sends each
group of tokens to its experts' devices this way). A name maps through the rules of the
Trainer (mpmd/stages/sharding.py RULES and `rules=`), except "batch", which takes the batch
axes (data, fsdp, expert) that no other dimension of the same array takes, as many as divide
it. A dimension its mesh axes do not divide, or a name mapped to a size-1 axis, is left
replicated: a constraint is a layout hint, it never changes the math.

Outside a stage program being lowered (the unpipelined model, cost estimates, eval_shape)
`constrain` returns `x` as it is. The lowering (mpmd/lowering/core.py) traces each stage's
programs inside `laid_out_on(its slice's mesh, the rules)`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from mpmd.stages import sharding

BATCH_NAME = "batch"

_active = threading.local()


@contextlib.contextmanager
def laid_out_on(mesh: sharding.SliceMesh, rules: Mapping | None):
    """Inside the block, mpmd.constrain lays arrays out on `mesh` by `rules` (RULES updated)."""
    before = getattr(_active, "layout", None)
    _active.layout = (mesh, {**sharding.RULES, **(rules or {})})
    try:
        yield
    finally:
        _active.layout = before


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """`x` laid out by one logical axis name (or None: replicated) per dimension (module doc)."""
    if len(names) != jax.numpy.ndim(x):
        raise ValueError(
            f"mpmd.constrain takes one logical axis name (or None) per dimension: "
            f"{len(names)} name(s) {names} for an array of shape {jax.numpy.shape(x)}"
        )
    layout = getattr(_active, "layout", None)
    if layout is None:
        return x
    mesh, rules = layout
    spec = activation_layout(names, jax.numpy.shape(x), mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh.abstract(), spec))


def activation_layout(names, shape, mesh: sharding.SliceMesh, rules: Mapping) -> P:
    """The PartitionSpec of `names` over `shape` on `mesh` (module doc): named dimensions
    first, then "batch" dimensions over the batch axes left."""
    for name in names:
        if name is not None and name != BATCH_NAME and name not in rules:
            raise ValueError(
                f"mpmd.constrain: logical axis {name!r} has no rule; known: {sorted(rules) + [BATCH_NAME]}"
            )
    spec: list = [None] * len(shape)
    used: set = set()

    def take(i, candidates):
        axes = []
        for a in candidates:
            size = getattr(mesh, a)
            if size > 1 and a not in used and shape[i] % (math.prod(getattr(mesh, b) for b in axes) * size) == 0:
                axes.append(a)
        used.update(axes)
        spec[i] = None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

    for i, name in enumerate(names):
        if name is not None and name != BATCH_NAME:
            target = rules[name]
            take(i, () if target is None else (target,) if isinstance(target, str) else tuple(target))
    for i, name in enumerate(names):
        if name == BATCH_NAME:
            take(i, sharding.BATCH)
    return P(*spec)


def each_laid_out(stages, meshes, rules):
    """Yield each (k, stage) of `stages` with laid_out_on(meshes[k], rules) in force while the
    caller's loop body for it runs (the lowering traces a stage's programs in that body)."""
    for k, stage in stages:
        with laid_out_on(meshes[k], rules):
            yield k, stage
