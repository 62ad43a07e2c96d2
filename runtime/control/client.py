"""The controller's side of the control plane: a client per worker, ControlPlane, and
StaticCluster.

ControlPlane is the one implementation of the Cluster protocol (runtime/control/cluster.py) over
gRPC workers; a Launcher only starts and stops the workers it talks to. StaticCluster
composes it with StaticLauncher (addresses of workers started elsewhere), LocalCluster with
LocalLauncher (runtime/launchers/local.py), RayCluster with RayLauncher (runtime/launchers/ray.py),
SharedCluster with SharedLauncher (runtime/launchers/shared.py: workers leased from a shared
cluster's manager).
`run` sends each worker ONE Run RPC per step, all in parallel, carrying the feeds that
slice needs; activations then flow slice to slice over the data plane, never through here.

Failure detection. Every worker is pinged every HEARTBEAT_S; a slice is declared lost when
an RPC to it fails for transport reasons (process gone: UNAVAILABLE at once) or when it has
not answered a heartbeat for `failure_timeout_s` (hung, stopped, cut off). `run` then
cancels the step everywhere and raises WorkerLost naming the slice.

No step waits forever. The first error reply from any slice aborts the step everywhere at
once; one that is not the echo of a lost slice is raised as StepFailed (slice, instruction,
the worker's message). A live worker whose heartbeats are answered can still be stuck (a
receive whose sender never sends, a program that never returns): each heartbeat reply
carries the slice's position in its stream (run id, instructions done, what it is doing),
and a step in which no slice moves and none finishes for `step_timeout_s` is aborted by a
watchdog and reported as WorkerLost for an unfinished slice, preferring one that is not
merely waiting for a peer, so the Trainer replaces it, restores and replays.

Replacement. The control plane remembers what it shipped to each slice (programs, plans),
so `replace(slice)` can bring the launcher's new worker to the same point: a spare address
(StaticLauncher), a new process (LocalLauncher), a new actor (RayLauncher), a worker the
shared cluster's manager leases in the lost one's place (SharedLauncher). State
(parameters) is not replayed: the caller restores it from a checkpoint.
"""
from __future__ import annotations

import collections
import secrets
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from mpmd.runtime.worker import instructions
from mpmd.runtime.worker import mesh
from mpmd.runtime.worker import streams
from mpmd.runtime.wire import format as wire
from mpmd.runtime.wire import verbs
from mpmd.runtime.control.cluster import InFlight, Launcher, PendingRun, ReplaceUnsupported, StepFailed, WorkerLost
from mpmd.runtime.wire.results import Aborted, Event, Progress, StepResult
from mpmd.runtime.worker.gang import GangClient, group_addresses
from mpmd.runtime.worker.service import FAILED_AT_KEY, GRPC_OPTIONS, SERVICE, TOKEN_KEY
from mpmd.runtime.worker.main import read_token_file

HEARTBEAT_S = 0.5
# The watchdog's timeout when step_timeout_s is None: max(MIN_STEP_TIMEOUT_S, STEP_TIMEOUT_FACTOR
# x the median of the last completed steps' times). Before any step has completed, the first
# runs compile their programs (seconds to minutes), hence FIRST_STEP_TIMEOUT_S.
MIN_STEP_TIMEOUT_S = 60.0
STEP_TIMEOUT_FACTOR = 20
FIRST_STEP_TIMEOUT_S = 300.0
# gRPC codes that mean "the worker is not there", as opposed to "it refused the request".
_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN}


class WorkerError(RuntimeError):
    """A worker failed or could not be reached; the message names its address."""

    def __init__(self, address: str, message: str, code=None):
        super().__init__(f"worker {address}: {message}")
        self.address = address
        self.code = code


class WorkerClient:
    def __init__(self, address: str, token: str, rpc_counts: collections.Counter, service: str = SERVICE):
        self.address = address
        self._service = service          # the gRPC service called: a worker's, or a shared cluster's manager
        self._metadata = ((TOKEN_KEY, token),)
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._counts = rpc_counts
        self._stubs = {}
        self.last_ok = time.monotonic()
        self.progress: Progress | None = None      # from the last heartbeat
        self.progress_at = time.monotonic()        # when `progress` last changed

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise WorkerError(self.address, f"did not answer within {timeout_s:g} s "
                                            f"(is `mpmd worker` running and listening there?)") from None

    def future(self, method: str, header: dict | None = None, blobs=(), timeout_s: float | None = None):
        """Start an RPC; `.result()` of the returned gRPC future gives the reply frame."""
        stub = self._stubs.get(method)
        if stub is None:
            stub = self._stubs[method] = self._channel.unary_unary(f"/{self._service}/{method}")
        self._counts[method] += 1
        try:
            return stub.future(wire.encode(header or {}, list(blobs)), metadata=self._metadata, timeout=timeout_s)
        except ValueError as e:      # the channel was closed: this client was replaced
            raise WorkerError(self.address, f"{method}: {e}") from None

    def result(self, method: str, fut):
        try:
            reply = fut.result()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ABORTED:
                raise Aborted(f"worker {self.address}: {e.details()}") from None
            raise WorkerError(self.address, f"{method} failed: {e.code().name}: {e.details()}", e.code()) from None
        self.last_ok = time.monotonic()
        return wire.decode(reply)

    def call(self, method: str, header: dict | None = None, blobs=(), timeout_s: float | None = None):
        return self.result(method, self.future(method, header, blobs, timeout_s))


    def close(self) -> None:
        self._channel.close()

def send(client: WorkerClient | GangClient, request, blobs=(), timeout_s: float | None = None, verb: str | None = None):
    """Start the RPC of a request record (runtime/wire/verbs.py); `verb` names a verb whose
    request is Empty (several verbs'). `.result()` as in receive."""
    verb = verb or verbs.verb_of(request)
    return client.future(verb, verbs.encode(request), blobs, timeout_s)


def receive(client: WorkerClient | GangClient, verb: str, fut):
    """(the reply record of `verb`, its blobs) once the RPC `send` started is answered."""
    header, blobs = client.result(verb, fut)
    return verbs.decode_reply(verb, header), blobs


def call(client: WorkerClient | GangClient, request, blobs=(), timeout_s: float | None = None, verb: str | None = None):
    """send, then receive: (reply record, blobs)."""
    verb = verb or verbs.verb_of(request)
    return receive(client, verb, send(client, request, blobs, timeout_s, verb))



def _arrays_out(b: wire.Builder, arrays) -> list:
    import numpy as np
    return [b.add(np.asarray(a)) for a in arrays]


class ControlPlane:
    """The Cluster protocol over gRPC workers that `launcher` starts and stops.

    token: the secret the launcher's workers hold (every RPC carries it).
    connect_timeout_s: how long a new worker may take to answer its first RPC.
    failure_timeout_s: a slice silent this long (no heartbeat answered) is declared lost.
    transfer_host: where workers' data-plane servers listen; None: the host of each
        worker's gRPC address.
    step_timeout_s: a step in which no slice advances for this long is aborted (watchdog);
        None: max(60 s, 20 x the median time of the recent steps), 300 s before any completed.
    """

    def __init__(self, launcher: Launcher, token: str, *, connect_timeout_s: float = 10.0,
                 failure_timeout_s: float = 5.0, transfer_host: str | None = None,
                 step_timeout_s: float | None = None):
        if not failure_timeout_s > 0:
            raise ValueError(f"failure_timeout_s must be positive, got {failure_timeout_s!r}")
        if step_timeout_s is not None and not (isinstance(step_timeout_s, (int, float)) and step_timeout_s > 0):
            raise ValueError(f"step_timeout_s must be positive or None (derived from step times), "
                             f"got {step_timeout_s!r}")
        self.step_timeout_s = step_timeout_s
        self._step_times: collections.deque = collections.deque(maxlen=20)
        self.launcher = launcher
        self._token = token
        self._connect_timeout_s = connect_timeout_s
        self.failure_timeout_s = failure_timeout_s
        self._transfer_host = transfer_host
        self.rpc_counts: collections.Counter = collections.Counter()
        self.clients: list[WorkerClient] = []      # one per slice
        self._slots: list[int] = []                # per slice: the launcher's slot its worker is in
        self._free_slots: list[int] = []           # slots whose worker was lost and left out (remove)
        self._others: list[WorkerClient] = []      # idle workers: heartbeats keep their lease
        self._shipped: list[dict] = []             # per slice: {"programs": {...}, "plans": {...}}
        self._transfer: dict[str, str | list[str]] = {}   # slice -> transfer address(es), one per process
        self._transfer_secret = ""                 # per session, made by start()
        self._meshes: list[dict] | None = None     # per slice: its mesh shape (None: data = its devices)
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = InFlight()               # runs launched, not yet collected
        self._collected_at = 0.0                   # monotonic time the last run was collected
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def addresses(self) -> list[str]:
        return self.launcher.addresses

    @property
    def num_slices(self) -> int:
        return len(self.clients)

    @property
    def devices_per_slice(self) -> int | None:
        """None: workers started elsewhere (StaticCluster, SharedCluster) each refuse a mesh
        their devices do not fit; a launcher that starts its own knows (LocalCluster, RayCluster)."""
        return None

    # -- membership --------------------------------------------------------------------------
    def start(self, num_slices: int, root: str | None = None, meshes=None) -> None:
        """Attach to the launcher's first `num_slices` workers and give each a fresh slice (new
        executor, new transfer server): a cluster that is already started is reused from a
        clean state, on the workers it has. `root`, `meshes`: see Cluster.start.

        Each start makes a new data-plane secret for the session (runtime/wire/transport.py): a
        worker it is sent to keys its transfer ids with it, so no one else can pull them."""
        addresses = self.launcher.start(num_slices, root=root)
        self._meshes = [dict(zip(mesh.AXES, mesh.shape_of(m))) for m in meshes] if meshes is not None else None
        self._transfer_secret = secrets.token_bytes(32).hex()
        if self.clients:
            self._detach()
        self._in_flight = InFlight()
        self.clients = [self._client(a) for a in addresses[:num_slices]]
        self._others = [self._client(a) for a in addresses[num_slices:]]
        self._slots, self._free_slots = list(range(num_slices)), []
        self._pool = ThreadPoolExecutor(max(2 * num_slices, 2), thread_name_prefix="mpmd-ctl")
        try:
            list(self._pool.map(lambda c: c.wait_ready(self._connect_timeout_s), self.clients))
            self._set_up_all()
        except BaseException:
            self.close()
            raise
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="mpmd-heartbeat")
        self._heartbeat.start()

    def _set_up_all(self) -> None:
        """Give every slice a fresh executor and transfer server under its index and connect
        them all: nothing shipped or stored before survives."""
        self._shipped = [{"programs": {}, "plans": {}} for _ in self.clients]
        self._transfer = {str(i): self._setup(i, c) for i, c in enumerate(self.clients)}
        for i in range(len(self.clients)):
            self._call(i, verbs.Connect(self._transfer))

    def remove(self, slice_index: int, meshes=None) -> None:
        """Leave lost slice `slice_index` out: the slices after it move down one index, and
        every remaining slice starts afresh (see Cluster.remove). Its launcher slot is kept
        free for `add`. WorkerLost if another slice is found gone meanwhile."""
        self.clients.pop(slice_index).close()
        self._free_slots.append(self._slots.pop(slice_index))
        if meshes is not None:
            self._meshes = [dict(zip(mesh.AXES, mesh.shape_of(m))) for m in meshes]
        self._in_flight = InFlight()
        self._set_up_all()

    def add(self, meshes=None, before_reset=None) -> None:
        """A new worker as the last slice, in a slot a lost worker left (the launcher's
        `replace` of that slot), then every slice starts afresh (see Cluster.add).
        ReplaceUnsupported when the launcher has none; then nothing changed."""
        if not self._free_slots:
            raise ReplaceUnsupported(f"every slot of this cluster already serves a slice ({len(self.clients)})")
        slot = self._free_slots[0]
        c = self._client(self._new_worker(slot))
        try:
            c.wait_ready(self._connect_timeout_s)
            if before_reset is not None:
                before_reset()
        except WorkerError as e:
            c.close()
            raise ReplaceUnsupported(f"the new worker for slot {slot} did not answer: {e}") from None
        except BaseException:
            c.close()
            raise
        self._free_slots.pop(0)
        self.clients.append(c)
        self._slots.append(slot)
        if meshes is not None:
            self._meshes = [dict(zip(mesh.AXES, mesh.shape_of(m))) for m in meshes]
        self._in_flight = InFlight()
        self._set_up_all()

    def _client(self, address) -> WorkerClient | GangClient:
        """A client for a slice's worker ("host:port"), or for its gang (one address per
        process: runtime/worker/gang.py)."""
        if isinstance(address, (list, tuple)):
            return GangClient([WorkerClient(a, self._token, self.rpc_counts) for a in address])
        return WorkerClient(address, self._token, self.rpc_counts)

    def _setup(self, i: int, c: WorkerClient | GangClient) -> str | list[str]:
        """Set slice i up on its worker, or on every process of its gang (each listening for
        transfers on its own host); its transfer address, or one per process."""
        members = c.members if isinstance(c, GangClient) else [c]
        futs = []
        for m in members:
            host = self._transfer_host or m.address.rpartition(":")[0].strip("[]")
            setup = verbs.Setup(i, host, self._transfer_secret, self._meshes[i] if self._meshes is not None else None)
            futs.append((m, send(m, setup)))
        addresses = [receive(m, "Setup", f)[0].transfer_address for m, f in futs]
        return addresses[0] if not isinstance(c, GangClient) else addresses

    def _beat(self) -> None:
        # Keeps the workers' lease alive and feeds failure detection (WorkerClient.last_ok).
        # One future per worker per round, so a hung worker does not delay the others' pings.
        while not self._stop.wait(HEARTBEAT_S):
            futs = []
            for c in list(self.clients) + list(self._others):
                try:
                    futs.append((c, send(c, verbs.Empty(), timeout_s=HEARTBEAT_S * 2, verb="Heartbeat")))
                except WorkerError:
                    pass             # replaced while we looked
            for c, f in futs:
                try:
                    progress = receive(c, "Heartbeat", f)[0].progress
                except (WorkerError, Aborted):
                    continue
                if isinstance(progress, list) and len(progress) == 3:
                    progress = Progress(*progress)
                    if progress != c.progress:
                        c.progress, c.progress_at = progress, time.monotonic()

    def step_timeout(self) -> float:
        """The watchdog's timeout for the next step, in seconds."""
        if self.step_timeout_s is not None:
            return self.step_timeout_s
        if not self._step_times:
            return FIRST_STEP_TIMEOUT_S
        return max(MIN_STEP_TIMEOUT_S, STEP_TIMEOUT_FACTOR * statistics.median(self._step_times))

    def lost_slice(self) -> tuple[int, str] | None:
        """(slice, why) of a slice silent for longer than failure_timeout_s, if any."""
        now = time.monotonic()
        for i, c in enumerate(self.clients):
            if now - c.last_ok > self.failure_timeout_s:
                return i, f"no answer for {now - c.last_ok:.1f} s (failure_timeout_s={self.failure_timeout_s:g})"
        return None

    def replace(self, slice_index: int) -> None:
        """Put a new worker in place of a lost slice and bring it to where the slice was:
        same programs and plans; every slice's transfers reconnected. State is not restored.
        WorkerLost if another slice is found gone meanwhile (the new worker is in place)."""
        address = self._new_worker(self._slots[slice_index])   # ReplaceUnsupported: nothing changed
        self.clients[slice_index].close()
        c = self._client(address)
        c.wait_ready(self._connect_timeout_s)
        self.clients[slice_index] = c
        self._transfer[str(slice_index)] = self._setup(slice_index, c)
        shipped = self._shipped[slice_index]
        if shipped["programs"]:
            self._load(slice_index, shipped["programs"])
        for name, stream in shipped["plans"].items():
            self._install(slice_index, name, stream)
        # Every other slice learns the new address; one found gone (two lost at once) is
        # reported after all the others are connected, so replacing it next completes this.
        gone = []
        for i in range(len(self.clients)):
            try:
                self._call(i, verbs.Connect(self._transfer))
            except WorkerLost as e:
                gone.append(e)
        if gone:
            raise gone[0]

    def _new_worker(self, slot: int) -> str:
        """The launcher's new worker for `slot`; an idle spare it hands over stops being idle."""
        address = self.launcher.replace(slot)
        self._others = [o for o in self._others if o.address != address]
        return address

    # -- the cluster verbs -------------------------------------------------------------------
    def load_programs(self, slice_index: int, specs: dict) -> None:
        self._shipped[slice_index]["programs"].update(specs)
        self._load(slice_index, specs)

    def _load(self, slice_index: int, specs: dict) -> None:
        b = wire.Builder()
        progs = []
        for name, s in specs.items():
            entry = {"name": name, "kind": s.kind, "duration_s": s.duration_s,
                     "outputs": [[[list(x.shape), x.dtype] for x in bundle] for bundle in s.outputs]}
            if s.data:
                entry["data"] = b.add(s.data)
            progs.append(entry)
        self._call(slice_index, verbs.LoadPrograms(progs), b.blobs)

    def install_plan(self, slice_index: int, name: str, stream) -> None:
        self._shipped[slice_index]["plans"][name] = stream if isinstance(stream, streams.PackedStream) else list(stream)
        self._install(slice_index, name, stream)

    def _install(self, slice_index: int, name: str, stream) -> None:
        if isinstance(stream, streams.PackedStream):     # compact bytes; the worker expands them
            b = wire.Builder()
            self._call(slice_index, verbs.InstallPlan(name, encoded=b.add(stream.to_bytes())), b.blobs)
        else:
            self._call(slice_index, verbs.InstallPlan(name, stream=[instructions.to_json(i) for i in stream]))

    def put(self, slice_index: int, name: str, arrays, layouts=None) -> None:
        b = wire.Builder()
        refs = _arrays_out(b, arrays)
        laid = [instructions.layout_to_json(tuple(l)) for l in layouts] if layouts is not None else None
        self._call(slice_index, verbs.Put(name, refs, laid), b.blobs)

    def get(self, slice_index: int, names) -> dict:
        reply, blobs = self._call(slice_index, verbs.Get(list(names)))
        return {n: tuple(wire.blob(blobs, r) for r in refs) for n, refs in reply.arrays.items()}

    def delete(self, slice_index: int, names) -> None:
        self._call(slice_index, verbs.Delete(list(names)))

    def save(self, slice_index: int, items: dict) -> None:
        self._call(slice_index, verbs.Save(items))

    def wait_saves(self, slice_index: int, directories=None) -> list[str]:
        """Blocks while the slice writes (that may take long) but not past its loss."""
        c = self.clients[slice_index]
        fut = send(c, verbs.WaitSaves(None if directories is None else list(directories)))
        while not fut.done():
            time.sleep(0.05)
            lost = self.lost_slice()
            if lost is not None and lost[0] == slice_index:
                fut.cancel()
                raise WorkerLost(slice_index, c.address, lost[1])
        try:
            return receive(c, "WaitSaves", fut)[0].finalized
        except WorkerError as e:      # the worker died while writing: its slice is lost,
            if e.code in _GONE:       # not its checkpoint (as _call reports every other verb)
                raise WorkerLost(slice_index, e.address, str(e)) from None
            raise

    def restore(self, slice_index: int, items: dict, staged: bool = False, layouts=None) -> None:
        laid = {n: [instructions.layout_to_json(tuple(l)) for l in ls] for n, ls in layouts.items()} if layouts else None
        self._call(slice_index, verbs.Restore(items, staged, laid))

    def finish_restore(self, slice_index: int, commit: bool) -> None:
        self._call(slice_index, verbs.FinishRestore(commit))

    def run(self, plan: str, run: int, feeds: dict[int, dict], fetch: dict[int, tuple],
            trace: bool = False) -> list[StepResult]:
        return self.launch(plan, run, feeds, fetch, trace).result()

    def launch(self, plan: str, run: int, feeds: dict[int, dict], fetch: dict[int, tuple],
               trace: bool = False) -> PendingRun:
        """Send run `run` to every slice (its feeds with it) and return; see Cluster.launch."""
        after = self._in_flight.after()
        futs = []
        for i, c in enumerate(self.clients):
            b = wire.Builder()
            fed = {n: _arrays_out(b, arrays) for n, arrays in (feeds.get(i) or {}).items()}
            futs.append(send(c, verbs.Run(plan, run, after, fed, list(fetch.get(i, ())), trace), b.blobs))
        return self._in_flight.add(PendingRun(run, self._collect, futs, time.monotonic()))

    def _collect(self, run: PendingRun) -> list[StepResult]:
        self._in_flight.collecting(run)
        try:
            return self._wait_run(run)
        finally:
            self._collected_at = time.monotonic()
            if self._in_flight.runs and self._in_flight.runs[0] is run:
                self._in_flight.done(run)

    def _wait_run(self, run: PendingRun) -> list[StepResult]:
        # A run sent ahead starts on the slices once the one before it is done: its clock
        # (watchdog, step times) starts when that one was collected, or when it was sent.
        run_id, futs = run.run, run.futures
        t0 = max(run.sent_at, self._collected_at)
        timeout_s = self.step_timeout()
        # Wake on every completion (a sleep-poll here cost ~5 ms per step), and at least every
        # 50 ms to look for a silent slice or a stalled step. `failed` keeps the order in
        # which slices failed: the first is the root cause, later ones may be its echoes.
        changed = threading.Event()
        failed: list[int] = []
        last_done = [t0]

        def done(i, f):
            last_done[0] = time.monotonic()
            if not f.cancelled() and f.exception() is not None:
                failed.append(i)
            changed.set()
        for i, f in enumerate(futs):
            f.add_done_callback(lambda f, i=i: done(i, f))
        lost = stalled = None
        while lost is None and stalled is None and not failed and not all(f.done() for f in futs):
            changed.wait(0.05)
            changed.clear()
            lost = self.lost_slice() or self._gone(futs)
            stalled = self._stalled(run_id, futs, max(last_done[0], t0), timeout_s)
        lost = lost or self.lost_slice() or self._gone(futs)
        if lost is None and stalled is None and not failed:
            self._step_times.append(time.monotonic() - t0)
            return [self._step_result(c, f) for c, f in zip(self.clients, futs)]
        # Every run in flight goes: this one, and those sent ahead of it (never run, or
        # aborted where they started). Aborting the newest id aborts every earlier one.
        later = [r.futures for r in self._in_flight.runs if r is not run]
        newest = self._in_flight.drop_all(f"run {run_id} before it failed")
        if lost is None and stalled is not None:
            # The stalled slice is alive (it answers heartbeats): abort it too, wait not for it.
            self._abort_all(newest, [futs] + later, stalled[0], abort_lost=True)
            raise WorkerLost(stalled[0], self.clients[stalled[0]].address, stalled[1])
        self._abort_all(newest, [futs] + later, lost[0] if lost else None)
        # A survivor's error may be only the echo of a peer's death (its transfer broke):
        # ask everyone before blaming the slice that reported first.
        lost = lost or self._probe()
        if lost is not None:
            raise WorkerLost(lost[0], self.clients[lost[0]].address, lost[1])
        order = failed + [i for i, f in enumerate(futs) if f.done() and not f.cancelled()
                          and f.exception() is not None and i not in failed]
        root = [i for i in order if futs[i].exception().code() != grpc.StatusCode.ABORTED] or order
        raise self._step_failed(root[0], futs[root[0]].exception())

    def _stalled(self, run: int, futs, last_done: float, timeout_s: float) -> tuple[int, str] | None:
        """(slice, why) to blame if no slice has finished or advanced in run `run` for
        timeout_s; the blamed one is unfinished and, if any is, not waiting for a peer."""
        now = time.monotonic()
        moved = [c.progress_at for c in self.clients if c.progress is not None and c.progress.run == run]
        if now - max([last_done] + moved) <= timeout_s:
            return None
        unfinished = [i for i, f in enumerate(futs) if not f.done()]
        where = {i: self.clients[i].progress for i in unfinished}
        busy = [i for i in unfinished if where[i] is None or where[i].run != run or where[i].doing != "recv"]
        blame = (busy or unfinished)[0]
        at = {i: (f"instruction {p.done} ({p.doing})" if p is not None and p.run == run else "not started")
              for i, p in where.items()}
        return blame, (f"run {run} made no progress for {now - max([last_done] + moved):.1f} s "
                       f"(step_timeout_s={timeout_s:g}); unfinished slices: "
                       + ", ".join(f"{i} at {a}" for i, a in at.items()))

    def _step_failed(self, slice_index: int, e: grpc.RpcError) -> Exception:
        """The error a failed Run reply stands for: StepFailed naming slice and instruction."""
        trailing = dict(e.trailing_metadata() or ())
        at = trailing.get(FAILED_AT_KEY)
        at = at.decode(errors="replace") if isinstance(at, bytes) else "Run"
        address = self.clients[slice_index].address
        return StepFailed(slice_index, at, f"{e.code().name} from worker {address}: {e.details()}")

    @staticmethod
    def _gone(futs) -> tuple[int, str] | None:
        for i, f in enumerate(futs):
            e = f.exception() if f.done() and not f.cancelled() else None
            if isinstance(e, grpc.RpcError) and e.code() in _GONE:
                return i, f"{e.code().name}: {e.details()}"
        return None

    def _probe(self) -> tuple[int, str] | None:
        futs = [send(c, verbs.Empty(), timeout_s=min(2.0, self.failure_timeout_s), verb="Heartbeat")
                for c in self.clients]
        for f in futs:
            f.exception()          # wait
        return self._gone(futs)

    def _call(self, slice_index: int, request, blobs=()):
        """The RPC of a request record to a slice: (reply record, blobs); a worker that is not
        there anymore is reported as WorkerLost."""
        c = self.clients[slice_index]
        try:
            return call(c, request, blobs)
        except WorkerError as e:
            if e.code in _GONE:
                raise WorkerLost(slice_index, e.address, str(e)) from None
            raise

    def _step_result(self, c: WorkerClient, fut) -> StepResult:
        reply, blobs = receive(c, "Run", fut)
        fetched = {n: tuple(wire.blob(blobs, r) for r in refs) for n, refs in reply.fetched.items()}
        return StepResult(fetched, tuple(Event(*e) for e in reply.events), reply.wall_s, reply.peak_held,
                          reply.peak_held_bytes, reply.peak_bytes)

    def _abort_all(self, run: int, runs=(), lost: int | None = None, abort_lost: bool = False) -> None:
        """Abort run `run` (and every earlier one) everywhere; `runs`: the per-slice Run
        futures of each run in flight. The lost slice, if known, is not waited for: it is hung
        or gone, and its Run is simply cancelled (it is sent the Abort too if `abort_lost`)."""
        live = [i for i in range(len(self.clients)) if i != lost or abort_lost]
        aborts = [(self.clients[i], send(self.clients[i], verbs.Abort(run), timeout_s=2.0)) for i in live]
        for c, f in aborts:
            try:
                receive(c, "Abort", f)
            except (WorkerError, Aborted):
                pass
        # Survivors answer ABORTED promptly once aborted.
        deadline = time.monotonic() + 2.0
        for futs in runs:
            for i, f in enumerate(futs):
                while i != lost and not f.done() and time.monotonic() < deadline:
                    time.sleep(0.01)
                f.cancel()

    # -- shutdown ----------------------------------------------------------------------------
    def _detach(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        for c in self.clients + self._others:
            c.close()
        self.clients, self._others = [], []
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def close(self) -> None:
        """Shut the workers down (a worker started with --persist resets instead), then let the
        launcher stop what it started."""
        futs = [(c, send(c, verbs.Empty(), timeout_s=2.0, verb="Shutdown")) for c in self.clients + self._others]
        for c, f in futs:
            try:
                receive(c, "Shutdown", f)
            except (WorkerError, Aborted):
                pass
        self._detach()
        self.launcher.stop()


class StaticLauncher:
    """Workers started elsewhere (`mpmd worker --listen HOST:PORT`), given by address. Slices
    take the first addresses; the others are spares, each replacing one lost slice."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self._spares: list[str] = []

    def start(self, num_slices: int, root: str | None = None) -> list[str]:
        # root is not ours to set: each worker was started with its own --root, and refuses
        # a checkpoint directory outside it.
        if len(self.addresses) < num_slices:
            raise ValueError(f"{num_slices} slices need {num_slices} workers, got {len(self.addresses)} "
                             f"address(es): {self.addresses}")
        self._spares = list(self.addresses[num_slices:])
        return list(self.addresses)

    def replace(self, slot: int) -> str:
        if not self._spares:
            raise ReplaceUnsupported(f"slice {slot} was lost and StaticCluster has no spare address left "
                                     f"(give more addresses than slices to allow replacement)")
        return self._spares.pop(0)

    def stop(self) -> None:
        pass          # not ours to stop: the control plane's Shutdown RPC is all they get


class StaticCluster(ControlPlane):
    """Workers started elsewhere with `mpmd worker --listen HOST:PORT --token-file F --root DIR`
    (DIR must hold the run_dir of any Trainer that checkpoints on them).

    A slice served by a gang of processes (runtime/worker/gang.py) is a list of its processes'
    addresses, process 0 first (or cut from a flat list by `processes_per_slice`; None: 1
    for a flat list, the lists' own length otherwise); each
    process was started with `mpmd worker ... --coordinator HOST0:PORT --num-processes k
    --process-id j`, HOST0:PORT a free port on process 0's host.
    The first `num_slices` addresses serve slices; the others are spares that replace a
    lost slice. A token file that its group or others may read is refused unless
    `allow_insecure_token_file` (see read_token_file).
    """

    def __init__(self, addresses, *, token_file: str | None = None, token: str | None = None,
                 connect_timeout_s: float = 10.0, failure_timeout_s: float = 5.0,
                 transfer_host: str | None = None, step_timeout_s: float | None = None,
                 allow_insecure_token_file: bool = False, processes_per_slice: int | None = None):
        addresses = group_addresses(addresses, processes_per_slice)
        if token is None:
            if token_file is None:
                raise ValueError("StaticCluster needs token_file (the file the workers were given) or token")
            token = read_token_file(token_file, allow_insecure_token_file, "token_file",
                                    "allow_insecure_token_file=True")
        super().__init__(StaticLauncher(addresses), token, connect_timeout_s=connect_timeout_s,
                         failure_timeout_s=failure_timeout_s, transfer_host=transfer_host, step_timeout_s=step_timeout_s)


def new_token() -> str:
    return secrets.token_hex(16)

