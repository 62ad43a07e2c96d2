"""Abstract values of pytrees: `spec` gives an array's shape and dtype without its data
(what tracing, cost analysis and shape checks take), `describe` a short text of a pytree's
leaves for error messages ("float32[8, 16], int32[8]")."""

from __future__ import annotations

import jax


def spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x))


def describe(tree) -> str:
    return ", ".join(f"{l.dtype}{list(l.shape)}" for l in jax.tree.leaves(tree))
