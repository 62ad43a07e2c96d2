"""FSDP weights gathered once a step instead of once a program (`mesh.fsdp_gather`).

A parameter the rules put on `fsdp` lies in 1/fsdp pieces on its slice. A stage's forward and
backward programs take it in that layout, so XLA all-gathers it inside each of them: every
microbatch's forward gathers the stage's weights, and so does its backward (each of B and W
in a split backward), 2m or 3m gathers of the same bytes per step. MaxText calls the
alternative `pipeline_fsdp_ag_once`; here it is

    per_microbatch   (the default) the programs take p{k} as laid out, and gather inside;
    per_step         gather{k} runs before the stage's first forward of the step and writes
                     pg{k}: every leaf of p{k} with fsdp taken out of its layout (whole over
                     fsdp, still split over tensor and expert); the forward and backward
                     programs take pg{k}; the slice deletes it after its last use, the stage's
                     last gradient task.

Only where it gathers changes: the same values enter the same computations, so the results
equal per_microbatch's to rounding (XLA may fuse the gathered weight differently). The weight
gradient still leaves each backward in the parameter's own layout, or as a partial reduced
once by reduce{k} (mpmd/stages/partials.py): gathering changes nothing on the way back.

Cost: pg{k} holds the stage's weights whole over fsdp from its first forward to its last
gradient task: fsdp x the sharded leaves' bytes over the fsdp devices of a slice, beside
p{k} (leaves not on fsdp are copied as they are, so one bundle serves every program).
mpmd.stages.costs.memory counts it ("gathered"), mpmd.schedules.simulate.peak_saved_bytes
holds it for that span, and the dry run shows it.

A slice without fsdp > 1 (or a stage none of whose leaves the rules put on fsdp) has nothing
to gather: per_step is refused there with the reason (`problem`), since a setting that does
nothing would read as a setting that does something.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from mpmd.runtime.worker import programs
from mpmd.stages import names

PER_MICROBATCH, PER_STEP = "per_microbatch", "per_step"
MODES = (PER_MICROBATCH, PER_STEP)
AXIS = "fsdp"


def check_mode(mode) -> str:
    """`mode` if it is one of MODES, else ValueError naming what is allowed."""
    if mode not in MODES:
        raise ValueError(f"fsdp_gather must be one of {list(MODES)}, got {mode!r}")
    return mode


def _names(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def sharded(layout: P) -> bool:
    """Whether a parameter of this layout lies in pieces over fsdp."""
    return any(AXIS in _names(e) for e in tuple(layout))


def gathered_layout(layout: P) -> P:
    """The layout with fsdp taken out of every dim (the other axes kept)."""

    def without(entry):
        kept = tuple(a for a in _names(entry) if a != AXIS)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(without(e) for e in tuple(layout)))


def gathers(layouts: Sequence[P], mesh) -> bool:
    """Whether a stage of these parameter layouts has anything to gather on `mesh`."""
    return mesh.fsdp > 1 and any(sharded(l) for l in layouts)


def problem(meshes, layouts_per_stage, placement) -> str | None:
    """Why per_step cannot apply to a run (None: some stage gathers): no slice with fsdp > 1,
    or no parameter the rules put on fsdp."""
    if all(m.fsdp == 1 for m in meshes):
        return (
            "fsdp_gather=per_step gathers FSDP-sharded weights once a step, but no slice "
            "has fsdp > 1: give a slice's mesh fsdp > 1 (mesh.fsdp in a config), or leave "
            "fsdp_gather at per_microbatch"
        )
    if not any(gathers(l, meshes[placement[k]]) for k, l in enumerate(layouts_per_stage)):
        return (
            "fsdp_gather=per_step: no parameter lies on fsdp (the rules map none of the model's "
            "logical axes to fsdp), so there is nothing to gather; leave fsdp_gather at per_microbatch"
        )
    return None


def gathered_specs(param_specs: Sequence[jax.ShapeDtypeStruct]) -> tuple:
    """The specs of pg{k}: each parameter's, laid out without fsdp on the same mesh."""
    return tuple(
        jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=NamedSharding(s.sharding.mesh, gathered_layout(s.sharding.spec))
        )
        for s in param_specs
    )


def build(k: int, param_specs: tuple) -> dict:
    """gather{k}: p{k} -> pg{k}, one all-gather over fsdp per dtype (`gathered`)."""
    out = gathered_specs(param_specs)
    layouts = [s.sharding.spec for s in param_specs]
    mesh = param_specs[0].sharding.mesh

    def gather(params):
        return (gathered(params, layouts, mesh),)

    return {
        names.program("gather", k): programs.exported(
            gather, param_specs, out_shardings=(tuple(s.sharding for s in out),)
        )
    }


def gathered(params: Sequence, layouts: Sequence[P], mesh) -> tuple:
    """`params` (laid out as `layouts` on `mesh`, a Mesh or AbstractMesh) as their gathered
    layouts will hold them. The leaves split along one dim over fsdp alone are gathered as
    one buffer per dtype: each viewed as (fsdp, size / fsdp) with its split dim first, and
    concatenated. XLA would combine their gathers into one tuple-shaped op, but a CPU gang's
    gloo runs that one array at a time, each a round trip between processes (as reduce{k}'s
    sums, mpmd/stages/partials.py). The other leaves are left to the program's
    out_shardings. Moves data only: the same bits either way."""
    ways = mesh.shape[AXIS]
    out = list(params)
    groups: dict = {}
    for i, (p, lay) in enumerate(zip(params, layouts)):
        split = [(d, e) for d, e in enumerate(tuple(lay)) if e is not None]
        if len(split) == 1 and _names(split[0][1]) == (AXIS,):
            groups.setdefault(jnp.dtype(p.dtype).name, []).append((i, split[0][0]))
    for members in groups.values():
        if len(members) == 1:
            continue
        flat = jnp.concatenate([jnp.moveaxis(params[i], d, 0).reshape(ways, -1) for i, d in members], axis=1)
        whole = jax.lax.with_sharding_constraint(flat, NamedSharding(mesh, P()))
        at = 0
        for i, d in members:
            shape = params[i].shape
            width = math.prod(shape) // ways
            moved = (shape[d], *shape[:d], *shape[d + 1 :])
            out[i] = jnp.moveaxis(whole[:, at : at + width].reshape(moved), 0, d)
            at += width
    return tuple(out)
