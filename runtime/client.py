"""The controller's side of the control plane: a client per worker, and StaticCluster.

A cluster exposes the same verbs as InProcessCluster (start, load_programs, install_plan,
put, get, delete, run, close), so the Trainer has one code path for every backend.
`run` sends each worker ONE Run RPC per step, all in parallel, carrying the feeds that slice
needs; activations then flow slice to slice over the data plane, never through here.
"""
from __future__ import annotations

import collections
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from runtime import instructions, wire
from runtime.executor import Aborted, Event, StepResult
from runtime.inprocess import gather
from runtime.service import GRPC_OPTIONS, SERVICE, TOKEN_KEY

log = logging.getLogger("mpmd.controller")
HEARTBEAT_S = 1.0


class WorkerError(RuntimeError):
    """A worker failed or could not be reached; the message names its address."""

    def __init__(self, address: str, message: str, code=None):
        super().__init__(f"worker {address}: {message}")
        self.address = address
        self.code = code


class WorkerClient:
    def __init__(self, address: str, token: str, rpc_counts: collections.Counter):
        self.address = address
        self._metadata = ((TOKEN_KEY, token),)
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._counts = rpc_counts
        self._stubs = {}

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise WorkerError(self.address, f"did not answer within {timeout_s:g} s "
                                            f"(is `mpmd worker` running and listening there?)") from None

    def call(self, method: str, header: dict | None = None, blobs=(), timeout_s: float | None = None):
        stub = self._stubs.get(method)
        if stub is None:
            stub = self._stubs[method] = self._channel.unary_unary(f"/{SERVICE}/{method}")
        self._counts[method] += 1
        try:
            reply = stub(wire.encode(header or {}, list(blobs)), metadata=self._metadata, timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ABORTED:
                raise Aborted(f"worker {self.address}: {e.details()}") from None
            raise WorkerError(self.address, f"{method} failed: {e.code().name}: {e.details()}", e.code()) from None
        return wire.decode(reply)

    def close(self) -> None:
        self._channel.close()


def _arrays_out(b: wire.Builder, arrays) -> list:
    import numpy as np
    return [b.add(np.asarray(a)) for a in arrays]


class StaticCluster:
    """Workers started elsewhere with `mpmd worker --listen HOST:PORT --token-file F`.

    The first `num_slices` addresses serve slices; any further ones are spares.
    """

    def __init__(self, addresses, token_file: str | None = None, token: str | None = None,
                 connect_timeout_s: float = 10.0, transfer_host: str | None = None):
        addresses = list(addresses)
        if not addresses or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in addresses):
            raise ValueError(f"addresses must be a non-empty list of 'host:port' strings, got {addresses!r}")
        if token is None:
            if token_file is None:
                raise ValueError("StaticCluster needs token_file (the file the workers were given) or token")
            try:
                with open(token_file) as f:
                    token = f.readline().strip()
            except OSError as e:
                raise ValueError(f"cannot read token_file {token_file!r}: {e.strerror}") from None
        self.addresses = addresses
        self._token = token
        self._connect_timeout_s = connect_timeout_s
        self._transfer_host = transfer_host
        self.rpc_counts: collections.Counter = collections.Counter()
        self.clients: list[WorkerClient] = []      # one per slice
        self._all: list[WorkerClient] = []         # one per address
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def num_slices(self) -> int:
        return len(self.clients)

    def start(self, num_slices: int) -> None:
        """Attach to the first `num_slices` workers and give each a fresh slice (new executor,
        new transfer server): a cluster that is already started is reused from a clean state."""
        if self.clients:
            self._detach()
        if len(self.addresses) < num_slices:
            raise ValueError(f"{num_slices} slices need {num_slices} workers, got {len(self.addresses)} "
                             f"address(es): {self.addresses}")
        # Clients for every address, spares included: all of them get heartbeats, so a worker
        # that served an earlier Trainer and now idles keeps its lease.
        self._all = [WorkerClient(a, self._token, self.rpc_counts) for a in self.addresses]
        self.clients = self._all[:num_slices]
        self._pool = ThreadPoolExecutor(max(num_slices, 1), thread_name_prefix="mpmd-ctl")
        try:
            list(self._pool.map(lambda c: c.wait_ready(self._connect_timeout_s), self.clients))
            transfer = {}
            for i, c in enumerate(self.clients):
                host = self._transfer_host or c.address.rpartition(":")[0].strip("[]")
                transfer[str(i)] = c.call("Setup", {"slice_index": i, "transfer_host": host})[0]["transfer_address"]
            for c in self.clients:
                c.call("Connect", {"peers": transfer})
        except BaseException:
            self.close()
            raise
        self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="mpmd-heartbeat")
        self._heartbeat.start()

    def _beat(self) -> None:
        # Keeps the workers' lease alive; failure detection builds on these replies.
        while not self._stop.wait(HEARTBEAT_S):
            for c in list(self._all):
                try:
                    c.call("Heartbeat", timeout_s=HEARTBEAT_S * 2)
                except (WorkerError, Aborted) as e:
                    log.warning("heartbeat: %s", e)

    # -- the cluster verbs -------------------------------------------------------------------
    def load_programs(self, slice_index: int, specs: dict) -> None:
        b = wire.Builder()
        progs = []
        for name, s in specs.items():
            entry = {"name": name, "kind": s.kind, "duration_s": s.duration_s,
                     "outputs": [[[list(x.shape), x.dtype] for x in bundle] for bundle in s.outputs]}
            if s.data:
                entry["data"] = b.add(s.data)
            progs.append(entry)
        self.clients[slice_index].call("LoadPrograms", {"programs": progs}, b.blobs)

    def install_plan(self, slice_index: int, name: str, stream) -> None:
        self.clients[slice_index].call("InstallPlan", {"name": name, "stream": [instructions.to_json(i) for i in stream]})

    def put(self, slice_index: int, name: str, arrays) -> None:
        b = wire.Builder()
        self.clients[slice_index].call("Put", {"name": name, "arrays": _arrays_out(b, arrays)}, b.blobs)

    def get(self, slice_index: int, names) -> dict:
        h, blobs = self.clients[slice_index].call("Get", {"names": list(names)})
        return {n: tuple(wire.blob(blobs, r) for r in refs) for n, refs in h["arrays"].items()}

    def delete(self, slice_index: int, names) -> None:
        self.clients[slice_index].call("Delete", {"names": list(names)})

    def run(self, plan: str, step: int, feeds: dict[int, dict], fetch: dict[int, tuple],
            trace: bool = False) -> list[StepResult]:
        def one(i: int) -> StepResult:
            b = wire.Builder()
            header = {"plan": plan, "step": step, "fetch": list(fetch.get(i, ())), "trace": trace,
                      "feeds": {n: _arrays_out(b, arrays) for n, arrays in (feeds.get(i) or {}).items()}}
            h, blobs = self.clients[i].call("Run", header, b.blobs)
            fetched = {n: tuple(wire.blob(blobs, r) for r in refs) for n, refs in h["fetched"].items()}
            return StepResult(fetched, tuple(Event(*e) for e in h["events"]), h["wall_s"])

        futures = [self._pool.submit(one, i) for i in range(len(self.clients))]
        return gather(futures, on_error=self._abort_all)

    def _abort_all(self) -> None:
        for c in self.clients:
            try:
                c.call("Abort", timeout_s=2.0)
            except (WorkerError, Aborted):
                pass

    def _detach(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        self._stop = threading.Event()
        for c in self._all:
            c.close()
        self.clients, self._all = [], []
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def close(self) -> None:
        """Shut the workers down (a worker started with --persist resets instead)."""
        for c in self._all:
            try:
                c.call("Shutdown", timeout_s=2.0)
            except (WorkerError, Aborted):
                pass
        self._detach()


def new_token() -> str:
    return secrets.token_hex(16)
