"""The same-host data plane: arrays through shared memory, offered and pulled by transfer id.

Between two workers on one host the bytes need not cross a socket: the sender copies a
transfer's arrays once into a shared-memory segment and the receiver's arrays are that
memory (on CPU `jax.device_put` of an aligned host view aliases it instead of copying;
elsewhere it is the host-to-device copy's source). The API mirrors jax.experimental.transfer's,
so runtime/wire/transport.py picks one or the other per pair of slices and the executor
does not know which: the sender `await_pull`s arrays under an id, the receiver `pull`s the id
and gets its arrays when they have landed; one-shot ids; a pull may come before its offer.

Pieces:
- ShmServer, one per worker process: an abstract Unix socket (SOCK_SEQPACKET) whose name is a
  keyed hash of the worker's transfer address under the session secret (`endpoint`), and the
  table of offered ids and waiting pulls.
- ShmConnection, one per slice this one receives from over shared memory: the receiving end.
- Segments are memfds (anonymous files: nothing in /dev/shm, no name to find), 0600, sealed
  against shrinking (a peer cannot make the other's mapping fault), each passed once over
  the authenticated socket (SCM_RIGHTS) and mapped by both ends; the passed fd is closed at
  once on both sides (each mapping holds one of its own: Python's mmap keeps a duplicate), so
  a segment lives exactly as long as some mapping of it: a process's death unmaps its side,
  and the other side unmaps on the socket's end, or, for what it received, when the last
  array made from the segment dies (its bytes stay valid until then). A segment carries one
  transfer at a time and goes back to the sender's pool when every array the receiver made
  from it has died ("done"); the pool keeps at most FREE_POOL_BYTES idle per connection.

Authentication. The socket's name is derived from the secret but may be seen by any local
process (/proc/net/unix), so it is not the credential: on connect both ends prove they hold
the session secret (HMAC-SHA256 over both ends' nonces, the server's transfer address and
the client's slice, a different label each way) before anything else is accepted, and the
server refuses peers of another uid (SO_PEERCRED). A process without the secret gets no
segment and no byte, and cannot pose as a sender either. Transfer ids stay keyed
(transport.key_to_uuid) as on the socket path.

Host staging. On CPU a device array already is host memory: the sender copies it into the
segment once and the receiver's arrays alias the segment. On an accelerator the bytes cross
the device boundary on both ends, and they cross it through pinned (page-locked) host memory
(runtime/wire/staging.py): the sender copies the array to a pinned-host copy of itself
(`jax.device_put` to memory kind "pinned_host", a DMA) and from there into the segment; the
receiver copies the segment into a pinned-host array and that to the device (a DMA). (A
copy between device memory and pageable memory, a numpy array or the segment itself, is
staged by the CUDA driver through a pinned bounce buffer of its own, in pieces.) "auto" does so
wherever the slice's devices are not CPUs and have pinned host memory; "pinned" and
"pageable" force one way (tests, benchmarks: benchmarks/bench_transport.py, gpu_suite.py).

Messages (JSON lists, one per SOCK_SEQPACKET datagram):
  receiver -> sender: ["pull", req, id]  ["done", seg]  ["cancel"] (drop my waiting pulls)
  sender -> receiver: ["data", req, seg, seg_bytes, [[offset, nbytes], ...]] (+ the segment's
                      fd the first time) ["fail", req, why]  ["forget", seg]
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import hashlib
import hmac
import json
import logging
import mmap
import os
import queue
import secrets
import socket
import struct
import threading
import weakref

import jax
import numpy as np

from mpmd.runtime.wire.staging import Staging

log = logging.getLogger("mpmd.worker")

ALIGN_BYTES = 64  # each piece's offset: XLA's CPU client aliases 64-byte aligned host memory
MIN_SEGMENT_BYTES = 2**20  # segments are powers of two from here, so pools serve varied sizes
FREE_POOL_BYTES = 512 * 2**20  # idle segments a connection keeps mapped for reuse (warm pages)
HANDSHAKE_TIMEOUT_S = 5.0
_MAX_MESSAGE_BYTES = 1 << 16
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def endpoint(secret: bytes, address: str) -> bytes:
    """The abstract socket name of the worker whose transfer address is `address` in the
    session keyed by `secret`: a worker that is not on this host (or not in this network
    namespace) has none here, which is how a receiver finds out."""
    tag = hashlib.blake2b(b"mpmd-shm\0" + address.encode(), key=secret, digest_size=16).hexdigest()
    return b"\0mpmd-shm-" + tag.encode()


def _mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes, address: str, slice_index: int) -> str:
    msg = b"\0".join([label, server_nonce, client_nonce, address.encode(), str(slice_index).encode()])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _send(sock: socket.socket, message: list, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)  # one datagram: whole, so threads may send without a lock


def _recv(sock: socket.socket) -> tuple[list, list[int]]:
    """The next message and the fds that came with it; ([], []) at the peer's end."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE_BYTES, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        return [], []
    return json.loads(data), fds


def _unmap(mm: mmap.mmap) -> None:
    """Unmap now, or (arrays still made from it) when the last of them dies."""
    try:
        mm.close()
    except BufferError:
        pass


class _Segment:
    def __init__(self, name: str, seg_id: int, num_bytes: int):
        # The name is only what /proc/<pid>/maps shows: who lent it to whom.
        fd = os.memfd_create(f"{name}-{seg_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, num_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self.mm = mmap.mmap(fd, num_bytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd  # until passed to the receiver, then closed
        self.id, self.num_bytes = seg_id, num_bytes


class _Pool:
    """A connection's segments on the sending side: lent (carrying a transfer the receiver
    has not let go of) or free (mapped, pages warm, for the next transfer that fits)."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._next_id = 0
        self.free: dict[int, _Segment] = {}
        self.lent: dict[int, _Segment] = {}

    def take(self, num_bytes: int) -> tuple[_Segment, list[_Segment]]:
        """A segment of at least `num_bytes`, lent from now on, and the free ones dropped to
        make room (the receiver must be told to forget them)."""
        with self._lock:
            fits = [s for s in self.free.values() if s.num_bytes >= num_bytes]
            if fits:
                seg = min(fits, key=lambda s: s.num_bytes)
                del self.free[seg.id]
                self.lent[seg.id] = seg
                return seg, []
            self._next_id += 1
            seg_id = self._next_id
        seg = _Segment(self._name, seg_id, max(MIN_SEGMENT_BYTES, 1 << (num_bytes - 1).bit_length()))
        with self._lock:
            self.lent[seg.id] = seg
            return seg, self._trim(seg.num_bytes)

    def give_back(self, seg_id: int) -> list[_Segment]:
        with self._lock:
            seg = self.lent.pop(seg_id, None)
            if seg is None:
                return []
            self.free[seg_id] = seg
            return self._trim(0)

    def _trim(self, extra: int) -> list[_Segment]:
        dropped = []
        while self.free and sum(s.num_bytes for s in self.free.values()) + extra > FREE_POOL_BYTES:
            seg = self.free.pop(min(self.free))  # the oldest first
            _unmap(seg.mm)
            dropped.append(seg)
        return dropped

    def close(self) -> None:
        with self._lock:
            for seg in list(self.free.values()) + list(self.lent.values()):
                if seg.fd is not None:
                    os.close(seg.fd)
                    seg.fd = None
                _unmap(seg.mm)
            self.free.clear()
            self.lent.clear()


class ShmServer:
    """The sending end of a worker: serves pulls from the same-host slices that connected
    with the secret. `address`: this worker's transfer address (it names the endpoint)."""

    def __init__(self, secret: bytes, address: str, slice_index: int, staging: Staging | None = None):
        self._secret, self.address, self.slice_index = secret, address, slice_index
        self.staging = staging or Staging(False)
        self._lock = threading.Lock()
        self._offered: dict[int, list] = {}  # id -> arrays, not yet pulled
        self._waiting: dict[int, list[tuple[_Served, int]]] = {}  # id -> pulls before their offer
        self._peers: dict[int, _Served] = {}  # receiving slice -> its connection
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(endpoint(secret, address))
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True, name=f"mpmd-shm-accept-s{slice_index}").start()

    def serves(self, slice_index: int) -> bool:
        """Whether `slice_index` receives from this worker through shared memory."""
        with self._lock:
            return slice_index in self._peers

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._admit, args=(sock,), daemon=True, name=f"mpmd-shm-serve-s{self.slice_index}"
            ).start()

    def _admit(self, sock: socket.socket) -> None:
        """Handshake (module docstring), then this connection's messages until it ends."""
        served = None
        try:
            pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                raise PermissionError(f"process {pid} runs as uid {uid}, not {os.getuid()}")
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            server_nonce = secrets.token_bytes(16)
            _send(sock, ["hello", server_nonce.hex()])
            auth, _ = _recv(sock)
            if not (
                isinstance(auth, list)
                and len(auth) == 4
                and auth[0] == "auth"
                and isinstance(auth[1], int)
                and all(isinstance(x, str) for x in auth[2:])
            ):
                raise PermissionError("its first message was not a handshake")
            _, peer, client_nonce, mac = auth
            client_nonce = bytes.fromhex(client_nonce)
            if not hmac.compare_digest(
                mac, _mac(self._secret, b"client", server_nonce, client_nonce, self.address, peer)
            ):
                raise PermissionError("it does not hold the session secret")
            sock.settimeout(None)
            served = _Served(self, sock, peer)
            with self._lock:
                old, self._peers[peer] = self._peers.get(peer), served
            if old is not None:
                old.close()
            _send(sock, ["ok", _mac(self._secret, b"server", server_nonce, client_nonce, self.address, peer)])
        except (OSError, ValueError, TypeError, PermissionError) as e:
            log.warning("slice %d refused a shared-memory connection: %s", self.slice_index, e)
            if served is not None:  # registered, but the receiver never heard: not a peer
                served.close()
            sock.close()
            return
        served.read()

    def await_pull(self, uuid: int, arrays: list) -> None:
        with self._lock:
            waiting = self._waiting.get(uuid)
            if not waiting:
                self._offered[uuid] = arrays
                return
            served, req = waiting.pop(0)
            if not waiting:
                del self._waiting[uuid]
        served.serve(req, arrays)

    def _pull(self, served: "_Served", req: int, uuid: int) -> None:
        with self._lock:
            arrays = self._offered.pop(uuid, None)
            if arrays is None:
                self._waiting.setdefault(uuid, []).append((served, req))
                return
        served.serve(req, arrays)

    def _forget(self, served: "_Served") -> None:
        """Drop `served`'s waiting pulls (it cancelled them, or it is gone)."""
        with self._lock:
            for uuid in list(self._waiting):
                self._waiting[uuid] = [w for w in self._waiting[uuid] if w[0] is not served]
                if not self._waiting[uuid]:
                    del self._waiting[uuid]
            if self._peers.get(served.peer) is served and served.closed:
                del self._peers[served.peer]

    def reset(self) -> None:
        """Drop the offers not yet pulled and fail the pulls waiting here."""
        with self._lock:
            waiting = [w for ws in self._waiting.values() for w in ws]
            self._offered.clear()
            self._waiting.clear()
        for served, req in waiting:
            served.fail(req, f"slice {self.slice_index} reset its transfers")

    def close(self) -> None:
        self.reset()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()  # the abstract name is gone with it
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for served in peers:
            served.close()


class _Served:
    """The server's side of one receiver's connection: reads its pulls and dones, copies
    offered arrays into segments on a thread of its own, in order."""

    def __init__(self, server: ShmServer, sock: socket.socket, peer: int):
        self.server, self.sock, self.peer = server, sock, peer
        self.pool = _Pool(f"mpmd-shm-s{server.slice_index}-to{peer}")
        self.closed = False
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._copy_loop, daemon=True, name=f"mpmd-shm-copy-to{peer}").start()

    def read(self) -> None:
        try:
            while True:
                message, fds = _recv(self.sock)
                for fd in fds:  # a receiver sends none
                    os.close(fd)
                if not message:
                    break
                if message[0] == "pull":
                    self.server._pull(self, int(message[1]), int(message[2]))
                elif message[0] == "done":
                    self._forget_segments(self.pool.give_back(int(message[1])))
                elif message[0] == "cancel":
                    self.server._forget(self)
        except (OSError, ValueError, TypeError, IndexError, KeyError):  # a malformed message ends it
            pass
        self.close()

    def serve(self, req: int, arrays: list) -> None:
        self._work.put((req, arrays))

    def fail(self, req: int, why: str) -> None:
        try:
            _send(self.sock, ["fail", req, why])
        except OSError:
            pass

    def _forget_segments(self, dropped: list[_Segment]) -> None:
        for seg in dropped:
            try:
                _send(self.sock, ["forget", seg.id])
            except OSError:
                pass

    def _copy_loop(self) -> None:
        while (item := self._work.get()) is not None:
            req, arrays = item
            seg = None
            try:
                host = [self.server.staging.to_host(a) for a in jax.block_until_ready(arrays)]
                offsets, end = [], 0
                for h in host:
                    offsets.append(end)
                    end += -(-h.nbytes // ALIGN_BYTES) * ALIGN_BYTES
                seg, dropped = self.pool.take(max(end, 1))
                self._forget_segments(dropped)
                for h, offset in zip(host, offsets):
                    np.copyto(np.frombuffer(seg.mm, h.dtype, h.size, offset).reshape(h.shape), h)
            except Exception as e:  # an array that failed to compute; no memory or fd for a segment
                if seg is not None:
                    self._forget_segments(self.pool.give_back(seg.id))
                self.fail(req, f"slice {self.server.slice_index} could not send: {type(e).__name__}: {e}")
                item = arrays = host = None
                continue
            try:
                fds = (seg.fd,) if seg.fd is not None else ()
                _send(
                    self.sock, ["data", req, seg.id, seg.num_bytes, [[o, h.nbytes] for o, h in zip(offsets, host)]], fds
                )
                if fds:
                    os.close(seg.fd)
                    seg.fd = None
            except OSError:
                # The connection is broken: end it on both sides, so that the receiver's
                # pulls fail (the step fails and is recovered) instead of waiting forever.
                self.close()
                break
            item = arrays = host = None  # an idle copy thread holds no arrays
        self.pool.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._work.put(None)
        self.server._forget(self)


class ShmConnection:
    """The receiving end of one same-host peer (slice `peer` at transfer address `address`),
    opened by `connect`; `pull` returns a Future of the arrays."""

    @classmethod
    def connect(
        cls, secret: bytes, address: str, peer: int, slice_index: int, staging: Staging | None = None
    ) -> "ShmConnection | None":
        """A connection to the worker at `address` if it has an endpoint on this host, None if
        not (another host, or a worker without shared memory). ValueError if something
        answers there without the session secret. `staging`: how what lands goes to the
        device (Staging; default pageable)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(endpoint(secret, address))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            (kind, server_nonce), _ = _recv(sock)
            server_nonce, client_nonce = bytes.fromhex(server_nonce), secrets.token_bytes(16)
            _send(
                sock,
                [
                    "auth",
                    slice_index,
                    client_nonce.hex(),
                    _mac(secret, b"client", server_nonce, client_nonce, address, slice_index),
                ],
            )
            (kind, mac), _ = _recv(sock)
            if kind != "ok" or not hmac.compare_digest(
                mac, _mac(secret, b"server", server_nonce, client_nonce, address, slice_index)
            ):
                raise ValueError(
                    f"the shared-memory endpoint of slice {peer} ({address}) did not prove it holds the session secret"
                )
            sock.settimeout(None)
        except (OSError, ValueError) as e:
            sock.close()
            raise ValueError(f"the shared-memory handshake with slice {peer} ({address}) failed: {e}") from None
        return cls(sock, peer, address, staging)

    def __init__(self, sock: socket.socket, peer: int, address: str, staging: Staging | None = None):
        self.sock, self.peer, self.address = sock, peer, address
        self.staging = staging or Staging(False)
        self._lock = threading.Lock()
        self._next_req = 0
        self._pending: dict[int, tuple[concurrent.futures.Future, list]] = {}
        self._segments: dict[int, mmap.mmap] = {}  # only the reader thread touches it
        self.closed = False
        threading.Thread(target=self._read, daemon=True, name=f"mpmd-shm-recv-from{peer}").start()

    def pull(self, uuid: int, wanted: list) -> concurrent.futures.Future:
        """Ask for id `uuid`; the Future's result is one array per ShapeDtypeStruct of
        `wanted` (each with a SingleDeviceSharding), made from the segment the bytes came in."""
        future = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                future.set_exception(self._gone())
                return future
            self._next_req += 1
            req = self._next_req
            self._pending[req] = (future, wanted)
        try:
            _send(self.sock, ["pull", req, uuid])
        except OSError:
            self._fail_all(self._gone())
        return future

    def cancel(self) -> None:
        """Reset: fail this end's waiting pulls and have the sender drop them."""
        self._fail_all(RuntimeError(f"the pulls from slice {self.peer} were reset"))
        try:
            _send(self.sock, ["cancel"])
        except OSError:
            pass

    def _gone(self) -> RuntimeError:
        return RuntimeError(
            f"the shared-memory connection to slice {self.peer} ({self.address}) closed: "
            f"its worker is gone or reset its transfers"
        )

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for future, _ in pending:
            if not future.done():
                future.set_exception(error)

    def _read(self) -> None:
        try:
            while True:
                message, fds = _recv(self.sock)
                if not message:
                    break
                if message[0] == "data":
                    self._land(*message[1:], fds)
                elif message[0] == "fail":
                    with self._lock:
                        entry = self._pending.pop(int(message[1]), None)
                    if entry is not None:
                        entry[0].set_exception(RuntimeError(str(message[2])))
                elif message[0] == "forget":
                    mm = self._segments.pop(int(message[1]), None)
                    if mm is not None:
                        _unmap(mm)
        except (OSError, ValueError, TypeError, IndexError, KeyError):  # a malformed message ends it
            pass
        except Exception:  # anything else ends it too, said: never a reader gone with pulls waiting
            log.exception("the shared-memory connection from slice %d (%s) failed", self.peer, self.address)
        finally:
            self.close()  # fails the pulls still waiting

    def _land(self, req: int, seg_id: int, seg_bytes: int, pieces: list, fds: list[int]) -> None:
        if fds:
            try:
                if fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & _SEALS != _SEALS or os.fstat(fds[0]).st_size < seg_bytes:
                    raise ValueError(f"slice {self.peer} sent segment {seg_id} unsealed or short")
                self._segments[seg_id] = mmap.mmap(fds[0], seg_bytes)
            finally:
                for fd in fds:
                    os.close(fd)
        with self._lock:
            entry = self._pending.pop(req, None)
        mm = self._segments[seg_id]
        sock = self.sock
        if entry is None:  # cancelled meanwhile: give the segment straight back
            _send(sock, ["done", seg_id])
            return
        future, wanted = entry
        try:
            if len(pieces) != len(wanted):
                raise ValueError(f"slice {self.peer} sent {len(pieces)} arrays, {len(wanted)} were expected")
            end = max(o + n for o, n in pieces)
            # One exporter object per transfer: every array made from it keeps it alive, and
            # when the last dies the segment goes back to the sender ("done").
            region = (ctypes.c_char * end).from_buffer(mm)
            weakref.finalize(region, _done, sock, seg_id)
            arrays = []
            for (offset, nbytes), w in zip(pieces, wanted):
                dtype = np.dtype(w.dtype)
                if nbytes != dtype.itemsize * int(np.prod(w.shape)):
                    raise ValueError(f"slice {self.peer} sent {nbytes} bytes for a {w.dtype}{list(w.shape)} array")
                view = np.frombuffer(region, dtype, int(np.prod(w.shape)), offset).reshape(w.shape)
                arrays.append(self.staging.to_device(view, w.sharding))
            region = view = None  # only the arrays hold the segment now
        except Exception as e:
            future.set_exception(e)
            return
        future.set_result(arrays)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._fail_all(self._gone())
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        while self._segments:
            _unmap(self._segments.popitem()[1])


def _done(sock: socket.socket, seg_id: int) -> None:
    """A finalizer: may run on any thread, at any time, after the connection closed too."""
    try:
        _send(sock, ["done", seg_id])
    except OSError:
        pass
