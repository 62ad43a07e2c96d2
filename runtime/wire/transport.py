"""Slice-to-slice data plane: `jax.experimental.transfer` between hosts, shared memory on one.

The path is chosen per pair of slices (TransferTransport's `transport`: auto | socket | shm).
Workers on one host move a pair's transfers through shared memory (runtime/wire/shm.py, the
same offer/pull API, keyed ids, authenticated connections); everything else, and everything
below, is the socket path. Callers (the executor) never see which one a transfer took.

Each worker process runs one TransferServer. A send registers its arrays under an id
(`await_pull`) and returns; the receiver pulls that id from the sender's server. Both sides
derive the id from the same plan key and the session's secret (`key_to_uuid`), so they need
no message of their own to agree on it.

Authentication. The transfer server has none: any process that reaches its port can connect
and pull any id, and an entry goes to whoever pulls it first (see the facts below). So the
ids themselves are the credential: a keyed hash of the plan key under a secret that only the
controller and its workers hold (the controller makes one per session and sends it in
Setup). Without the secret an id is a uniform 64-bit guess; a stranger's pull waits in the
table for an id no one will ever offer, takes nothing, and delays no one.

Facts about the API (jaxlib 0.10.2, checked by tests/runtime/test_transport.py and by hand;
the same names and arguments in jaxlib 0.11.2 and 0.12.0.1, see runtime/compat.py):
- `await_pull` never blocks, not even on arrays still being computed; the server holds a
  reference until the data has been pulled.
- `pull` never blocks either: it posts the request and returns arrays that become ready when
  the bytes land. A pull that arrives before its `await_pull` waits in the sender's table
  until the matching `await_pull` is posted, so receives may be posted as early as we like.
- An id is one-shot: the entry is dropped once pulled; a second pull of the same id waits
  for a *new* `await_pull` of that id. Ids only need to be unique among transfers in flight.
- One server serves many pulls at once, from many peers; one connection carries many pulls.
- The `timeout` argument of `pull` (a datetime) does not fire: the pull still waits forever.
  A pull of a zero-size array never completes, so zero-size arrays are not sent at all: the
  receiver makes them.
- A pull fails (instead of hanging) when the peer's process dies (the socket closes) or when
  the peer resets its table (`reset`).
- In a gang (a slice over several processes, runtime/worker/gang.py), each process runs its own
  server; a transfer between gangs moves each piece under an id of its own (the key, the
  array and the piece), offered by the piece's owner and pulled by the process it lands on.
- A server cannot restrict who connects: `start_transfer_server` takes addresses to bind,
  no allowlist, no credential and no TLS; `connect` takes an address only. Bytes cross the
  wire in the clear.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import queue
import threading
from typing import Protocol

import jax
import jax.numpy as jnp

from mpmd.runtime import compat
from mpmd.runtime.compat import transfer
from mpmd.runtime.wire import reshard
from mpmd.runtime.wire import shm
from mpmd.runtime.wire.staging import Staging
from mpmd.runtime.wire.verbs import check_transport

log = logging.getLogger("mpmd.worker")

# Payloads move in chunks of CHUNK_BYTES over NUM_BULK_SOCKETS sockets per connection, so
# copying in and out of the staging buffers overlaps the wire. The API's default chunk
# (256 MB) sends a 64 MB payload as one piece: 67 ms one-way on loopback here, against 48 ms
# with 2 MB x 2 sockets (raw loopback TCP on this machine: ~45 ms). Staging memory per server
# is about CHUNK_BYTES x 8 parallel copies x 3.
CHUNK_BYTES = 2 * 2**20
NUM_BULK_SOCKETS = 2


class Transport(Protocol):
    """What an Executor needs from its data plane: TransferTransport here (between
    processes), MemoryTransport (runtime/control/inprocess.py) between threads. Keys are the
    executor's: "<run id>:<plan key>", e.g. "12:act2/5"."""

    def send(self, key: str, arrays: tuple[jax.Array, ...], dst_slice: int, pieces: tuple[int, ...] = ()) -> None:
        """Offer `arrays` to `dst_slice` under `key`, each cut in its number of `pieces` along
        axis 0 (runtime/wire/reshard.py); returns without waiting for the receiver."""

    def recv(self, key: str, src_slice: int, specs: tuple, pieces: tuple[int, ...] = ()) -> concurrent.futures.Future:
        """Post a receive early; `result()` is a tuple of arrays laid out on this slice's mesh
        as `specs` (mpmd.runtime.worker.instructions.Spec: shape, dtype, layout) say."""

    def close(self) -> None: ...


MIN_SECRET_BYTES = 16


def check_secret(secret) -> bytes:
    """`secret` if it can key transfer ids (16 to 64 bytes: BLAKE2b's key size); a ValueError
    that never echoes it otherwise."""
    if not isinstance(secret, bytes) or not MIN_SECRET_BYTES <= len(secret) <= 64:
        raise ValueError(f"the transfer secret must be {MIN_SECRET_BYTES} to 64 bytes")
    return secret


def key_to_uuid(key: str, secret: bytes) -> int:
    """The transfer id for a transfer key such as "12:act2/5" (the executor's run id, then the
    plan's key: "act2/5", "grad1/3", "sq0/to1", ...) in the session keyed by `secret`: the
    first 64 bits of its keyed BLAKE2b hash (a MAC; the API takes any uint64). Keys are
    predictable, ids are not: without the secret each id is one guess in 2**64.

    Ids share one table per *sending* server and only entries still waiting to be pulled can
    collide. With n such entries, P(any collision) ~ n**2 / 2**65: n = 10**4 gives 3e-12 per
    step. Keys are unique within a plan and the executor prefixes the run id, so a repeated
    id can only come from a hash collision, never from a reused key.
    """
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, key=secret).digest(), "little")


def _counts(pieces: tuple[int, ...], num_arrays: int) -> tuple[int, ...]:
    """Pieces per array: as given, or 1 each when the plan names none."""
    if not pieces:
        return (1,) * num_arrays
    if len(pieces) != num_arrays:
        raise ValueError(f"a transfer of {num_arrays} array(s) names pieces for {len(pieces)}")
    return tuple(pieces)


def _sharding(mesh: jax.sharding.Mesh, layout: tuple) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*layout))


def _piece_shape(shape, n: int) -> tuple:
    return (shape[0] // n,) + tuple(shape[1:]) if n > 1 else tuple(shape)


def _host_port(host: str) -> str:
    return f"[{host}]:0" if ":" in host else f"{host}:0"  # IPv6 literals need brackets


class TransferTransport:
    """One slice's end of the data plane. Make one per worker process (one server per process;
    `slice_index` names this end in errors). `secret`: the session's data-plane secret (16 to
    64 bytes), the same on every slice of the session; it keys every transfer id.

    `transport` picks the path per pair of slices: "auto" moves a pair's transfers through
    shared memory (runtime/wire/shm.py) when the peer's worker has an endpoint on this host,
    else through jax.experimental.transfer's sockets; "socket" always the latter; "shm" always
    the former, and connecting to a peer on another host (or a gang, whose pieces travel
    between processes one by one) is a ValueError. The receiver finds out, at connect_peers,
    and the sender learns it from the receiver's authenticated connection, so both ends agree
    before the first transfer.

    `generation`: the generation of the controller's view this slice was admitted in
    (runtime/worker/service.py, "Generations"); transfer ids are keyed with it as well, so a
    slice left in an older generation (a worker replaced but still running) pairs with no
    transfer of the current one. connect_peers moves it to the controller's newest.

    `host_staging` (auto | pinned | pageable): how shared-memory transfers cross between device
    and host memory, see runtime/wire/staging.py; auto goes through pinned host memory on
    accelerators. Benchmarks and tests set the others."""

    def __init__(
        self,
        slice_index: int,
        mesh: jax.sharding.Mesh,
        listen_host: str = "127.0.0.1",
        *,
        secret: bytes,
        transport: str = "auto",
        host_staging: str = "auto",
        generation: int = 0,
    ):
        self._secret = check_secret(secret)
        self.generation = generation
        self.mode = check_transport(transport)
        self._staging = Staging.of(mesh.devices.flat, host_staging)
        self.slice_index = slice_index
        self._mesh = mesh
        if self.mode == "shm" and jax.process_count() > 1:
            raise ValueError(
                f"transport 'shm' cannot serve slice {slice_index}: it is a gang of "
                f"{jax.process_count()} processes (one per host); use auto or socket"
            )
        # The listening socket and the bulk-data sockets bind to listen_host only (the
        # default bulk address is 0.0.0.0); workers listen on loopback unless told otherwise.
        self._server = transfer.start_transfer_server(
            mesh.devices.flat[0].client,
            _host_port(listen_host),
            [_host_port(listen_host)] * NUM_BULK_SOCKETS,
            transfer_size=CHUNK_BYTES,
        )
        self.address: str = self._server.address()
        self._shm = None  # shm.ShmServer: serves the same-host slices that pull from this one
        if self.mode != "socket" and jax.process_count() == 1:
            try:
                self._shm = shm.ShmServer(self._secret, self.address, slice_index, self._staging)
            except OSError as e:  # no Unix sockets here: auto does without
                if self.mode == "shm":
                    raise ValueError(
                        f"transport 'shm': slice {slice_index} cannot open its shared-memory "
                        f"endpoint ({e}); use auto or socket"
                    ) from None
        self._connections: dict[int, list[transfer.TransferConnection]] = {}  # one per process of the peer
        self._shm_connections: dict[int, shm.ShmConnection] = {}  # peers reached through shm
        self._waiters = _Waiters(f"mpmd-recv-s{slice_index}")

    def connect_peers(self, addresses: dict[int, str | list[str]], generation: int | None = None) -> None:
        """Connect to the slices this one receives from (slice index -> `address`, or one
        per process for a gang). Socket connections are lazy and retried by the API, so peers
        may still be starting; a shared-memory connection is made now (the peer's Setup
        has returned: its endpoint is up). `generation`: the controller's generation from now
        on (runtime/worker/service.py, "Generations"); it keys every transfer id."""
        if generation is not None:
            self.generation = generation
        for index, address in addresses.items():
            listed = [address] if isinstance(address, str) else list(address)
            old = self._shm_connections.pop(index, None)
            if old is not None and not old.closed and listed == [old.address]:
                self._shm_connections[index] = old  # the same worker: keep its connection
            elif old is not None:
                old.close()
            if index == self.slice_index:
                pass  # a slice never sends to itself
            elif index not in self._shm_connections and self._shm is not None and len(listed) == 1:
                found = shm.ShmConnection.connect(self._secret, listed[0], index, self.slice_index, self._staging)
                if found is not None:
                    self._shm_connections[index] = found
            if self.mode == "shm" and index != self.slice_index and index not in self._shm_connections:
                raise ValueError(
                    f"transport 'shm' cannot reach slice {index} at {address}: "
                    + (
                        "it is a gang of processes"
                        if len(listed) > 1
                        else "its worker has no shared-memory endpoint on this host (another host?)"
                    )
                    + "; use transport auto or socket"
                )
            self._connections[index] = [self._server.connect(a) for a in listed]
            if index != self.slice_index:
                log.info(
                    "slice %d receives from slice %d through %s",
                    self.slice_index,
                    index,
                    ("shared memory, staged through pinned host memory" if self._staging.pinned else "shared memory")
                    if index in self._shm_connections
                    else "sockets",
                )

    def _uuid(self, key: str) -> int:
        """The transfer id of plan key `key` in this session and generation."""
        return key_to_uuid(f"g{self.generation}/{key}", self._secret)

    def path(self, peer: int) -> str:
        """ "shm" or "socket": how transfers from `peer` come to this slice (after connect_peers)."""
        return "shm" if peer in self._shm_connections else "socket"

    def _gang(self, peer: int) -> bool:
        """Whether a transfer with `peer` involves a gang on either end: then pieces travel
        one by one, each between the process that owns it and the one it lands on
        (runtime/wire/reshard.py), under ids of their own; else as one bundle, as always."""
        return jax.process_count() > 1 or len(self._connections.get(peer, ())) > 1

    def send(self, key: str, arrays: tuple[jax.Array, ...], dst_slice: int, pieces: tuple[int, ...] = ()) -> None:
        # The receiver pulls by key. Arrays still being computed are fine; the server serves
        # them once they are ready. The path is shared memory if dst_slice has connected to
        # this worker's endpoint, so every receiver's connect_peers must have returned before
        # the first send (the controller's Connects all return before any Run): a send made
        # earlier goes by socket while the receiver pulls through shared memory, and waits
        # forever (benchmarks/bench_transport.py once raced so).
        counts = _counts(pieces, len(arrays))
        if self._shm is not None and self._shm.serves(dst_slice):
            offered = [p for a, n in zip(arrays, counts) if a.size for p in reshard.cut(a, n)]
            if offered:
                self._shm.await_pull(self._uuid(key), offered)
            return
        if self._gang(dst_slice):
            for j, (a, n) in enumerate(zip(arrays, counts)):
                if a.size:
                    for i, piece in reshard.owned_pieces(a, n, self._mesh).items():
                        self._server.await_pull(self._uuid(f"{key}#{j}.{i}"), [piece])
            return
        offered = [p for a, n in zip(arrays, counts) if a.size for p in reshard.cut(a, n)]
        if offered:
            self._server.await_pull(self._uuid(key), offered)

    def recv(self, key: str, src_slice: int, specs: tuple, pieces: tuple[int, ...] = ()) -> concurrent.futures.Future:
        if src_slice not in self._connections and src_slice not in self._shm_connections:
            raise ValueError(
                f"slice {self.slice_index} cannot receive {key!r} from slice "
                f"{src_slice}: not connected; connected: {sorted(self._connections)}"
            )
        counts = _counts(pieces, len(specs))
        if self._gang(src_slice):
            return self._recv_gang(key, src_slice, specs, counts)
        wanted = []  # one single-device spec per piece, on a device that needs its rows
        for s, n in zip(specs, counts):
            if math.prod(s.shape):
                wanted += [
                    jax.ShapeDtypeStruct(
                        _piece_shape(s.shape, n), s.dtype, sharding=jax.sharding.make_single_device_sharding(d)
                    )
                    for d in reshard.landing(s.shape, s.layout, self._mesh, n)
                ]
        # pull only posts the request (microseconds), so it runs here: the bytes flow as soon
        # as the sender offers them, while the caller goes on computing.
        uuid = self._uuid(key)
        if src_slice in self._shm_connections:  # a Future of the arrays
            pulled = self._shm_connections[src_slice].pull(uuid, wanted) if wanted else ()
        else:  # arrays that become ready as the bytes land
            pulled = tuple(self._connections[src_slice][0].pull(uuid, wanted)) if wanted else ()
        mesh = self._mesh

        def assemble(landed) -> tuple:
            # Runs once every piece has landed: copying a pulled array that is not ready
            # yet would block the thread posting the receives (and so the step).
            landed = iter(landed)
            return tuple(
                reshard.assemble([next(landed) for _ in range(n)], s.shape, s.layout, mesh)
                if math.prod(s.shape)
                else jax.device_put(jnp.zeros(s.shape, s.dtype), _sharding(mesh, s.layout))
                for s, n in zip(specs, counts)
            )

        return self._waiters.submit(pulled, assemble)

    def _recv_gang(self, key: str, src_slice: int, specs: tuple, counts: tuple[int, ...]) -> concurrent.futures.Future:
        """Pull the pieces that land on this process, each from the process of the sending
        gang that owns it; the future's result is a reshard.Deferred that the executor calls
        when its walk reaches the Recv (putting the pieces together may be a collective)."""
        senders = self._connections[src_slice]
        pulled, parts = [], []
        for j, (s, n) in enumerate(zip(specs, counts)):
            here = reshard.wanted_here(s.shape, s.layout, self._mesh, n) if math.prod(s.shape) else []
            got = [
                self._connections[src_slice][reshard.owner(i, n, len(senders))].pull(
                    self._uuid(f"{key}#{j}.{i}"),
                    [
                        jax.ShapeDtypeStruct(
                            _piece_shape(s.shape, n), s.dtype, sharding=jax.sharding.make_single_device_sharding(d)
                        )
                    ],
                )[0]
                for i, d in here
            ]
            pulled += got
            parts.append(({i: a for (i, _), a in zip(here, got)}, (s, n)))
        mesh = self._mesh
        return self._waiters.submit(tuple(pulled), lambda _ready: reshard.Deferred(parts, mesh))

    def reset(self) -> None:
        """Abort support: drop this slice's sends not yet pulled and fail the peers' pulls that
        wait on this slice. Pulls this slice posted to others fail when *they* reset. Before a
        step is replayed with the same keys every slice must reset: ids are one-shot, so a
        leftover send or pull of the aborted attempt would otherwise pair with the replay's."""
        if self._server is not None:  # closed: nothing left to reset
            compat.reset_transfers(self._server)
            if self._shm is not None:
                self._shm.reset()
            for connection in self._shm_connections.values():
                connection.cancel()

    def close(self) -> None:
        """Idempotent: a session's Setup and its close may both close the old transport."""
        if self._server is None:
            return
        self.reset()
        self._waiters.close()
        self._connections.clear()
        if self._shm is not None:  # its endpoint, and every segment it lent, go now
            self._shm.close()
        for connection in self._shm_connections.values():
            connection.close()
        self._shm_connections.clear()
        self._server = None


class _Waiters:
    """One waiting thread per outstanding receive (idle threads are reused), so a future
    never queues behind receives whose senders come later: receives may be posted and
    consumed in any order. A waiting thread sleeps in block_until_ready with the GIL
    released. Daemon threads, not a ThreadPoolExecutor: the latter joins its threads at
    interpreter exit, and one receive whose sender never comes would hang the exit forever."""

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_threads = 0
        self._num_idle = 0

    def submit(self, arrays, then=lambda ready: ready) -> concurrent.futures.Future:
        """A future of `then(arrays)` once `arrays` (a tuple of arrays, or a Future of a list
        of them) are ready (and of what `then` makes, ready)."""
        future = concurrent.futures.Future()
        with self._lock:
            if self._num_idle:
                self._num_idle -= 1  # that idle thread takes this item
            else:
                threading.Thread(target=self._loop, daemon=True, name=f"{self._name}-{self._num_threads}").start()
                self._num_threads += 1
        self._queue.put((future, arrays, then))
        return future

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(*item)
            item = None  # an idle thread holds no arrays (nor shared memory) of the last receive
            with self._lock:
                self._num_idle += 1

    @staticmethod
    def _run(future: concurrent.futures.Future, arrays, then) -> None:
        if future.set_running_or_notify_cancel():  # False: cancelled while queued
            try:
                if isinstance(arrays, concurrent.futures.Future):
                    arrays = arrays.result()
                future.set_result(jax.block_until_ready(then(jax.block_until_ready(arrays))))
            except BaseException as e:
                future.set_exception(e)

    def close(self) -> None:
        with self._lock:
            for _ in range(self._num_threads):
                self._queue.put(None)
            self._num_threads = self._num_idle = 0
