"""Weight gradients kept unreduced over a slice's batch axes until the step's end.

On a slice whose mesh splits each microbatch N = data x fsdp ways, a backward program that
returns its weight gradient in the parameter's own layout makes XLA all-reduce it over
`data` (and reduce-scatter it over `fsdp`) inside that program: m reductions per stage and
step, where gradient accumulation needs one. Instead, a stage's programs work per batch
group: the microbatch (B rows) is viewed as N groups of B/N rows, dimension 0 of
size N laid out over the batch axes, so group n is device n's own rows, and the stage is
vmapped over it. Its weight gradient then has a leading group dimension, (N, *shape), one
partial sum per device (the "partial layout": P(batch axes, the parameter's layout with
data and fsdp taken out)), computed and accumulated with no communication at all. Once the
stage's last gradient task has run, reduce{k} sums the N partials into the parameter's
layout: one all-reduce over data / reduce-scatter over fsdp per step, over the partials
packed into a buffer per dtype and layout (`reduced`), before the shared-weight exchange,
the clipping norm and the update, which see the reduced gradient as before.

The loss stays global: the last stage vmaps its layers only, joins the groups' outputs
into the microbatch's output and applies the loss to that, so any loss (a masked mean, a
weighted loss) means what it means unpipelined; its cotangent is split into the groups.

What it needs of a stage (`problem` says which is missing; the stage then keeps the
per-microbatch reduction, exact as before):
- every activation, side input and output leaf has the batch on axis 0, divisible by N
  (then each group's rows are independent of the others' rows);
- no stage state and no auxiliary losses: batch statistics and balancing losses are
  statistics over the whole microbatch, which a group alone does not see.
- a slice without an expert axis (mesh.expert = 1): expert-parallel slices keep the
  per-microbatch reduction for now.
Cost: a partial gradient is the whole parameter per device (fsdp's gradient sharding
waits until reduce{k}), and a residual that does not depend on the batch (a weight cast
to another dtype) is stored once per group.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from mpmd.stages import gather
from mpmd.stages.sharding import BATCH, SliceMesh


def batch_axes(mesh: SliceMesh) -> tuple[str, ...]:
    """The mesh axes a microbatch is split over (those of size > 1), as batch_layout names them."""
    return tuple(a for a in BATCH if getattr(mesh, a) > 1)


def partial_layout(param_layout: P, mesh: SliceMesh) -> P:
    """Where a parameter's partial gradients lie: dim 0 (the groups) over the batch axes,
    the parameter's own dims as its layout with the batch axes taken out (they are whole
    on each device until reduced)."""

    def without_batch(entry):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in names if a not in BATCH)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(batch_axes(mesh), *(without_batch(e) for e in tuple(param_layout)))


def partial_specs(param_specs: Sequence[jax.ShapeDtypeStruct], mesh: SliceMesh) -> tuple:
    """The partial gradients' specs, (N, *shape) each, laid out on the slice's mesh."""
    n, abstract = mesh.batch_ways, mesh.abstract()
    return tuple(
        jax.ShapeDtypeStruct(
            (n, *s.shape), s.dtype, sharding=NamedSharding(abstract, partial_layout(s.sharding.spec, mesh))
        )
        for s in param_specs
    )


def problem(mesh: SliceMesh, batch_leaves: Sequence, state: bool, aux: bool) -> str | None:
    """Why a stage cannot keep its gradients unreduced on `mesh` (None: it can; so can't a
    slice whose microbatch is not split). `batch_leaves`: every activation, side input and
    output leaf of the stage (shapes)."""
    n = mesh.batch_ways
    if n == 1:
        return "its slice does not split the microbatch"
    if state:
        return "it carries stage state (statistics over the whole microbatch)"
    if aux:
        return "it adds auxiliary losses (statistics over the whole microbatch)"
    if mesh.expert > 1:
        # A mixture's experts lie along `expert` and its tokens are laid out by mpmd.constrain
        # inside the program: a per-group vmap of that is not built (nor measured) yet.
        return "its slice splits experts (mesh.expert > 1)"
    for leaf in batch_leaves:
        if len(leaf.shape) == 0 or leaf.shape[0] % n:
            return f"a {tuple(leaf.shape)} leaf it takes or gives has no batch axis 0 divisible by {n}"
    return None


def split(tree, n: int):
    """Every leaf (B, ...) viewed as (n, B/n, ...): group g is rows g*B/n .. (g+1)*B/n - 1,
    the rows device g holds of a batch-split array."""
    return jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), tree)


def per_device(stored, mesh: SliceMesh, params: Sequence) -> tuple:
    """The residuals a grouped forward stores, (n, ...) each, laid out group g on device g.
    Left to XLA, a residual that does not depend on the batch (an attention mask broadcast
    to the heads, vmap's copy of it for each group) came out replicated: every device held
    every group's copy (benchmarks/bench_mesh.py's GPT on data=2: 11.41 MiB a microbatch on
    each device for stage 0, 10.78 MiB laid out). The other dims stay XLA's to choose (a
    tensor-split residual keeps its split). Left as XLA lays them when the program takes
    weights split over fsdp (`params`' layouts; mesh.fsdp_gather per_microbatch): there a
    residual made from such a weight (a norm's scale) cost one more all-gather of it in
    every forward, next to the one its compute does."""
    if any(gather.sharded(p.sharding.spec) for p in params):
        return tuple(stored)
    abstract, axes = mesh.abstract(), batch_axes(mesh)
    return tuple(
        jax.lax.with_sharding_constraint(a, NamedSharding(abstract, P(axes, *[P.UNCONSTRAINED] * (a.ndim - 1))))
        for a in stored
    )


def join(tree):
    """The inverse of split: (n, b, ...) -> (n*b, ...)."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


def reduced(partials, layouts: Sequence[P] | None = None, mesh: SliceMesh | None = None) -> tuple:
    """The gradients from their partials: the sum over the groups, in group order.

    With the parameters' `layouts` on `mesh`, the partials that land alike are summed as one
    buffer (`pack_key`): XLA combines a program's reductions into one op over a tuple, but
    a CPU gang's gloo runs that op one array at a time, each a round trip between processes
    (35 arrays of a tiny GPT's stage: 140 ms, against 4 ms for the same bytes in one array;
    benchmarks/bench_gang.py). Each element's sum is the same either way."""
    if layouts is None:
        return tuple(jnp.sum(g, axis=0) for g in partials)
    out: list = [None] * len(partials)
    groups: dict = {}
    for i, (g, lay) in enumerate(zip(partials, layouts)):
        key = pack_key(g.shape[1:], g.dtype, lay, mesh)
        if key is None:
            out[i] = jnp.sum(g, axis=0)
        else:
            groups.setdefault(key[:3], []).append((i, key[3]))
    for (_, entry, ways), members in groups.items():
        if len(members) == 1:
            out[members[0][0]] = jnp.sum(partials[members[0][0]], axis=0)
            continue
        # (N, *shape) -> (N, ways, size / ways), the split dim first: row block w is what
        # device w of the layout's axes keeps; concatenated along the last dim, summed over
        # the groups into the layout (entry, None), then cut apart and put back in shape.
        flat = jnp.concatenate(
            [jnp.moveaxis(partials[i], 1 + dim, 1).reshape(partials[i].shape[0], ways, -1) for i, dim in members],
            axis=2,
        )
        total = jax.lax.with_sharding_constraint(jnp.sum(flat, axis=0), NamedSharding(mesh.abstract(), P(entry, None)))
        at = 0
        for i, dim in members:
            shape = partials[i].shape[1:]
            moved = (shape[dim], *shape[:dim], *shape[dim + 1 :])
            width = math.prod(shape) // ways
            out[i] = jnp.moveaxis(total[:, at : at + width].reshape(moved), 0, dim)
            at += width
    return tuple(out)


def pack_key(shape: tuple, dtype, layout: P, mesh: SliceMesh):
    """Which one buffer a parameter's partials are reduced in (`reduced`): those of one dtype
    whose layout splits one dim at most, over the same axes, share one (the key's first three
    entries; the last is the dim split); None for a 0-d parameter or one split along two
    dims, reduced on its own."""
    split = [(d, e) for d, e in enumerate(tuple(layout)) if e is not None]
    if len(shape) == 0 or len(split) > 1:
        return None
    dim, entry = split[0] if split else (0, None)
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    ways = math.prod(getattr(mesh, a) for a in names)
    return (jnp.dtype(dtype).name, entry, ways, dim if ways > 1 else 0) if shape[dim] % ways == 0 else None
