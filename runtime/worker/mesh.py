"""A slice's devices as a mesh with the four named axes every stage program is exported for
(the frontend's mpmd/stages/sharding.py decides the shapes and the layouts; the runtime only binds a
shape to its devices). On the wire a shape is {"data": d, "fsdp": f, "tensor": t, "expert": e}
(a missing axis is 1). `expert` came last, after the three the runtime had, so that a shape
written before it, a mapping or a sequence (data, fsdp, tensor), reads as it did."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    import jax

AXES = ("data", "fsdp", "tensor", "expert")
# Left out of a mesh's description when 1, so the meshes of models without experts (and the
# layouts their checkpoints record) are described as before the axis existed.
_QUIET_WHEN_1 = ("expert",)


def shape_of(shape) -> tuple[int, ...]:
    """(data, fsdp, tensor, expert) from a mapping (missing axes: 1) or a sequence of three or
    four sizes in that order (expert 1 when left out); ValueError naming what is wrong."""
    if isinstance(shape, Mapping):
        unknown = sorted(set(shape) - set(AXES))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown[0]!r}; allowed: {', '.join(AXES)}")
        sizes = tuple(shape.get(a, 1) for a in AXES)
    else:
        sizes = tuple(shape)
        sizes = sizes + (1,) if len(sizes) == len(AXES) - 1 else sizes
    if len(sizes) != len(AXES) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        raise ValueError(f"a mesh shape is a positive size for each of {', '.join(AXES)}, got {shape!r:.100}")
    return sizes


def describe(shape) -> str:
    """'data=2 x fsdp=1 x tensor=1 x expert=2' (expert left out when 1)."""
    return " x ".join(f"{a}={n}" for a, n in zip(AXES, shape_of(shape)) if n != 1 or a not in _QUIET_WHEN_1)


def devices_problem(shape, devices: int, has: str) -> str | None:
    """None when the mesh of `shape` is `devices` devices, as a slice's mesh must be (each of
    its devices once); else 'data=1 x fsdp=1 x tensor=3 = 3 devices, but <has>: the axes'
    product must equal it'. The one rule that the config (before JAX is imported), the
    Trainer (mpmd.stages.sharding.slice_meshes) and a worker binding its mesh apply."""
    sizes = shape_of(shape)
    product = math.prod(sizes)
    if product == devices:
        return None
    return f"{describe(sizes)} = {product} devices, but {has}: the axes' product must equal it"


def bind(shape, devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """The mesh of `shape` over exactly these devices, in order."""
    from mpmd.runtime import compat  # here, not above: the config checks a mesh against AXES before JAX is imported

    problem = devices_problem(shape, len(devices), f"this slice has {len(devices)}")
    if problem:
        raise ValueError(f"mesh {problem}")
    return compat.mesh(np.asarray(devices, dtype=object).reshape(shape_of(shape)), AXES)


def bind_all(shapes, devices: Sequence[jax.Device]) -> list[jax.sharding.Mesh]:
    """Each shape bound to its own run of `devices` (slice 0 the first ones, and so on)."""
    sizes = [int(np.prod(shape_of(s))) for s in shapes]
    if len(devices) < sum(sizes):
        raise ValueError(
            f"{len(shapes)} slice(s) of {sizes} device(s) need {sum(sizes)} device(s), {len(devices)} available"
        )
    starts = np.cumsum([0] + sizes)
    return [bind(s, devices[a:b]) for s, a, b in zip(shapes, starts[:-1], starts[1:])]
