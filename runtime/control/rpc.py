"""One gRPC client per worker (or per shared cluster's manager), and the typed verb helpers.

`send`, `receive` and `call` take and give the records of runtime/wire/verbs.py: a request
record is checked and encoded into a frame's header, a reply decoded back into its record.
Whoever talks to a worker or a manager (the control plane, the manager, `mpmd cluster`)
calls it through these. A gang's slice has a GangClient (runtime/worker/gang.py) with the
same verbs.
"""

from __future__ import annotations

import collections
import secrets
import time

import grpc

from mpmd.runtime.wire import format as wire
from mpmd.runtime.wire import verbs
from mpmd.runtime.wire.results import Aborted, Progress
from mpmd.runtime.wire.tls import CHANNEL_OPTIONS, Tls
from mpmd.runtime.worker.gang import GangClient
from mpmd.runtime.worker.service import GENERATION_KEY, GRPC_OPTIONS, SERVICE, TOKEN_KEY

# gRPC codes that mean "the worker is not there", as opposed to "it refused the request".
GONE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}


class WorkerError(RuntimeError):
    """A worker failed or could not be reached; the message names its address."""

    def __init__(self, address: str, message: str, code=None, details: str = ""):
        super().__init__(f"worker {address}: {message}")
        self.address = address
        self.code = code
        self.details = details  # the worker's own words, for a refusal the caller words itself


class WorkerClient:
    def __init__(
        self,
        address: str,
        token: str,
        rpc_counts: collections.Counter,
        service: str = SERVICE,
        tls: Tls | None = None,
        options=(),
    ):
        """options: gRPC channel options beside GRPC_OPTIONS (see sibling)."""
        self.address = address
        self.service = service  # the gRPC service called: a worker's, or a shared cluster's manager
        self._token = token
        self._metadata = ((TOKEN_KEY, token),)
        self.tls = tls  # mutual TLS (runtime/wire/tls.py), else the clear
        self._channel = (
            grpc.secure_channel(address, tls.channel_credentials(), options=[*GRPC_OPTIONS, *CHANNEL_OPTIONS, *options])
            if tls
            else grpc.insecure_channel(address, options=[*GRPC_OPTIONS, *options])
        )
        self._counts = rpc_counts
        self._stubs = {}
        self.last_ok = time.monotonic()
        self.progress: Progress | None = None  # from the last heartbeat
        self.progress_at = time.monotonic()  # when `progress` last changed

    @property
    def generation(self) -> int:
        """The generation every call is made in (metadata `mpmd-generation`: see
        runtime/worker/service.py, "Generations"); 0 until the control plane sets one."""
        return int(dict(self._metadata).get(GENERATION_KEY, 0))

    @generation.setter
    def generation(self, value: int) -> None:
        self._metadata = ((TOKEN_KEY, self._token), (GENERATION_KEY, str(int(value))))

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            # A TLS handshake refused either way looks the same from here: a channel that never connects.
            raise WorkerError(
                self.address,
                f"did not answer within {timeout_s:g} s (is `mpmd worker` running and listening "
                f"there?; {self._tls_hint()})",
            ) from None
        self.last_ok = time.monotonic()  # it answered: its silence counts from now

    def _tls_hint(self) -> str:
        if self.tls:
            return "this client speaks mutual TLS: does the server serve it (--tls) with a certificate of the same authority?"
        return "this client speaks in the clear: does the server serve TLS (--tls, cluster.tls)?"

    def future(self, method: str, header: dict | None = None, blobs=(), timeout_s: float | None = None):
        """Start an RPC; `.result()` of the returned gRPC future gives the reply frame."""
        stub = self._stubs.get(method)
        if stub is None:
            stub = self._stubs[method] = self._channel.unary_unary(f"/{self.service}/{method}")
        self._counts[method] += 1
        try:
            return stub.future(wire.encode(header or {}, list(blobs)), metadata=self._metadata, timeout=timeout_s)
        except ValueError as e:  # the channel was closed: this client was replaced
            raise WorkerError(self.address, f"{method}: {e}") from None

    def result(self, method: str, fut):
        try:
            reply = fut.result()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ABORTED:
                raise Aborted(f"worker {self.address}: {e.details()}") from None
            details = e.details() or ""
            # A handshake one side refused: the server closes the socket on a client in the
            # clear; TLS says "handshake" when the certificates or the protocols disagree.
            hint = f" ({self._tls_hint()})" if "Socket closed" in details or "andshake" in details else ""
            raise WorkerError(
                self.address, f"{method} failed: {e.code().name}: {details}{hint}", e.code(), details
            ) from None
        self.last_ok = time.monotonic()
        return wire.decode(reply)

    def call(self, method: str, header: dict | None = None, blobs=(), timeout_s: float | None = None):
        return self.result(method, self.future(method, header, blobs, timeout_s))

    def ready_future(self):
        """A future done once this client's channel is connected (grpc.channel_ready_future)."""
        return grpc.channel_ready_future(self._channel)

    def sibling(self, options) -> WorkerClient:
        """A client of the same worker, with the same token, generation and TLS, on a channel
        of its own with the gRPC channel `options` added (runtime/control/heartbeat.py's probe)."""
        c = WorkerClient(self.address, self._token, self._counts, self.service, self.tls, options)
        c.generation = self.generation
        return c

    def close(self) -> None:
        self._channel.close()


def send(client: WorkerClient | GangClient, request, blobs=(), timeout_s: float | None = None, verb: str | None = None):
    """Start the RPC of a request record of the client's service (runtime/wire/verbs.py: a
    worker's VERBS, a manager's MANAGER_VERBS); `verb` names a verb whose request record
    several verbs take (Empty, JobRequest). `.result()` as in receive."""
    verb = verb or verbs.verb_of(request, verbs.TABLES[client.service])
    return client.future(verb, verbs.encode(request), blobs, timeout_s)


def receive(client: WorkerClient | GangClient, verb: str, fut):
    """(the reply record of `verb`, its blobs) once the RPC `send` started is answered."""
    header, blobs = client.result(verb, fut)
    return verbs.decode_reply(verb, header, verbs.TABLES[client.service]), blobs


def call(client: WorkerClient | GangClient, request, blobs=(), timeout_s: float | None = None, verb: str | None = None):
    """send, then receive: (reply record, blobs)."""
    verb = verb or verbs.verb_of(request, verbs.TABLES[client.service])
    return receive(client, verb, send(client, request, blobs, timeout_s, verb))


def new_token() -> str:
    return secrets.token_hex(16)


def program_entries(specs: dict) -> tuple[list, list]:
    """LoadPrograms' (and Warm's) `programs` entries for {name: ProgramSpec}, and their blobs."""
    b = wire.Builder()
    entries = []
    for name, s in specs.items():
        entry = {
            "name": name,
            "kind": s.kind,
            "duration_s": s.duration_s,
            "outputs": [[[list(x.shape), x.dtype] for x in bundle] for bundle in s.outputs],
        }
        if s.data:
            entry["data"] = b.add(s.data)
        entries.append(entry)
    return entries, b.blobs
