"""Auxiliary losses: a stage adds a scalar to the objective from inside its `__call__`.

    class MoEBlock(nnx.Module):
        def __call__(self, x):
            y, balance = self.route(x)
            mpmd.add_loss(0.01 * balance)       # a scalar: this microbatch's term
            return y

In a pipeline, each stage's forward collects what it adds; the sum is a second output of the
stage's forward program, differentiated on that stage (its cotangent is the microbatch's
weight in the objective, 1/m: an auxiliary loss is averaged over the step's microbatches, also
when the main loss is token-weighted), and reported as `aux_loss`. Outside a pipeline, collect
them yourself to train the same objective unpipelined:

    with mpmd.collect_losses() as aux:
        out = model(x)
    loss = main_loss(out) + sum(aux)

With no collector active, `add_loss` does nothing (the model runs as it would without mpmd).
"""

from __future__ import annotations

import contextlib
import threading

import jax.numpy as jnp

_active = threading.local()


def add_loss(value) -> None:
    """Add the scalar `value` to the training objective (see the module docstring)."""
    stack = getattr(_active, "stack", None)
    if not stack:
        return
    if jnp.shape(value) != ():
        raise ValueError(
            f"mpmd.add_loss takes a scalar (this microbatch's term of the objective), got shape {jnp.shape(value)}"
        )
    got, on_add = stack[-1]
    got.append(on_add(value))


@contextlib.contextmanager
def collect_losses(on_add=None):
    """Collect what `add_loss` adds inside the block, as a list of scalars; `on_add(value)`,
    when given, is called as each is added and its result kept instead (mpmd/stages/marks.py
    marks where in a traced model each term was added)."""
    stack = _active.__dict__.setdefault("stack", [])
    got: list = []
    stack.append((got, on_add or (lambda value: value)))
    try:
        yield got
    finally:
        stack.pop()


def total(values):
    """The sum of collected terms in the order added, as float32 (None when there are none)."""
    if not values:
        return None
    out = jnp.asarray(values[0], jnp.float32)
    for v in values[1:]:
        out = out + jnp.asarray(v, jnp.float32)
    return out
