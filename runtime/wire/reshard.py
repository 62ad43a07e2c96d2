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

from mpmd.runtime import compat


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
        if piece is None:  # the sender's shards do not line up with the pieces: slice it
            piece = jax.device_put(a[i * rows : (i + 1) * rows], _device_of_row(a, i * rows))
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
        choice = next(
            (d for group in (exact, needs, list(mesh.devices.flat)) for d in group if d not in used),
            (needs or exact or [mesh.devices.flat[0]])[0],
        )
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
            shape, target, [jax.device_put(pieces[_rows(idx, shape)[0] // rows], d) for d, idx in where.items()]
        )
    holders = [next(iter(p.devices())) for p in pieces]
    if len(set(holders)) == len(pieces):
        split = NamedSharding(compat.mesh(np.asarray(holders, dtype=object), ("pieces",)), PartitionSpec("pieces"))
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
    return jax.device_put(a, jax.sharding.make_single_device_sharding(a.addressable_shards[0].device))


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


# -- gangs: a slice whose mesh spans several processes --------------------------------------
# Each piece has one owner on the sending gang, by a rule both ends know without a message:
# piece i of n belongs to sending process i * k // n (k processes). Meshes list process 0's
# devices first, so for a batch split over data x fsdp that is the process whose devices
# already hold piece i (with k = 2: pieces 0..n/2-1 on process 0). The receiving gang lands
# piece i on `landing(...)[i]`, and the process of that device alone pulls it: each piece
# crosses between slices once, from the process that holds it to one that needs it.


def place(host_array, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array laid out as `sharding`. Across a gang's processes (each given the same
    whole array) each process places only its own shards: jax.device_put would first check
    that every process passed the same value, a cross-process exchange that, run from an RPC
    thread while a step runs, pairs up with another thread's and fails or hangs."""
    a = np.asarray(host_array)
    if sharding.is_fully_addressable:
        return jax.device_put(a, sharding)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def owner(i: int, n: int, num_processes: int) -> int:
    """The sending process that offers piece i of n."""
    return i * num_processes // max(n, 1)


def owned_pieces(a: jax.Array, n: int, mesh: jax.sharding.Mesh) -> dict[int, jax.Array]:
    """{piece index: single-device array} of the pieces of `a` (n equal parts of axis 0, or
    the whole array when n <= 1) that this process offers. Shard to shard where every piece's
    owner holds it already. Otherwise `a` is first replicated over the gang: one collective,
    which every process of the gang reaches at the same point of the same stream, decided
    from the global layout so that all decide alike."""
    if a.is_fully_addressable:
        return dict(enumerate(cut(a, n)))
    rank, k = jax.process_index(), jax.process_count()
    if n <= 1 or a.ndim == 0:
        if not a.sharding.is_fully_replicated:
            a = collective(replicated(mesh), a)
        return {0: a.addressable_shards[0].data} if owner(0, 1, k) == rank else {}
    rows = a.shape[0] // n
    held = {}  # (piece, process) -> a device of that process whose shard is that piece
    for d, idx in a.sharding.devices_indices_map(a.shape).items():
        if _is_piece(idx, a.shape, rows):
            held.setdefault((_rows(idx, a.shape)[0] // rows, d.process_index), d)
    if all((i, owner(i, n, k)) in held for i in range(n)):
        by_device = {s.device: s.data for s in a.addressable_shards}
        return {i: by_device[held[(i, rank)]] for i in range(n) if owner(i, n, k) == rank}
    whole = collective(replicated(mesh), a).addressable_shards[0].data
    return {i: whole[i * rows : (i + 1) * rows] for i in range(n) if owner(i, n, k) == rank}


def wanted_here(shape, layout: tuple, mesh: jax.sharding.Mesh, n: int) -> list[tuple[int, jax.Device]]:
    """[(piece, local device to land it on)] for the pieces this process pulls."""
    rank = jax.process_index()
    return [(i, d) for i, d in enumerate(landing(shape, layout, mesh, n)) if d.process_index == rank]


class Deferred:
    """Pieces that landed on this process, to be put together into the slice's arrays by
    `__call__` on the thread that walks the stream: where a layout needs pieces held by
    other processes of the gang that is a collective, and collectives must run in the same
    order on every process (the stream's order), never on a waiting thread."""

    def __init__(self, parts: list[tuple[dict[int, jax.Array], object]], mesh: jax.sharding.Mesh):
        self.parts, self.mesh = parts, mesh  # per array: ({piece: landed array}, (spec, n))

    def __call__(self) -> tuple[jax.Array, ...]:
        return tuple(
            assemble_gang(landed, spec.shape, spec.dtype, spec.layout, self.mesh, n) for landed, (spec, n) in self.parts
        )


def assemble_gang(
    landed: dict[int, jax.Array], shape, dtype, layout: tuple, mesh: jax.sharding.Mesh, n: int
) -> jax.Array:
    """The array of `shape` laid out as `layout` on the gang's `mesh`, from the pieces that
    landed on this process (`landed`: piece -> array). Shard to shard when every device's
    shard is a piece that landed on its own process; otherwise one jitted program over the
    whole mesh moves the pieces where the layout wants them (XLA's collectives inside the
    gang: the bytes cross between slices once, then move only inside the receiving slice)."""
    shape = tuple(shape)
    target = NamedSharding(mesh, PartitionSpec(*layout))
    if not int(np.prod(shape, dtype=np.int64)):
        return place(np.zeros(shape, dtype), target)
    lands = landing(shape, layout, mesh, n)
    rows = shape[0] // n if n > 1 else None
    where = target.devices_indices_map(shape)
    if n > 1 and all(
        _is_piece(idx, shape, rows) and lands[_rows(idx, shape)[0] // rows].process_index == d.process_index
        for d, idx in where.items()
    ):
        return jax.make_array_from_single_device_arrays(
            shape,
            target,
            [
                jax.device_put(landed[_rows(idx, shape)[0] // rows], d)
                for d, idx in target.addressable_devices_indices_map(shape).items()
            ],
        )
    # Each device holds the pieces that landed on it in `depth` slots (zeros where fewer):
    # one array over the whole mesh, split along its stacked axis, that XLA reshapes.
    flat = list(mesh.devices.flat)
    on: dict = {}
    for i, d in enumerate(lands):
        on.setdefault(d, []).append(i)
    depth = max(len(v) for v in on.values())
    slots = tuple(flat.index(d) * depth + on[d].index(i) for i, d in enumerate(lands))
    piece_shape = shape if n <= 1 else (rows,) + shape[1:]
    stacked_sharding = NamedSharding(compat.mesh(np.asarray(flat, dtype=object), ("flat",)), PartitionSpec("flat"))
    local = []
    for d in flat:
        if d.process_index == jax.process_index():
            block = [jax.device_put(landed[i], d) for i in on.get(d, [])]
            block += [jax.device_put(np.zeros(piece_shape, dtype), d)] * (depth - len(block))
            local.append(jnp.stack(block))
    stacked = jax.make_array_from_single_device_arrays((len(flat) * depth,) + piece_shape, stacked_sharding, local)
    return collective(_gather_program(slots, n, target), stacked)


_PROGRAMS: dict = {}


def _gather_program(slots: tuple[int, ...], n: int, target: NamedSharding):
    """A jitted function of the stacked pieces that returns the array in `target`'s layout."""
    key = (slots, n, target)
    if key not in _PROGRAMS:

        def put_together(stacked):
            return stacked[slots[0]] if n <= 1 else jnp.concatenate([stacked[s] for s in slots], axis=0)

        _PROGRAMS[key] = jax.jit(put_together, out_shardings=target)
    return _PROGRAMS[key]


def collective(program, *args):
    """Run one of the runtime's own collective programs over a gang and wait for it. The
    processes of a gang must meet in their collectives in the same order, and XLA:CPU may run
    programs dispatched back to back at the same time (two of these, one per array, paired
    with each other's halves across two processes: gloo's "collective mismatch", seen with
    the in-memory snapshot tier); waiting keeps them one at a time."""
    return jax.block_until_ready(program(*args))


def replicated(mesh: jax.sharding.Mesh):
    """A jitted identity whose result is replicated on every device of `mesh`."""
    key = ("replicate", mesh)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))
    return _PROGRAMS[key]
