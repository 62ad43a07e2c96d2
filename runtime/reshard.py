"""Moving an array between two slices whose meshes differ: cut it into pieces on the sender,
put the pieces together in the receiver's layout.

A transfer moves `n` pieces per array: equal parts along axis 0 (n = 1: the whole array).
The plan chooses n as the number of batch shards the array has on the *sender* (the
Send's and Recv's `pieces`), so cutting costs nothing there: each piece is a shard the
sender already holds, offered from the device that holds it. A replicated array, or one
split along other axes, travels whole (n = 1): a sender whose array is split along another
axis gathers it onto one device first (one on-host copy of the array).

The receiver lands each piece on a device of its own that needs rows of it and builds its
layout from the pieces (see assemble): shard to shard where the layouts match; otherwise one
on-host resharding copy (finer or coarser batch splits, replication over `tensor`, splits
along other axes). Every byte crosses between slices once; what resharding costs beyond
that stays inside the receiving host.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def cut(a: jax.Array, n: int) -> list[jax.Array]:
    """`a` as n single-device arrays, the equal parts of its axis 0 in order."""
    if n <= 1 or a.ndim == 0:
        return [_whole(a)]
    rows = a.shape[0] // n
    assert rows * n == a.shape[0], (a.shape, n)
    by_rows = {}
    for shard in a.addressable_shards:
        if _covers_rest(shard.index, a.shape):
            start = shard.index[0].start or 0
            by_rows.setdefault((start, shard.data.shape[0]), shard.data)
    out = []
    for i in range(n):
        piece = by_rows.get((i * rows, rows))
        if piece is None:   # the sender's shards do not line up with the pieces: slice it
            piece = jax.device_put(a[i * rows:(i + 1) * rows], _device_of_row(a, i * rows))
        out.append(piece)
    return out


def landing(spec_shape, layout: tuple, mesh: jax.sharding.Mesh, n: int) -> list[jax.Device]:
    """Where each of n pieces should land: a device whose shard is exactly that piece if
    there is one, else one that needs rows of it; distinct devices while there are enough,
    so the receiver can finish with one resharding copy (see assemble)."""
    if n <= 1:
        return [mesh.devices.flat[0]]
    shape = tuple(spec_shape)
    where = NamedSharding(mesh, PartitionSpec(*layout)).devices_indices_map(shape)
    rows = shape[0] // n
    used: set = set()
    out = []
    for i in range(n):
        lo, hi = i * rows, (i + 1) * rows
        exact = [d for d, idx in where.items() if _rows(idx, shape) == (lo, hi) and _covers_rest(idx, shape)]
        needs = [d for d, idx in where.items() if _rows(idx, shape)[0] < hi and lo < _rows(idx, shape)[1]]
        choice = next((d for group in (exact, needs, list(mesh.devices.flat)) for d in group if d not in used),
                      (needs or exact or [mesh.devices.flat[0]])[0])
        used.add(choice)
        out.append(choice)
    return out


def assemble(pieces: list[jax.Array], shape, layout: tuple, mesh: jax.sharding.Mesh) -> jax.Array:
    """The array of `shape` laid out as `layout` on `mesh`, from its pieces along axis 0.

    Shard to shard when every device's shard is one piece (replicas copy it on-host).
    Otherwise, with the pieces on distinct devices, they are first viewed as one array split
    along axis 0 over those devices and resharded by one jax.device_put (XLA's copies, not
    op-by-op slicing); with fewer devices than pieces, each shard is cut and concatenated
    from the pieces it overlaps."""
    shape = tuple(shape)
    target = NamedSharding(mesh, PartitionSpec(*layout))
    if len(pieces) == 1:
        return jax.device_put(pieces[0], target)
    rows = shape[0] // len(pieces)
    where = target.addressable_devices_indices_map(shape)
    if all(_is_piece(idx, shape, rows) for idx in where.values()):
        return jax.make_array_from_single_device_arrays(
            shape, target, [jax.device_put(pieces[_rows(idx, shape)[0] // rows], d) for d, idx in where.items()])
    holders = [next(iter(p.devices())) for p in pieces]
    if len(set(holders)) == len(pieces):
        split = NamedSharding(jax.sharding.Mesh(np.asarray(holders, dtype=object), ("pieces",)), PartitionSpec("pieces"))
        return jax.device_put(jax.make_array_from_single_device_arrays(shape, split, pieces), target)
    shards = []
    for device, index in where.items():
        lo, hi = _rows(index, shape)
        parts = []
        for i in range(lo // rows, -(-hi // rows)):
            p = pieces[i]
            a, b = max(lo, i * rows) - i * rows, min(hi, (i + 1) * rows) - i * rows
            parts.append(jax.device_put(p if (a, b) == (0, rows) else p[a:b], device))
        block = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        if not _covers_rest(index, shape):
            block = block[(slice(None),) + tuple(index[1:])]
        shards.append(block)
    return jax.make_array_from_single_device_arrays(shape, target, shards)


def _whole(a: jax.Array) -> jax.Array:
    """`a` on one device: itself, or a replica it already holds, or gathered onto its first device."""
    if len(a.sharding.device_set) == 1:
        return a
    if a.sharding.is_fully_replicated:
        return a.addressable_shards[0].data
    return jax.device_put(a, jax.sharding.SingleDeviceSharding(a.addressable_shards[0].device))


def _rows(index: tuple, shape) -> tuple[int, int]:
    s = index[0] if index else slice(None)
    lo, hi, _ = s.indices(shape[0])
    return lo, hi


def _is_piece(index: tuple, shape, rows: int) -> bool:
    """Whether a shard index is exactly one of the pieces of `rows` rows each."""
    lo, hi = _rows(index, shape)
    return hi - lo == rows and lo % rows == 0 and _covers_rest(index, shape)


def _covers_rest(index: tuple, shape) -> bool:
    """Whether a shard index spans every dim but axis 0 whole."""
    return all(s.indices(n)[:2] == (0, n) for s, n in zip(index[1:], shape[1:]))


def _device_of_row(a: jax.Array, row: int) -> jax.Device:
    for shard in a.addressable_shards:
        lo, hi = _rows(shard.index, a.shape)
        if lo <= row < hi:
            return shard.device
    return a.addressable_shards[0].device

