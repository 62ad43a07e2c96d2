"""The controller's side of the control plane: ControlPlane, the one implementation of the
Cluster protocol (runtime/control/cluster.py) over gRPC workers; a Launcher only starts and
stops the workers it talks to. StaticCluster composes it with StaticLauncher (addresses of
workers started elsewhere: runtime/launchers/static.py), LocalCluster with LocalLauncher
(runtime/launchers/local.py), RayCluster with RayLauncher (runtime/launchers/ray.py),
SharedCluster with SharedLauncher (runtime/launchers/shared.py: workers leased from a shared
cluster's manager). Its parts: a client per worker and the typed verb helpers
(runtime/control/rpc.py), and the wait for a run with its watchdog and aborts
(runtime/control/runs.py).

`run` sends each worker ONE Run RPC per step, all in parallel, carrying the feeds that
slice needs; activations then flow slice to slice over the data plane, never through here.

Failure detection. Every worker is sent a heartbeat every HEARTBEAT_S; a slice is declared
lost when an RPC to it fails for transport reasons (process gone), when a worker whose
heartbeat went unanswered fails its probe (hung, stopped, cut off: runtime/control/heartbeat.py,
in well under a second), or when it has not answered a heartbeat for `failure_timeout_s`
whatever its probes said. What a run does then: runs.py.

Generations. The control plane's view of its workers has a generation: a number that grows
with every start, replacement, shrink and grow, each time past every generation a worker of
it reports having seen (Hello), so a controller started again is newer than the one before
it. Every RPC carries it (runtime/worker/service.py, "Generations"): a worker refuses calls of
an older generation than it was admitted in, and keys its transfers with it; checkpoint
parts are written to directories named for it (`generation_tag`), so a worker left behind
in an older generation can never write where the current one commits.

Replacement. The control plane remembers what it shipped to each slice (programs, plans),
so `replace(slice)` can bring the launcher's new worker to the same point: a spare address
(StaticLauncher), a new process (LocalLauncher), a new actor (RayLauncher), a worker the
shared cluster's manager leases in the lost one's place (SharedLauncher). With hot spares
(runtime/control/spares.py) a warm spare takes the slice instead, and the launcher's new
worker becomes a spare in the background. State (parameters) is not replayed: the caller
restores it from a checkpoint.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from mpmd.runtime import compat
from mpmd.runtime.worker import instructions
from mpmd.runtime.worker import mesh
from mpmd.runtime.worker import streams
from mpmd.runtime.wire import format as wire
from mpmd.runtime.wire import verbs
from mpmd.runtime.wire.verbs import check_transport
from mpmd.runtime.control.cluster import InFlight, Launcher, PendingRun, ReplaceUnsupported, RunDispatch, WorkerLost
from mpmd.runtime.control.heartbeat import HEARTBEAT_S, PROBE_TIMEOUT_S, Heartbeats
from mpmd.runtime.control.rpc import GONE, WorkerClient, WorkerError, call, new_token, program_entries, receive, send  # noqa: F401
from mpmd.runtime.control.spares import HotSpares, new_calls
from mpmd.runtime.control.runs import FIRST_STEP_TIMEOUT_S, MIN_STEP_TIMEOUT_S, STEP_TIMEOUT_FACTOR, RunWatch  # noqa: F401
from mpmd.runtime.wire.results import Aborted, StepResult
from mpmd.runtime.wire.tls import Tls
from mpmd.runtime.worker.gang import GangClient

READMIT_PROBE_S = 1.0  # how long replace() waits for a lost worker's answer before looking again
log = logging.getLogger("mpmd")


def _settled(fut, timeout_s: float) -> bool:
    """Whether an RPC's future (a gRPC one, or a gang's) is done, waiting up to `timeout_s`."""
    try:
        fut.exception(timeout=timeout_s)
    except (grpc.FutureTimeoutError, TimeoutError):
        return False
    except grpc.FutureCancelledError:
        pass
    return True


def _arrays_out(b: wire.Builder, arrays) -> list:
    import numpy as np

    return [b.add(np.asarray(a)) for a in arrays]


class ControlPlane(RunDispatch):
    """The Cluster protocol over gRPC workers that `launcher` starts and stops.

    token: the secret the launcher's workers hold (every RPC carries it).
    tls: the cluster's certificates (runtime/wire/tls.py): every channel to a worker is then
        mutual TLS, and a worker without a certificate of the same authority is refused at
        the handshake; None: in the clear.
    connect_timeout_s: how long a new worker may take to answer its first RPC.
    failure_timeout_s: a slice silent this long (no heartbeat answered) is declared lost,
        whatever its probes said: the bound on finding a hung worker.
    probe_timeout_s: a worker whose heartbeat is unanswered is probed (runtime/control/heartbeat.py):
        a new connection up and its HTTP/2 ping acknowledged by gRPC's own threads, each within
        this many seconds, else it is hung; None: no probes, failure_timeout_s alone. Settable.
    transfer_host: where workers' data-plane servers listen; None: the host of each
        worker's gRPC address.
    step_timeout_s: a step in which no slice advances for this long is aborted (watchdog);
        None: max(60 s, 20 x the median time of the recent steps), 300 s before any completed.
    transport: the data plane between slices (runtime/wire/transport.py): "auto" = shared
        memory between workers on one host, jax.experimental.transfer's sockets between hosts;
        "socket" = sockets always; "shm" = shared memory always (a pair that cannot, a gang or
        workers on two hosts, fails the start with a ValueError). Settable: it applies from
        the next start.
    hot_spares: workers beyond the slices kept warm (runtime/control/spares.py): the launcher
        starts num_slices + hot_spares; a lost slice is taken over by one with nothing to
        spawn or compile, and another is started in the background to restore the count.
    """

    def __init__(
        self,
        launcher: Launcher,
        token: str,
        *,
        connect_timeout_s: float = 10.0,
        failure_timeout_s: float = 5.0,
        transfer_host: str | None = None,
        step_timeout_s: float | None = None,
        transport: str = "auto",
        tls: Tls | None = None,
        hot_spares: int = 0,
        probe_timeout_s: float | None = PROBE_TIMEOUT_S,
    ):
        if not failure_timeout_s > 0:
            raise ValueError(f"failure_timeout_s must be positive, got {failure_timeout_s!r}")
        self._watch = RunWatch(self, step_timeout_s)  # waits for runs, aborts them
        self.launcher = launcher
        self._token = token
        self.tls = tls  # every channel's mutual TLS (runtime/wire/tls.py); None: in the clear
        self._connect_timeout_s = connect_timeout_s
        self.failure_timeout_s = failure_timeout_s
        self._transfer_host = transfer_host
        self.transport = transport
        self.rpc_counts: collections.Counter = collections.Counter()
        self.clients: list[WorkerClient] = []  # one per slice
        self._slots: list[int] = []  # per slice: the launcher's slot its worker is in
        self._free_slots: list[int] = []  # slots whose worker was lost and left out (remove)
        self._others: list[WorkerClient] = []  # idle workers: heartbeats keep their lease
        self._shipped: list[dict] = []  # per slice: {"programs": {...}, "plans": {...}}
        self._transfer: dict[str, str | list[str]] = {}  # slice -> transfer address(es), one per process
        self._transfer_secret = ""  # per session, made by start()
        self._meshes: list[dict] | None = None  # per slice: its mesh shape (None: data = its devices)
        self._pool: ThreadPoolExecutor | None = None
        self.generation = 0  # see "Generations" above
        self._incarnation = secrets.token_hex(3)  # this control plane's, in generation_tag
        self._in_flight = InFlight()  # runs launched, not yet collected
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._launching = threading.Lock()  # one launcher call at a time (a spare starts in the background)
        self.spares = HotSpares(
            hot_spares,
            client_of=self._client,
            new_worker=self._spare_worker,
            warm_request=self._warm_request,
            num_slices=lambda: len(self.clients),
            generation=lambda: self.generation,
            connect_timeout_s=connect_timeout_s,
        )
        self.heartbeats = Heartbeats(probe_timeout_s)  # their rounds, probes and verdicts

    @property
    def hot_spares(self) -> int:
        return self.spares.count

    def slot_of(self, slice_index: int) -> int:
        """The launcher slot whose worker serves slice `slice_index` now (a promoted hot spare
        serves from its own slot)."""
        return self._slots[slice_index]

    @property
    def probe_timeout_s(self) -> float | None:
        return self.heartbeats.probe_timeout_s

    @probe_timeout_s.setter
    def probe_timeout_s(self, value: float | None) -> None:
        self.heartbeats.probe_timeout_s = value

    @property
    def transport(self) -> str:
        return self._transport

    @transport.setter
    def transport(self, value: str) -> None:
        self._transport = check_transport(value)

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
        hot = self.spares.count
        with self._launching:
            addresses = self.launcher.start(num_slices + hot, root=root)
        self._meshes = [dict(zip(mesh.AXES, mesh.shape_of(m))) for m in meshes] if meshes is not None else None
        self._transfer_secret = secrets.token_bytes(32).hex()
        if self.clients:
            self._detach()
        self._in_flight = InFlight()
        self.clients = [self._client(a) for a in addresses[:num_slices]]
        self._others = [self._client(a) for a in addresses[num_slices + hot :]]
        self._slots, self._free_slots = list(range(num_slices)), []
        self._pool = ThreadPoolExecutor(max(2 * num_slices, 2), thread_name_prefix="mpmd-ctl")
        try:
            list(self._pool.map(lambda c: c.wait_ready(self._connect_timeout_s), self.clients))
            self.spares.attach([(s, addresses[s]) for s in range(num_slices, num_slices + hot)])
            self._set_up_all()
        except BaseException:
            self.close()
            raise
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="mpmd-heartbeat")
        self._heartbeat.start()

    @property
    def generation_tag(self) -> str:
        """The current generation as a name ("g<generation>-<this control plane's nonce>"):
        what a checkpoint part written in it is named for."""
        return f"g{self.generation}-{self._incarnation}"

    def _advance(self, newcomers) -> None:
        """Start a new generation: past this one and past every generation that the slices
        `newcomers` (about to be set up) report having seen; every client makes its calls in
        it from now on."""
        seen = [self._call(i, verbs.Empty(), verb="Hello")[0].generation for i in newcomers]
        self.generation = max([self.generation, *(g or 0 for g in seen)]) + 1
        for c in self.clients + self._others + self.spares.clients:
            c.generation = self.generation

    def _set_up_all(self) -> None:
        """Give every slice a fresh executor and transfer server under its index and connect
        them all, in a new generation: nothing shipped or stored before survives."""
        self._advance(range(len(self.clients)))
        # Per slice: what a replacement is given again, and the calls its programs compiled
        # for ({program: [signature]}, from its runs: what a hot spare warms).
        self._shipped = [{"programs": {}, "plans": {}, "signatures": {}} for _ in self.clients]
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
        # Only a look: a launcher without capacity now (Ray) keeps what it asked for and says
        # so at once, so no checkpoint boundary of a narrow run waits for capacity.
        c = self._client(self._new_worker(slot, 0.0))
        try:
            c.wait_ready(self._connect_timeout_s)
            if before_reset is not None:
                before_reset()
        except WorkerError as e:
            c.close()
            raise ReplaceUnsupported(f"the new worker for slot {slot} did not answer: {e}", retry=True) from None
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
            return GangClient([WorkerClient(a, self._token, self.rpc_counts, tls=self.tls) for a in address])
        return WorkerClient(address, self._token, self.rpc_counts, tls=self.tls)

    def _setup(self, i: int, c: WorkerClient | GangClient) -> str | list[str]:
        """Set slice i up on its worker, or on every process of its gang (each listening for
        transfers on its own host); its transfer address, or one per process."""
        members = c.members if isinstance(c, GangClient) else [c]
        futs = []
        for m in members:
            host = self._transfer_host or m.address.rpartition(":")[0].strip("[]")
            setup = verbs.Setup(
                i,
                host,
                self._transfer_secret,
                self._meshes[i] if self._meshes is not None else None,
                versions=compat.versions(),
                transport=self._transport,
            )
            futs.append((m, send(m, setup)))
        try:
            addresses = [receive(m, "Setup", f)[0].transfer_address for m, f in futs]
        except WorkerError as e:  # a survivor gone while the slices are set up again (a shrink)
            if e.code in GONE:
                raise WorkerLost(i, e.address, str(e)) from None
            if e.code == grpc.StatusCode.FAILED_PRECONDITION and "stale generation" not in e.details:  # its JAX
                raise compat.VersionMismatch(f"worker {e.address} (slice {i}): {e.details}") from None
            raise
        return addresses[0] if not isinstance(c, GangClient) else addresses

    def _beat(self) -> None:
        # Keeps the workers' lease alive and feeds failure detection (WorkerClient.last_ok, the
        # heartbeats' verdicts). A hung worker delays no other's heartbeat: see heartbeat.py.
        while not self._stop.wait(self.heartbeats.period_s(len(self.clients) + len(self._others) + self.spares.count)):
            self.heartbeats.round(list(self.clients) + list(self._others) + self.spares.clients)

    def step_timeout(self) -> float:
        """The watchdog's timeout for the next step, in seconds (runtime/control/runs.py)."""
        return self._watch.step_timeout()

    @property
    def step_timeout_s(self) -> float | None:
        return self._watch.step_timeout_s

    @step_timeout_s.setter
    def step_timeout_s(self, value: float | None) -> None:
        self._watch.step_timeout_s = value

    def lost_slice(self) -> tuple[int, str] | None:
        """(slice, why) of a slice found hung or silent for longer than failure_timeout_s, if any."""
        for i in range(len(self.clients)):
            why = self._lost_why(self.clients[i])
            if why is not None:
                return i, why
        return None

    def _lost_why(self, c) -> str | None:
        """Why the worker of client `c` (a slice's, or a hot spare's) counts as lost (hung by
        its probe, or silent for longer than failure_timeout_s), else None."""
        hung = self.heartbeats.hung(c)
        if hung is not None:
            return hung
        silent_s = time.monotonic() - c.last_ok
        if silent_s > self.failure_timeout_s:
            return f"no answer for {silent_s:.1f} s (failure_timeout_s={self.failure_timeout_s:g})"
        return None

    def replace(self, slice_index: int, wait_s: float | None = None) -> None:
        """Put a new worker in place of a lost slice and bring it to where the slice was:
        same programs and plans; every slice's transfers reconnected. State is not restored.
        WorkerLost if another slice is found gone meanwhile (the new worker is in place).
        `wait_s`: see Cluster.replace."""
        spare = self.spares.take(alive=lambda c: self._lost_why(c) is None)
        if spare is not None:  # warm: nothing to start, its programs compiled
            c, lost_slot = spare.client, self._slots[slice_index]
            self._slots[slice_index] = spare.slot
            self.launcher.serves(spare.slot, slice_index)
            self.spares.top_up(lost_slot)
            log.info("slice %d: hot spare %s takes over (slot %d)", slice_index, c.address, spare.slot)
        else:
            try:
                c = self._client(self._new_worker(self._slots[slice_index], wait_s))
            except ReplaceUnsupported as e:  # nothing changed; the lost worker itself, if it is back
                if not self.launcher.readmits:
                    raise
                c = self._readmit(slice_index, e)
        self.clients[slice_index].close()
        self.clients[slice_index] = c  # never a closed client in the list, whatever comes next
        self.heartbeats.settle(self.clients, steady=False)  # a restore loads them all: none is warm
        try:
            c.wait_ready(self._connect_timeout_s)
        except WorkerError as e:
            if spare is None:
                raise
            # The spare went too (a host lost whole, a cluster going down): lost as the slice
            # is, so the caller asks again, of the next spare or of the launcher for its slot.
            raise WorkerLost(slice_index, c.address, f"the hot spare taking it over does not answer: {e}") from None
        self._advance([slice_index])  # a new generation: the lost worker, should it come back, is fenced out
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

    def _readmit(self, slice_index: int, why: ReplaceUnsupported) -> WorkerClient | GangClient:
        """A client of the lost worker of `slice_index` once it answers again (a partition
        healed, a pause ended, a worker restarted at its address): it serves the slice again,
        in the new generation replace() starts. ReplaceUnsupported (retry: it may still come)
        if not."""
        old = self.clients[slice_index].address
        probe = self._client(list(old) if isinstance(old, tuple) else old)
        try:
            probe.wait_ready(READMIT_PROBE_S)
            call(probe, verbs.Empty(), timeout_s=READMIT_PROBE_S, verb="Hello")
        except WorkerError:
            probe.close()
            raise ReplaceUnsupported(
                f"{why}; the lost worker {old} does not answer (yet: it may be cut off or paused)", retry=True
            ) from None
        log.warning(
            "slice %d: its lost worker %s answers again (a partition healed or a pause ended); taken back "
            "in a new generation",
            slice_index,
            old,
        )
        return probe

    def _new_worker(self, slot: int, wait_s: float | None) -> str:
        """The launcher's new worker for `slot`; an idle spare it hands over stops being idle."""
        with self._launching:
            address = self.launcher.replace(slot, wait_s=wait_s)
        self._others = [o for o in self._others if o.address != address]
        return address

    def _spare_worker(self, slot: int) -> str:
        """A new hot spare in `slot` (its lost worker's): the launcher's, waiting for capacity
        as long as its own start timeout allows."""
        return self._new_worker(slot, None)

    def _warm_request(self, slice_index: int, compiled: dict | None = None):
        """(verbs.Warm, blobs) of slice `slice_index`'s programs for its mesh, each for the calls
        the slice compiled so far; with `compiled` ({program: [signature]}, a run's), those
        programs for those calls only ([]: for the layouts it was exported with). None if
        there is nothing to warm."""
        if slice_index >= len(self._shipped):
            return None
        shipped = self._shipped[slice_index]
        signatures = compiled if compiled is not None else shipped["signatures"]
        names = compiled.keys() if compiled is not None else shipped["programs"].keys()
        specs = {n: shipped["programs"][n] for n in names if n in shipped["programs"]}
        if not specs:
            return None
        entries, blobs = program_entries(specs)
        mesh_shape = self._meshes[slice_index] if self._meshes is not None else None
        return verbs.Warm(entries, mesh_shape, {n: signatures[n] for n in specs if signatures.get(n)} or None), blobs

    # -- the cluster verbs -------------------------------------------------------------------
    def load_programs(self, slice_index: int, specs: dict) -> None:
        self._shipped[slice_index]["programs"].update(specs)
        for name in specs:  # a program loaded again is compiled again
            self._shipped[slice_index]["signatures"].pop(name, None)
        self._load(slice_index, specs)
        self.heartbeats.settle([self.clients[slice_index]], steady=False)  # its next step compiles
        self.spares.warm(slice_index, {name: [] for name in specs})  # [] : as exported

    def _load(self, slice_index: int, specs: dict) -> None:
        entries, blobs = program_entries(specs)
        self._call(slice_index, verbs.LoadPrograms(entries), blobs)

    def install_plan(self, slice_index: int, name: str, stream) -> None:
        self._shipped[slice_index]["plans"][name] = stream if isinstance(stream, streams.PackedStream) else list(stream)
        self._install(slice_index, name, stream)

    def _install(self, slice_index: int, name: str, stream) -> None:
        if isinstance(stream, streams.PackedStream):  # compact bytes; the worker expands them
            b = wire.Builder()
            self._call(slice_index, verbs.InstallPlan(name, encoded=b.add(stream.to_bytes())), b.blobs)
        else:
            self._call(slice_index, verbs.InstallPlan(name, stream=[instructions.to_json(i) for i in stream]))

    def put(self, slice_index: int, name: str, arrays, layouts=None, append: bool = False) -> None:
        b = wire.Builder()
        refs = _arrays_out(b, arrays)
        laid = [instructions.layout_to_json(tuple(l)) for l in layouts] if layouts is not None else None
        self._call(slice_index, verbs.Put(name, refs, laid, append or None), b.blobs)

    def get(self, slice_index: int, names) -> dict:
        reply, blobs = self._call(slice_index, verbs.Get(list(names)))
        return {n: tuple(wire.blob(blobs, r) for r in refs) for n, refs in reply.arrays.items()}

    def delete(self, slice_index: int, names) -> None:
        self._call(slice_index, verbs.Delete(list(names)))

    def save(self, slice_index: int, items: dict, digests: bool = True) -> None:
        self._call(slice_index, verbs.Save(items, digests))

    def wait_saves(self, slice_index: int, directories=None) -> dict[str, dict[str, str]]:
        """Blocks while the slice writes (that may take long) but not past its loss."""
        reply = self._call(slice_index, verbs.WaitSaves(None if directories is None else list(directories)))[0]
        return {d: (reply.digests or {}).get(d, {}) for d in reply.finalized}

    def restore(self, slice_index: int, items: dict, staged: bool = False, layouts=None, digests=None) -> None:
        laid = (
            {n: [instructions.layout_to_json(tuple(l)) for l in ls] for n, ls in layouts.items()} if layouts else None
        )
        self._call(slice_index, verbs.Restore(items, staged, laid, dict(digests) if digests else None))

    def finish_restore(self, slice_index: int, commit: bool) -> None:
        self._call(slice_index, verbs.FinishRestore(commit))

    def _send(self, plan, run, after, feeds, fetch, trace) -> list:
        futs = []
        for i, c in enumerate(self.clients):
            b = wire.Builder()
            fed = {n: _arrays_out(b, arrays) for n, arrays in (feeds.get(i) or {}).items()}
            futs.append(send(c, verbs.Run(plan, run, after, fed, list(fetch.get(i, ())), trace), b.blobs))
        return futs

    def _wait(self, run: PendingRun) -> list[StepResult]:
        results = self._watch.wait(run, self._in_flight)
        self.heartbeats.settle([c for c, r in zip(self.clients, results) if not r.compiled])  # warm: steady
        for i, r in enumerate(results):
            if r.compiled and self.spares.count:  # calls a slice made anew: the spares compile them too
                new = new_calls(self._shipped[i]["signatures"], r.compiled)
                if new:
                    self.spares.warm(i, new)
        self.spares.went_on()  # a spare owed since a loss starts now, not during the recovery
        return results

    def _call(self, slice_index: int, request, blobs=(), verb: str | None = None):
        """The RPC of a request record to a slice: (reply record, blobs); a worker that is not
        there anymore is reported as WorkerLost, and so is one that stops answering its
        heartbeats while the call waits (stopped, hung or cut off: the call would otherwise
        wait for it forever). `verb`: as in rpc.send, for a record several verbs take."""
        c = self.clients[slice_index]
        verb = verb or verbs.verb_of(request)
        try:
            fut = send(c, request, blobs, verb=verb)
            while not _settled(fut, HEARTBEAT_S):
                # This slice's own silence: with every slice silent (the controller cut off from
                # all of them), the first lost one is slice 0, and a call to another would wait on.
                why = self._lost_why(self.clients[slice_index])
                if why is not None:
                    fut.cancel()
                    raise WorkerLost(slice_index, c.address, f"{verb} unanswered: {why}")
            return receive(c, verb, fut)
        except WorkerError as e:
            if e.code in GONE:
                raise WorkerLost(slice_index, e.address, str(e)) from None
            raise

    # -- shutdown ----------------------------------------------------------------------------
    def _detach(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        self.spares.close()
        self.heartbeats.close()
        for c in self.clients + self._others:
            c.close()
        self.clients, self._others = [], []
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def close(self) -> None:
        """Shut the workers down (a worker started with --persist resets instead), then let the
        launcher stop what it started. A worker that counts as lost (_lost_why) is sent nothing:
        across a partition the kernel keeps a Shutdown written to a dead link and delivers it
        when the link comes back, by then perhaps to a worker a newer controller has taken over
        but not yet admitted (nothing to fence it by). Its launcher stops it (local, Ray), or
        its lease lapses and it leaves on its own (static, shared)."""
        self.spares.stop()  # waits for a spare being started: the launcher stops it too
        futs = []
        for c in self.clients + self._others + self.spares.clients:
            if self._lost_why(c) is not None:
                continue
            try:
                futs.append((c, send(c, verbs.Empty(), timeout_s=2.0, verb="Shutdown")))
            except WorkerError:  # its channel closed already: nothing to tell it
                pass
        for c, f in futs:
            try:
                receive(c, "Shutdown", f)
            except (WorkerError, Aborted):
                pass
        self._detach()
        self.launcher.stop()
