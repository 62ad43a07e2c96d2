"""A stage's state as one array per dtype: the pack and unpack programs of the in-memory tier.

A snapshot (mpmd/train/snapshots.py) copies, sends and re-places a stage's whole state:
its parameters, optimizer state and stage state, ~40 arrays per stage at gpt_tiny. One by
one each costs a dispatch, a transfer entry and a re-placement on the receiver (~150 us
each in reshard.assemble on CPU). Packed, it is one array per dtype, made by one compiled
program on the slice and taken apart by another on restore.

Layout of a packed array, (D, L) on a slice of D devices, split along axis 0 over every
mesh axis: row d is what device d contributes, the concatenation (leaf by leaf, in bundle
order) of its part of every leaf of that dtype. A leaf's part on a device is its shard
there, flattened; a shard that R devices hold alike (a leaf replicated over mesh axes of
R devices in all) is cut into R equal chunks (zero-padded to a multiple of R), one per
holder, so every byte of the state is packed once and no device packs more than its
share. Packing therefore moves no data between devices (a shard_map of per-device
concatenations); unpacking all-gathers each replicated leaf's chunks over the axes that
replicate it, the one collective it needs. Both are exact copies: bitwise.

The packed array crosses the data plane in D pieces, one per device: each is the shard a
device already holds (reshard.cut, shard to shard; on a gang each process offers its own).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mpmd.runtime.worker import programs
from mpmd.runtime.worker.instructions import Spec
from mpmd.stages import sharding


class Part(NamedTuple):
    """Where one leaf lies in its dtype's packed array."""

    group: int  # index of its dtype's packed array
    offset: int  # first element of its chunk in that array's row
    local: tuple  # shape of its shard on one device
    chunk: int  # elements it takes in every row: ceil(shard size / R)
    replicas: tuple  # the mesh axes (of size > 1) that replicate its shard (R devices in all)


class Packing(NamedTuple):
    """How bundles of arrays (`specs`: per bundle, a Spec per array) pack on a slice of
    shape `mesh` (sharding.SliceMesh)."""

    mesh: sharding.SliceMesh
    specs: tuple  # per bundle: Spec per array
    dtypes: tuple  # per packed array: its dtype, in order of first appearance
    parts: tuple  # per bundle: Part per array
    lengths: tuple  # per packed array: L, elements per row

    @property
    def packed_specs(self) -> tuple[Spec, ...]:
        """The packed bundle: one (D, L) array per dtype, split along axis 0 over the mesh."""
        return tuple(Spec((self.mesh.size, n), d, (sharding.AXES,)) for d, n in zip(self.dtypes, self.lengths))

    @property
    def pieces(self) -> tuple[int, ...]:
        """Pieces per packed array on the wire: one per device (each a shard its device holds)."""
        return (self.mesh.size,) * len(self.dtypes)


def packing(specs, mesh: sharding.SliceMesh) -> Packing:
    """The packing of bundles with these specs (per bundle, a tuple of Specs) on `mesh`."""
    sizes = dict(zip(sharding.AXES, mesh))
    dtypes: list[str] = []
    lengths: list[int] = []
    parts = []
    for bundle in specs:
        bundle_parts = []
        for s in bundle:
            used = {a for entry in s.layout for a in _axes(entry)}
            ways = [
                math.prod(sizes[a] for a in _axes(entry))
                for entry in tuple(s.layout) + (None,) * (len(s.shape) - len(s.layout))
            ]
            assert all(n % w == 0 for n, w in zip(s.shape, ways)), ("layouts divide their dims", s, mesh)
            local = tuple(n // w for n, w in zip(s.shape, ways))
            replicas = tuple(a for a in sharding.AXES if a not in used and sizes[a] > 1)
            chunk = -(-math.prod(local) // math.prod(sizes[a] for a in replicas))
            dtype = str(jnp.dtype(s.dtype))
            if dtype not in dtypes:
                dtypes.append(dtype)
                lengths.append(0)
            g = dtypes.index(dtype)
            bundle_parts.append(Part(g, lengths[g], local, chunk, replicas))
            lengths[g] += chunk
        parts.append(tuple(bundle_parts))
    return Packing(mesh, tuple(tuple(b) for b in specs), tuple(dtypes), tuple(parts), tuple(lengths))


def _axes(entry) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _replica_index(p: Part, sizes: dict):
    """This device's index among the R devices that hold the same shard (row-major over
    `p.replicas`, the order all_gather concatenates in)."""
    index = 0
    for a in p.replicas:
        index = index * sizes[a] + jax.lax.axis_index(a)
    return index


def _shard_map(fn, plan: Packing, in_specs, out_specs):
    mesh = plan.mesh.abstract()
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _leaf_specs(plan: Packing):
    return tuple(tuple(PartitionSpec(*s.layout) for s in bundle) for bundle in plan.specs)


def pack_fn(plan: Packing):
    """fn(*bundles) -> (packed bundle,): per device, the concatenation of its parts."""
    sizes = dict(zip(sharding.AXES, plan.mesh))

    def per_device(*bundles):
        rows = [[] for _ in plan.dtypes]
        for bundle, parts in zip(bundles, plan.parts):
            for x, p in zip(bundle, parts):
                if x.size == 0:  # nothing to carry (see unpack_fn)
                    continue
                flat = x.reshape(-1)
                if p.replicas and p.chunk:
                    r = math.prod(sizes[a] for a in p.replicas)
                    flat = jnp.pad(flat, (0, p.chunk * r - flat.size))
                    flat = jax.lax.dynamic_slice(flat, (_replica_index(p, sizes) * p.chunk,), (p.chunk,))
                rows[p.group].append(flat)
        return (
            tuple(
                jnp.concatenate(row).reshape(1, -1) if row else jnp.zeros((1, 0), d)
                for row, d in zip(rows, plan.dtypes)
            ),
        )

    packed = tuple(PartitionSpec(sharding.AXES) for _ in plan.dtypes)
    return _shard_map(per_device, plan, _leaf_specs(plan), (packed,))


def unpack_fn(plan: Packing):
    """fn(packed bundle) -> bundles: the inverse of pack_fn."""

    def per_device(packed):
        out = []
        for parts in plan.parts:
            bundle = []
            for p in parts:
                if math.prod(p.local) == 0:
                    # An empty leaf is made, not sliced: jaxlib 0.11.2's XLA:CPU crashed
                    # (SIGSEGV) compiling a multi-device pack/unpack that carried one.
                    bundle.append(jnp.zeros(p.local, plan.dtypes[p.group]))
                    continue
                flat = packed[p.group][0, p.offset : p.offset + p.chunk]
                if p.replicas and p.chunk:  # (an empty leaf has nothing to gather)
                    flat = jax.lax.all_gather(flat, p.replicas, tiled=True)[: math.prod(p.local)]
                bundle.append(flat.reshape(p.local))
            out.append(tuple(bundle))
        return tuple(out)

    packed = tuple(PartitionSpec(sharding.AXES) for _ in plan.dtypes)
    return _shard_map(per_device, plan, (packed,), _leaf_specs(plan))


def _abstract(specs, mesh: sharding.SliceMesh) -> tuple:
    abstract = mesh.abstract()
    return tuple(
        jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype), sharding=NamedSharding(abstract, PartitionSpec(*s.layout)))
        for s in specs
    )


def exported(plan: Packing) -> tuple[programs.ProgramSpec, programs.ProgramSpec]:
    """(pack, unpack) exported for a slice of the packing's mesh shape."""
    abstract = plan.mesh.abstract()
    shard = lambda s: NamedSharding(abstract, PartitionSpec(*s.layout))
    pack = programs.exported(
        pack_fn(plan),
        *(_abstract(b, plan.mesh) for b in plan.specs),
        out_shardings=(tuple(shard(s) for s in plan.packed_specs),),
    )
    unpack = programs.exported(
        unpack_fn(plan),
        _abstract(plan.packed_specs, plan.mesh),
        out_shardings=tuple(tuple(shard(s) for s in b) for b in plan.specs),
    )
    return pack, unpack
