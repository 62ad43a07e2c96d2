"""The worker's gRPC service: one Executor behind the control plane.

Verbs (service `mpmd.Worker`, unary, bodies in the frame format of runtime/wire/format.py):
the table in runtime/wire/verbs.py, each verb's request and reply a typed record, checked
there before a handler here runs. What they do:
  Hello        the worker's pid, devices, platform, whether it is shared
  Setup        a fresh executor and transfer server for slice `slice_index` -> its transfer address
               (and, unless `transport` is socket, its shared-memory endpoint: runtime/wire/shm.py)
  Connect      the transfer address of every slice
  LoadPrograms deserialize and compile programs; InstallPlan: one instruction stream, as
               instructions or a PackedStream's bytes (runtime/worker/streams.py: rows of
               integers over instruction templates; the worker checks, finishes and expands it)
  Put, Get, Delete  buffers
  Run          plan `plan` as run id `run`, after run `after` has finished here (run-ahead);
               feeds first, fetched buffers, events and peaks back
  Save         a snapshot, written in the background (blocks while two saves are queued);
               every directory must lie below the worker's root, as must Restore's
  WaitSaves    -> the directories finalized (those asked, default all started), and the
               digest of each leaf saved there
  Restore      {directory: [name] | {key: [[buffer, index], ...]}} (a keyed entry reads only
               those keys), staged or bound at once; FinishRestore: bind (or drop) a staged one
  Heartbeat    -> pid, whether a run holds the executor, progress: [run id, instructions done, doing]
  Abort        run `run` and every earlier one (running or not yet arrived) raise at their next wait
  Shutdown
Generations (fencing). Every call carries, in metadata `mpmd-generation`, the generation of
the controller's view it was made in (absent: 0). A replacement, shrink, grow or controller
restart starts a new generation (runtime/control/client.py); Setup and Connect move a session
to theirs, and a call of an older generation than the session's is refused
(FAILED_PRECONDITION, "stale generation ...") from its metadata, before its body is read: a
controller that was superseded cannot drive a worker another one admitted. The data plane's
transfer ids are keyed with the generation too (runtime/wire/transport.py), so a worker left
behind in an older one (a "zombie": stopped, cut off, then back) neither pulls nor offers
anything the current generation exchanges; its checkpoint writes go to directories named
for its generation, which the controller never commits (mpmd/train/checkpoints.py).

Every call must carry the cluster token in metadata `mpmd-token`; a call without it, or
with a wrong one, is refused (UNAUTHENTICATED) and logged, from its metadata alone, before
its body is read: the refusing handler takes the request as a stream it never reads, so a
400 MB body sent without the token costs the worker at most gRPC's flow-control window.

A shared worker (`mpmd worker --shared`) serves several jobs, each in its own session
(runtime/worker/sessions.py). The cluster token is then the manager's admin credential, and each
job calls with its own credential (runtime/wire/credentials.py), also in `mpmd-token`:
  OpenSession  {job, root, lease_s?} -> {}   (admin; the same job again renews it)
  CloseSession {job} -> {freed}              (admin; aborts its runs, frees what it holds)
  Sessions     -> {pid, devices, live_bytes, sessions: [{job, root, buffers, bytes, plans,
                  idle_s, lease_s}], cache: {programs, bytes, limit_bytes, hits, misses,
                  evictions}}                (admin; a plain worker answers it too)
  (root: an absolute directory strictly below the worker's --root, overlapping no other
  job's; that job's Save and Restore directories must lie below it. live_bytes: every live
  JAX array of the process, all sessions together.)
  Hello        any valid credential;  Shutdown  admin: stop the worker, job: close its session
  every other RPC above: a job credential, acting on that job's session only.
A job credential calling an admin RPC, the admin token calling a job's RPC, and a job
without a session here are refused (PERMISSION_DENIED) from the metadata, before the body
is read; every refusal is logged with the job, the RPC and why. Compiled programs are
shared by all sessions (runtime/worker/compile_cache.py), on plain workers too.
A malformed body gets INVALID_ARGUMENT naming what is wrong; the worker keeps serving. A
Run that fails at an instruction answers INVALID_ARGUMENT (a bad plan) or INTERNAL (a
program that raised) with trailing metadata naming the slice and the instruction, which
the controller raises as mpmd.runtime.control.cluster.StepFailed.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import traceback

import grpc
import jax

from mpmd.runtime import compat
from mpmd.runtime.worker import instructions
from mpmd.runtime.worker import mesh
from mpmd.runtime.worker import programs
from mpmd.runtime.worker import streams
from mpmd.runtime.wire import format as wire
from mpmd.runtime.wire import verbs
from mpmd.runtime.worker.slice_store import WORKER_ROOT, OutsideRoot, confine
from mpmd.runtime.wire.results import Aborted, StepFailed
from mpmd.runtime.worker.compile_cache import CompileCache, backend_compiles
from mpmd.runtime.wire.credentials import is_cluster_token, job_of
from mpmd.runtime.worker.executor import Executor
from mpmd.runtime.worker.instructions import Spec
from mpmd.runtime.worker.sessions import Session, SessionTable, live_bytes

SERVICE = verbs.WORKER_SERVICE
TOKEN_KEY = "mpmd-token"
# The generation the caller's controller admitted this worker in (see "Generations" above).
GENERATION_KEY = "mpmd-generation"
# Shipped programs and activations can be large; gRPC's 4 MB default would refuse them.
GRPC_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
# The server's own: a port another process listens on is refused, not shared (with
# SO_REUSEPORT two workers on one port would both serve and split the requests), one
# connection may not open more than MAX_STREAMS calls at once (the controller needs a few),
# and the keepalive PINGs of the controller's probes (runtime/control/heartbeat.py: one a
# second on a connection of their own) are welcome: at gRPC's default (one per 5 minutes
# without data) the third got the connection a GOAWAY (too_many_pings), which fails a probe
# still waiting on a busy worker UNAVAILABLE, as if the worker were hung.
MAX_STREAMS = 64
SERVER_OPTIONS = GRPC_OPTIONS + [
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", MAX_STREAMS),
    ("grpc.http2.min_ping_interval_without_data_ms", 10),
    ("grpc.keepalive_permit_without_calls", 1),
]
# Trailing metadata of a failed Run: which slice and instruction (UTF-8; "-bin": any bytes).
FAILED_SLICE_KEY, FAILED_AT_KEY = "mpmd-failed-slice", "mpmd-failed-at-bin"
# Errors that mean "this request is malformed" whichever handler raised them.
_BAD_REQUEST = (
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    IndexError,
    OverflowError,
    struct.error,
    json.JSONDecodeError,
)
log = logging.getLogger("mpmd.worker")


ADMIN_METHODS = tuple(v.name for v in verbs.VERBS.values() if v.caller == "admin")
METHODS = tuple(verbs.VERBS)


class _Admin:
    """The caller holding the cluster token: a sentinel no job id can equal (a job may well
    be called "admin")."""

    def __repr__(self) -> str:
        return "the manager"


ADMIN = _Admin()


class WorkerService:
    """root: the only directory tree Save and Restore may touch (default: the current
    directory); a shared worker's sessions each get a directory below it.
    shared: serve several jobs, one session each (see the module docstring); otherwise one
    controller, whose session is made by Setup. lease_s: a shared worker's default lease of
    a session (a plain worker's lease is watched by runtime/worker/main.py). cache: the compiled
    programs kept across sessions (default: a CompileCache of the default size)."""

    def __init__(
        self,
        token: str,
        on_shutdown,
        root: str | None = None,
        shared: bool = False,
        lease_s: float = 15.0,
        cache: CompileCache | None = None,
    ):
        self._token = token
        self.root = os.path.realpath(root if root is not None else os.getcwd())
        self._on_shutdown = on_shutdown
        self.device = jax.devices()[0]
        self.shared = shared
        self.cache = cache if cache is not None else CompileCache()
        self.sessions = SessionTable(self.root, lease_s)
        self._solo = Session(None, self.root, lease_s)  # a plain worker's only session

    # A plain worker's session, as runtime/worker/main.py and runtime/launchers/ray.py see it.
    @property
    def executor(self) -> Executor | None:
        return self._solo.executor

    @property
    def transport(self):
        return self._solo.transport

    @property
    def attached(self) -> bool:
        """A controller has called Setup."""
        return self._solo.executor is not None

    @property
    def last_contact(self) -> float:
        return self._solo.last_contact

    # -- handlers: (session, request record, blobs) -> (reply record, blobs) -------------------
    # Each request was checked against its verb's record (runtime/wire/verbs.py) first.
    def Hello(self, s, r: verbs.Empty, b):
        generation = s.generation if s is not None else None
        return verbs.HelloReply(os.getpid(), len(jax.devices()), self.device.platform, self.shared, generation), []

    def Setup(self, s: Session, r: verbs.Setup, b):
        from mpmd.runtime.wire.transport import TransferTransport, check_secret

        if r.versions is not None:  # before anything is touched: programs must not cross versions
            compat.check_versions(r.versions)
        try:  # checked before the session is touched; never echoed
            secret = check_secret(bytes.fromhex(r.transfer_secret))
        except ValueError:
            raise ValueError("'transfer_secret' must be 16 to 64 bytes as a hex string") from None
        mode = verbs.check_transport(r.transport or "auto")
        shape = mesh.shape_of(r.mesh or {"data": len(jax.devices())})
        slice_mesh = mesh.bind(shape, jax.devices())
        if s.transport is not None:  # its port and table go before the new server starts
            s.transport.close()
        transport = TransferTransport(
            r.slice_index,
            slice_mesh,
            listen_host=r.transfer_host,
            secret=secret,
            transport=mode,
            generation=s.generation,
        )
        agreement = None
        if jax.process_count() > 1:  # a gang (runtime/worker/gang.py): one namespace per session and slice
            from mpmd.runtime.worker.gang import Agreement
            from mpmd.runtime.wire.transport import key_to_uuid

            agreement = Agreement(f"mpmd/{key_to_uuid(f'gang{r.slice_index}', secret):016x}")
        s.attach(Executor(r.slice_index, slice_mesh, transport, load=self.cache.load, agreement=agreement), transport)
        return verbs.SetupReply(transport.address), []

    def Connect(self, s, r: verbs.Connect, b):
        peers = r.peers
        address = lambda v: isinstance(v, str) and v.rpartition(":")[2].isdigit()
        if not all(address(v) or (isinstance(v, list) and v and all(map(address, v))) for v in peers.values()):
            raise ValueError(
                f"Connect needs 'peers': {{slice index: 'host:port' transfer address, or a list "
                f"of them (a gang: one per process)}}, got {peers!r:.200}"
            )
        peers = {int(k): v for k, v in peers.items()}
        try:
            _exec(s).transport.connect_peers(peers, generation=s.generation)
        except RuntimeError as e:  # XLA's own refusal of an address
            raise ValueError(f"cannot connect to peers {peers}: {e}") from None
        return verbs.Empty(), []

    def LoadPrograms(self, s, r: verbs.LoadPrograms, b):
        specs = _program_specs(r.programs, b)
        _exec(s).load_programs(specs)
        return verbs.LoadProgramsReply(len(specs)), []

    def Warm(self, s, r: verbs.Warm, b):
        """Load and compile programs for a mesh of this worker's devices, no slice needed: a
        hot spare's programs, so the slice it is promoted to runs its first step without
        compiling (its LoadPrograms then finds them in the cache)."""
        specs = _program_specs(r.programs, b)
        signatures = r.signatures or {}
        if not all(isinstance(v, list) for v in signatures.values()):
            raise ValueError("Warm 'signatures' must be {program: [signature, ...]}")
        slice_mesh = mesh.bind(mesh.shape_of(r.mesh or {"data": len(jax.devices())}), jax.devices())
        before = backend_compiles()
        for name, spec in specs.items():
            program = self.cache.load(spec, slice_mesh)
            try:
                programs.warm(program, spec, slice_mesh, signatures.get(name))
            except (TypeError, ValueError, IndexError) as e:  # a signature that does not fit it
                raise ValueError(f"cannot warm program {name!r} for the signatures given: {e}") from None
        return verbs.WarmReply(len(specs), backend_compiles() - before), []

    def InstallPlan(self, s, r: verbs.InstallPlan, b):
        if (r.encoded is None) == (r.stream is None):
            raise ValueError("InstallPlan needs exactly one of 'stream' (instructions) and 'encoded' (a blob)")
        if r.encoded is not None:
            stream = streams.from_bytes(wire.blob(b, r.encoded, bytes))
        else:
            stream = [instructions.from_json(i) for i in r.stream]
        return verbs.InstallPlanReply(_exec(s).install_plan(r.name, stream)), []

    def Put(self, s, r: verbs.Put, b):
        layouts = [instructions.layout_from_json(l) for l in r.layouts] if r.layouts is not None else None
        _exec(s).put(r.name, [wire.blob(b, ref) for ref in r.arrays], layouts, bool(r.append))
        return verbs.Empty(), []

    def Get(self, s, r: verbs.Get, b):
        got = _exec(s).get([str(n) for n in r.names])
        out = wire.Builder()
        return verbs.GetReply({n: [out.add(a) for a in arrays] for n, arrays in got.items()}), out.blobs

    def Delete(self, s, r: verbs.Delete, b):
        _exec(s).delete([str(n) for n in r.names])
        return verbs.Empty(), []

    def Run(self, s, r: verbs.Run, b):
        if not all(isinstance(refs, list) for refs in r.feeds.values()):
            raise ValueError("Run 'feeds' must be {buffer name: [blob, ...]}")
        feeds = {str(n): [wire.blob(b, ref) for ref in refs] for n, refs in r.feeds.items()}
        # The executor takes turns: a Run sent ahead waits there behind the one running.
        result = _exec(s).run(r.plan, r.run, feeds, tuple(str(n) for n in r.fetch), r.trace, r.after)
        out = wire.Builder()
        fetched = {n: [out.add(a) for a in arrays] for n, arrays in result.fetched.items()}
        return verbs.RunReply(
            fetched,
            [list(e) for e in result.events],
            result.wall_s,
            result.peak_held,
            result.peak_held_bytes,
            result.peak_bytes,
            result.compiles,
            result.compiled or None,
            result.cache_loads,
        ), out.blobs

    def Save(self, s, r: verbs.Save, b):
        _exec(s).save(self._confine(s, _items(r.items)), digests=r.digests)
        return verbs.Empty(), []

    def WaitSaves(self, s, r: verbs.WaitSaves, b):
        directories = None
        if r.directories is not None:
            directories = list(self._confine(s, {str(d): [] for d in r.directories}))
        finalized = _exec(s).wait_saves(directories)
        return verbs.WaitSavesReply(sorted(finalized), finalized), []

    def Restore(self, s, r: verbs.Restore, b):
        layouts = r.layouts or {}
        if not all(isinstance(v, list) for v in layouts.values()):
            raise ValueError("Restore 'layouts' must be {buffer name: [layout, ...]}")
        layouts = {str(n): [instructions.layout_from_json(l) for l in ls] for n, ls in layouts.items()}
        digests = r.digests or {}
        if not all(isinstance(v, str) for v in digests.values()):
            raise ValueError("Restore 'digests' must be {key: digest string}")
        _exec(s).restore(self._confine(s, _items(r.items)), staged=r.staged, layouts=layouts, digests=digests)
        return verbs.Empty(), []

    def FinishRestore(self, s, r: verbs.FinishRestore, b):
        _exec(s).finish_restore(r.commit)
        return verbs.Empty(), []

    def Heartbeat(self, s, r: verbs.Empty, b):
        executor = s.executor
        progress = list(executor.progress) if executor is not None else None
        running = executor is not None and executor.busy
        return verbs.HeartbeatReply(os.getpid(), running, progress), []

    def Abort(self, s, r: verbs.Abort, b):
        """Stop a running run and drop this slice's pending transfers (peers waiting on them
        fail instead of hanging; nothing of the aborted run can pair with a later one). On a
        shared worker both are the caller's session's only."""
        executor, transport = s.executor, s.transport
        if executor is not None:
            executor.abort(r.run)
            transport.reset()
        return verbs.Empty(), []

    def Shutdown(self, s, r: verbs.Empty, b):
        if s is not None and self.shared:  # a job leaving: its session only
            self.sessions.close(s.job)
            log.info("job %s shut its session down", s.job)
            return verbs.Empty(), []
        threading.Thread(target=self._on_shutdown, args=("controller asked",), daemon=True).start()
        return verbs.Empty(), []

    def OpenSession(self, s, r: verbs.OpenSession, b):
        self._need_shared("OpenSession")
        session = self.sessions.open(r.job, r.root, r.lease_s)
        log.info("session of job %s open: root %s, lease %g s", session.job, session.root, session.lease_s)
        return verbs.Empty(), []

    def CloseSession(self, s, r: verbs.CloseSession, b):
        self._need_shared("CloseSession")
        freed = self.sessions.close(r.job)
        log.info("session of job %s closed by the manager%s", r.job, "" if freed else " (it had none)")
        return verbs.CloseSessionReply(freed), []

    def Sessions(self, s, r: verbs.Empty, b):
        sessions = self.sessions.all() if self.shared else [self._solo] if self.attached else []
        idle = all(x.executor is None for x in sessions)  # then a leftover is a leak: collect it
        return verbs.SessionsReply(
            os.getpid(),
            len(jax.devices()),
            live_bytes(collect=idle),
            [x.describe() for x in sessions],
            self.cache.stats(),
        ), []

    def reset(self) -> None:
        """A plain worker: drop the slice (buffers, programs, transfer server) and wait for a
        controller."""
        self._solo.close()
        old, self._solo = self._solo, Session(None, self.root, self._solo.lease_s)
        self._solo.generation = old.generation  # a later controller must still be newer

    def close(self) -> None:
        """Close every session (the worker is stopping)."""
        for session in self.sessions.all() + [self._solo]:
            session.close()

    def lapse(self) -> list[tuple[str, float]]:
        """A shared worker: close the sessions whose job has been silent past its lease."""
        gone = self.sessions.lapsed()
        for job, silent_s in gone:
            log.warning("job %s silent for %.1f s, past its lease: session closed", job, silent_s)
        return gone

    # -- plumbing --------------------------------------------------------------------------
    def _need_shared(self, name: str) -> None:
        if not self.shared:
            raise ValueError(f"{name} needs a shared worker (mpmd worker --shared); this one serves one controller")

    def _confine(self, s: Session, items: dict) -> dict:
        return confine(items, s.root, f"job {s.job}'s root" if s.job is not None else WORKER_ROOT)

    def handler(self) -> grpc.GenericRpcHandler:
        return _Handler(self)

    def caller(self, metadata):
        """ADMIN for the cluster token, a job id for a valid job credential (shared worker
        only), None for anything else."""
        credential = dict(metadata or ()).get(TOKEN_KEY, "")
        if is_cluster_token(credential, self._token):
            return ADMIN
        return job_of(credential, self._token) if self.shared else None

    def route(self, name: str, caller) -> tuple[Session | None, str | None]:
        """(the session a call acts on, None) or (None, why it is refused)."""
        if verbs.VERBS[name].caller == "any":  # Hello: it reports the caller's session's generation
            return (self._solo if not self.shared else self.sessions.get(caller) if caller is not ADMIN else None), None
        if name in ADMIN_METHODS:
            return None, (
                None if caller is ADMIN else f"{name} is the cluster manager's (the cluster token), not a job's"
            )
        if not self.shared:
            return self._solo, None
        if caller is ADMIN:
            return None, (
                None if name == "Shutdown" else f"{name} acts on a job's session: call it with that job's credential"
            )
        session = self.sessions.get(caller)
        if session is None:
            return None, f"no session for job {caller} on this worker"
        return session, None

    def wrap(self, name: str, session: Session | None, caller):
        method = getattr(self, name)
        # Whom a log line names: a shared worker's caller; a plain worker has only one.
        who = (
            f" (job {caller})"
            if caller is not None and caller is not ADMIN
            else " (the manager)"
            if self.shared
            else ""
        )

        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            if session is not None and name != "Hello":
                session.touch()
            try:
                header, blobs = wire.decode(request)
                reply, out = method(session, verbs.decode_request(name, header), blobs)
                return wire.encode(verbs.encode(reply), out)
            except Aborted as e:
                context.abort(grpc.StatusCode.ABORTED, f"{name}: {e}")
            except StepFailed as e:
                bad_plan = isinstance(e.__cause__, _BAD_REQUEST)
                (log.warning if bad_plan else log.error)(
                    "%s failed%s: %s\n%s", name, who, e, "" if bad_plan else traceback.format_exc()
                )
                context.set_trailing_metadata(
                    ((FAILED_SLICE_KEY, str(e.slice_index)), (FAILED_AT_KEY, e.instruction.encode()))
                )
                context.abort(grpc.StatusCode.INVALID_ARGUMENT if bad_plan else grpc.StatusCode.INTERNAL, e.message)
            except compat.VersionMismatch as e:  # info: the controller says it, in one line
                log.info(
                    "refused %s from %s: %s", name, _caller_name(caller if self.shared else None, context.peer()), e
                )
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except OutsideRoot as e:
                log.warning(
                    "refused %s from %s: %s", name, _caller_name(caller if self.shared else None, context.peer()), e
                )
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {type(e).__name__}: {e}")
            except _BAD_REQUEST as e:
                log.warning("bad %s request%s: %s", name, who, e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {type(e).__name__}: {e}")
            except Exception as e:
                log.error("%s failed%s:\n%s", name, who, traceback.format_exc())
                context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(e).__name__}: {e}")

        return call


def _exec(s: Session) -> Executor:
    executor = s.executor
    if executor is None:
        raise ValueError(
            "worker is not set up: call Setup first" if not s.closed else f"the session of {s.name} was closed"
        )
    return executor


class _Handler(grpc.GenericRpcHandler):
    """Routes a call by its method name and metadata, before gRPC reads its body. A call
    without a valid credential, or one its credential may not make, gets a handler that
    takes the request as a stream and never reads it: the refusal costs a few bytes whatever
    the body's size (the wire format of a unary and a streaming request is the same)."""

    def __init__(self, service: WorkerService):
        self._service = service
        self._methods = {f"/{SERVICE}/{n}": n for n in METHODS}

    def service(self, details: grpc.HandlerCallDetails):
        name = self._methods.get(details.method)
        if name is None:
            return None
        caller = self._service.caller(details.invocation_metadata)
        if caller is None:
            token = dict(details.invocation_metadata or ()).get(TOKEN_KEY)
            return _refusal(
                name,
                None,
                f"{'wrong' if token else 'missing'} token",
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing or wrong {TOKEN_KEY}",
            )
        session, why = self._service.route(name, caller)
        if why is not None:
            return _refusal(name, caller, why, grpc.StatusCode.PERMISSION_DENIED)
        if session is not None and name != "Hello":
            stale = session.admit(name, generation_of(details.invocation_metadata))
            if stale is not None:
                return _refusal(name, caller, stale, grpc.StatusCode.FAILED_PRECONDITION)
        return grpc.unary_unary_rpc_method_handler(self._service.wrap(name, session, caller))


def generation_of(metadata) -> int:
    """The generation a call's metadata names (0 when absent or not a non-negative integer)."""
    value = dict(metadata or ()).get(GENERATION_KEY, "0")
    return int(value) if isinstance(value, str) and value.isdigit() and len(value) <= 20 else 0


def _refusal(name: str, caller, why: str, code: grpc.StatusCode, told: str | None = None):
    """A handler that refuses `name` without reading its body, and logs who and why (a
    caller without a valid credential is named by its address only). `told`: what the
    caller is told, if not `why`."""

    def refuse(_unread_requests, context: grpc.ServicerContext):
        log.warning("refused %s from %s: %s", name, _caller_name(caller, context.peer()), why)
        context.abort(code, f"{name}: {told or why}")

    return grpc.stream_unary_rpc_method_handler(refuse)


def _caller_name(caller, peer: str) -> str:
    """A refused caller as a log line names it: by credential and address, or by address."""
    return f"the manager ({peer})" if caller is ADMIN else f"job {caller} ({peer})" if caller else peer


def _items(items: dict) -> dict:
    """{directory: [buffer name]} or {directory: {key: [buffer, index]}} (Save) or {directory:
    {key: [[buffer, index], ...]}} (Restore), checked and typed."""
    out = {}
    for d, entries in items.items():
        if isinstance(entries, list):
            out[str(d)] = [str(n) for n in entries]
        elif isinstance(entries, dict):
            out[str(d)] = {str(k): _targets(v) for k, v in entries.items()}
        else:
            raise ValueError(
                f"'items' entry of {str(d)!r} must be a list of buffer names or "
                f"{{key: [buffer, index]}}, got {type(entries).__name__}"
            )
    return out


def _targets(v):
    """[buffer, index] (a Save's key) or [[buffer, index], ...] (a Restore's)."""
    pair = lambda p: (
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], int)
        and not isinstance(p[1], bool)
        and p[1] >= 0
    )
    if pair(v):
        return (v[0], v[1])
    if isinstance(v, list) and v and all(pair(p) for p in v):
        return [(p[0], p[1]) for p in v]
    raise ValueError(f"a keyed checkpoint entry must be [buffer, index] or [[buffer, index], ...], got {v!r:.80}")


def _program_specs(entries: list, b) -> dict[str, programs.ProgramSpec]:
    """LoadPrograms' and Warm's `programs` entries as specs by name."""
    specs = {}
    for p in entries:
        if not isinstance(p, dict):
            raise ValueError(f"'programs' entries must be objects, got {p!r:.50}")
        outputs = tuple(tuple(Spec(tuple(x), d) for x, d in bundle) for bundle in p.get("outputs", []))
        data = wire.blob(b, p["data"], bytes) if "data" in p else b""
        specs[_str(p, "name")] = programs.ProgramSpec(_str(p, "kind"), data, float(p.get("duration_s", 0.0)), outputs)
    return specs


def _str(h: dict, key: str) -> str:
    v = h.get(key)
    if not isinstance(v, str):
        raise ValueError(f"'{key}' must be a string, got {v!r:.50}")
    return v
