"""The worker's RPC verbs, in one table: each verb's request and reply as a typed record.

The control plane (runtime/control/client.py, through rpc.py) builds a request record and `encode`s it into
the JSON header of a frame (runtime/wire/format.py); the worker's service
(runtime/worker/service.py) `decode_request`s the header back into the record before its
handler runs, and the same in reverse for the reply. A verb added or changed is one entry
here, and a request that does not match its record is refused here, for every verb alike:
a missing field, a field of the wrong type or a field the verb does not have is a
ValueError naming the verb, the field and the type it must have (never the value sent: a
field may hold a secret), which the service answers INVALID_ARGUMENT.

Field types are shallow JSON types: str, int (not bool), float (an int too), bool, list,
dict, `X | None` (may be absent). A blob (array or raw bytes) is referenced in a field as
{"$blob": i} (a dict). What is inside a list or dict (buffer names, layouts, checkpoint
items) is checked by the handler that reads it, where the message can say what it means.
Nothing is pickled: the header is JSON, so decoding it runs no code.

Callers: "job" verbs act on a job's session (a plain worker's one session), "admin" verbs
are the shared cluster's manager's (the cluster token), "any" takes any valid credential.
The manager's own service has a second table in the same style (MANAGER_VERBS): what a job
and `mpmd cluster` ask of it (runtime/launchers/shared.py, recipes/commands/cluster.py), refused
the same way when a field does not match.
A layout is a PartitionSpec over the mesh axes as JSON (runtime/worker/instructions.py
layout_to_json).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import NamedTuple

_EMPTY = dataclasses.MISSING


# -- requests and replies ------------------------------------------------------------------
@dataclass(frozen=True)
class Empty:
    """No fields."""


@dataclass(frozen=True)
class HelloReply:
    pid: int
    devices: int
    platform: str
    shared: bool
    generation: int | None = None  # the caller's session's (runtime/worker/service.py "Generations")


@dataclass(frozen=True)
class Setup:
    slice_index: int
    transfer_host: str
    transfer_secret: str  # hex: keys this session's transfer ids
    mesh: dict | None = None  # {data, fsdp, tensor} over all of the worker's devices; None: all on data
    # {"jax", "jaxlib"}: the controller's (mpmd.runtime.compat.versions); a worker running others
    # refuses the Setup (FAILED_PRECONDITION). mpmd's controller always sends them; a bare
    # client that leaves them out is not checked.
    versions: dict | None = None
    # The data plane between this slice and each peer: auto | socket | shm
    # (runtime/wire/transport.py TransferTransport); absent: auto.
    transport: str | None = None


# The data planes a Setup may ask for (runtime/wire/transport.py TransferTransport): here, with
# the wire's vocabulary, so the config schema checks cluster.transport without importing JAX.
TRANSPORTS = ("auto", "socket", "shm")


def check_transport(transport) -> str:
    """`transport` if it names a data plane (cluster.transport); ValueError naming those allowed."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(TRANSPORTS)} (auto: shared memory between "
            f"workers on one host, sockets between hosts), got {transport!r:.50}"
        )
    return transport


@dataclass(frozen=True)
class SetupReply:
    transfer_address: str


@dataclass(frozen=True)
class Connect:
    peers: dict  # {slice: transfer address, or [one per process] for a gang}


@dataclass(frozen=True)
class LoadPrograms:
    programs: list  # [{name, kind, data?: blob, duration_s?, outputs?}]


@dataclass(frozen=True)
class LoadProgramsReply:
    loaded: int


@dataclass(frozen=True)
class Warm:
    """Load programs into the worker's compile cache and compile them, for the mesh a slice
    would give it, without a slice: what makes an idle worker a hot spare."""

    programs: list  # as LoadPrograms'
    mesh: dict | None = None  # as Setup's
    # {program: [signature]} (runtime/worker/programs.py signature): the calls to compile for;
    # a program not named is compiled for the layouts it was exported with.
    signatures: dict | None = None


@dataclass(frozen=True)
class WarmReply:
    loaded: int
    compiled: int  # executables XLA built for them (0: every one was warm already)


@dataclass(frozen=True)
class InstallPlan:
    name: str
    stream: list | None = None  # [instruction as instructions.to_json]
    encoded: dict | None = None  # blob: streams.PackedStream.to_bytes; the worker expands it


@dataclass(frozen=True)
class InstallPlanReply:
    instructions: int


@dataclass(frozen=True)
class Put:
    name: str
    arrays: list  # [blob]
    layouts: list | None = None  # [layout], one per array; None: replicated
    append: bool | None = None  # True: after the arrays `name` holds (a large buffer sent in parts)


@dataclass(frozen=True)
class Get:
    names: list


@dataclass(frozen=True)
class GetReply:
    arrays: dict  # {name: [blob]}


@dataclass(frozen=True)
class Delete:
    names: list


@dataclass(frozen=True)
class Run:
    plan: str
    run: int  # the run id (never repeats: transfer keys are prefixed with it)
    after: int = -1  # the run it waits for here (run-ahead); -1: none
    feeds: dict = field(default_factory=dict)  # {buffer name: [blob]}
    fetch: list = field(default_factory=list)  # [buffer name]
    trace: bool = False


@dataclass(frozen=True)
class RunReply:
    fetched: dict  # {buffer name: [blob]}
    events: list  # [[name, kind, start_ns, end_ns]]
    wall_s: float
    peak_held: int = 0
    peak_held_bytes: int = 0
    peak_bytes: int = 0
    compiles: int = 0  # executables XLA built in the worker's process during the run
    compiled: dict | None = None  # {program: [signature]} of first calls and calls that compiled (StepResult)
    cache_loads: int = 0  # of compiles, loads from JAX's persistent compilation cache


@dataclass(frozen=True)
class Save:
    items: dict  # {directory: [buffer name] | {key: [buffer, index]}}
    digests: bool = True  # digest each single array once written (WaitSaves reports them)


@dataclass(frozen=True)
class WaitSaves:
    directories: list | None = None  # None: every save started


@dataclass(frozen=True)
class WaitSavesReply:
    finalized: list
    digests: dict | None = None  # {directory: {key: digest}} of the directories finalized


@dataclass(frozen=True)
class Restore:
    items: dict  # {directory: [name] | {key: [[buffer, index], ...]}}
    staged: bool = False
    layouts: dict | None = None  # {buffer: [layout]}
    digests: dict | None = None  # {key: digest} recorded at the save: a leaf read otherwise is refused


@dataclass(frozen=True)
class FinishRestore:
    commit: bool


@dataclass(frozen=True)
class HeartbeatReply:
    pid: int
    running: bool  # a run holds the executor's turn
    progress: list | None = None  # [run id, instructions done, doing]; None: not set up


@dataclass(frozen=True)
class Abort:
    run: int  # this run and every earlier one


@dataclass(frozen=True)
class OpenSession:
    job: str
    root: str
    lease_s: float | None = None


@dataclass(frozen=True)
class CloseSession:
    job: str


@dataclass(frozen=True)
class CloseSessionReply:
    freed: bool


@dataclass(frozen=True)
class SessionsReply:
    pid: int
    devices: int
    live_bytes: int
    sessions: list
    cache: dict


# -- the shared cluster's manager (runtime/manager/core.py) -----------------------------------
@dataclass(frozen=True)
class Submit:
    slices: int
    root: str  # the job's run_dir's root, below the cluster's
    name: str = "job"  # shown in `mpmd cluster status`
    share: bool = False  # time-share workers with other sharing jobs
    lease_s: float | None = None  # None: the cluster's
    devices: list | None = None  # devices of each slice's mesh; None: all of a worker's


@dataclass(frozen=True)
class SubmitReply:
    job: str
    credential: str  # the job's: it reaches this job's sessions only
    position: int  # 0: leased; else its place in the FIFO queue (1 = next)
    workers: list = field(default_factory=list)  # [address] once leased


@dataclass(frozen=True)
class JobRequest:
    """Wait, Renew and Release: the job that asks (its credential's)."""

    job: str


@dataclass(frozen=True)
class WaitReply:
    position: int
    workers: list  # [address] once leased


@dataclass(frozen=True)
class Replace:
    job: str
    slot: int  # the job's slice whose worker it lost


@dataclass(frozen=True)
class ReplaceReply:
    address: str


@dataclass(frozen=True)
class StatusReply:
    workers: list  # [{slot, address, pid, health, live_bytes, cache, sessions}]
    jobs: list  # [{job, name, state, slices, share, position, workers, ...}]
    leases: dict  # {job: [address]}
    workers_started: int


# -- the tables ----------------------------------------------------------------------------
class Verb(NamedTuple):
    name: str
    request: type
    reply: type
    caller: str  # worker verbs: "job", "admin" or "any" (see the module docstring);
    # manager verbs: "submit", "job" or "admin" (runtime/manager/core.py)


VERBS: dict[str, Verb] = {
    v.name: v
    for v in (
        Verb("Hello", Empty, HelloReply, "any"),
        Verb("Setup", Setup, SetupReply, "job"),
        Verb("Connect", Connect, Empty, "job"),
        Verb("LoadPrograms", LoadPrograms, LoadProgramsReply, "job"),
        Verb("Warm", Warm, WarmReply, "job"),
        Verb("InstallPlan", InstallPlan, InstallPlanReply, "job"),
        Verb("Put", Put, Empty, "job"),
        Verb("Get", Get, GetReply, "job"),
        Verb("Delete", Delete, Empty, "job"),
        Verb("Run", Run, RunReply, "job"),
        Verb("Save", Save, Empty, "job"),
        Verb("WaitSaves", WaitSaves, WaitSavesReply, "job"),
        Verb("Restore", Restore, Empty, "job"),
        Verb("FinishRestore", FinishRestore, Empty, "job"),
        Verb("Heartbeat", Empty, HeartbeatReply, "job"),
        Verb("Abort", Abort, Empty, "job"),
        Verb("Shutdown", Empty, Empty, "job"),  # admin too: see runtime/worker/service.py route
        Verb("OpenSession", OpenSession, Empty, "admin"),
        Verb("CloseSession", CloseSession, CloseSessionReply, "admin"),
        Verb("Sessions", Empty, SessionsReply, "admin"),
    )
}
# The manager's service, mpmd.Manager: the same frames, records and checks.
MANAGER_VERBS: dict[str, Verb] = {
    v.name: v
    for v in (
        Verb("Submit", Submit, SubmitReply, "submit"),
        Verb("Status", Empty, StatusReply, "submit"),
        Verb("Wait", JobRequest, WaitReply, "job"),
        Verb("Renew", JobRequest, Empty, "job"),
        Verb("Release", JobRequest, Empty, "job"),
        Verb("Replace", Replace, ReplaceReply, "job"),
        Verb("Down", Empty, Empty, "admin"),
    )
}
# Each gRPC service's table (runtime/worker/service.py serves the first, the manager the second).
WORKER_SERVICE = "mpmd.Worker"
MANAGER_SERVICE = "mpmd.Manager"
TABLES: dict[str, dict[str, Verb]] = {WORKER_SERVICE: VERBS, MANAGER_SERVICE: MANAGER_VERBS}


def verb_of(request, table: dict[str, Verb] = VERBS) -> str:
    """The verb of `table` a request record is sent as; a record that several verbs take
    (Empty, JobRequest) is sent under a verb named by the caller."""
    names = [v.name for v in table.values() if v.request is type(request)]
    assert len(names) == 1, f"{type(request).__name__} is the request of {names or 'no verb'}: name the verb"
    return names[0]


def encode(record) -> dict:
    """A request or reply record as the JSON header of its frame; None fields are left out.
    The record is checked first (see check): a bad one is refused before it is sent."""
    return _header(check(record))


def check(record):
    """`record` itself if each field has its declared type, else ValueError naming the
    record and the field. The in-process cluster checks its runs with it, as the control
    plane's encode and the worker's decode_request do, so a bad request is refused the same
    way with or without a wire between."""
    _decode(type(record), _header(record), f"{type(record).__name__} record")
    return record


def _header(record) -> dict:
    return {f.name: v for f in dataclasses.fields(record) if (v := getattr(record, f.name)) is not None}


def decode_request(verb: str, header: dict, table: dict[str, Verb] = VERBS):
    """The request record of `verb` (of `table`) from a received header; ValueError naming the
    verb and the field that is missing, of the wrong type, or not one of the verb's."""
    if verb not in table:
        raise ValueError(f"no verb {verb!r}; the verbs are {', '.join(table)}")
    return _decode(table[verb].request, header, f"{verb} request")


def decode_reply(verb: str, header: dict, table: dict[str, Verb] = VERBS):
    """The reply record of `verb` from a received header (ValueError as decode_request)."""
    return _decode(table[verb].reply, header, f"{verb} reply")


def _decode(record: type, header: dict, what: str):
    fields = _fields(record)
    unknown = sorted(set(header) - set(fields))
    if unknown:
        raise ValueError(f"{what} has no field {unknown[0]!r}; its fields are {', '.join(fields) or 'none'}")
    values = {}
    for name, (kinds, optional, required) in fields.items():
        if name not in header:
            if required:
                raise ValueError(f"{what} field {name!r} must be {_describe(kinds, optional)}; it is missing")
            continue
        value = header[name]
        if not (value is None and optional) and not _is(value, kinds):
            # The type, never the value: a field may hold a secret (Setup's transfer_secret).
            raise ValueError(f"{what} field {name!r} must be {_describe(kinds, optional)}, got {type(value).__name__}")
        values[name] = value
    return record(**values)


def _is(value, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


def _describe(kinds: tuple[type, ...], optional: bool) -> str:
    names = {bool: "a bool", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return " or ".join(names[k] for k in kinds) + (" or null" if optional else "")


@functools.lru_cache(maxsize=None)
def _fields(record: type) -> dict[str, tuple[tuple[type, ...], bool, bool]]:
    """{field: (its JSON types, may be null, must be present)} of a record, from its annotations."""
    hints = typing.get_type_hints(record)
    out = {}
    for f in dataclasses.fields(record):
        hint = hints[f.name]
        args = (
            typing.get_args(hint)
            if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
            else (hint,)
        )
        kinds = tuple(a for a in args if a is not type(None))
        assert kinds and all(k in (bool, int, float, str, list, dict) for k in kinds), (record, f.name, hint)
        required = f.default is _EMPTY and f.default_factory is _EMPTY
        out[f.name] = (kinds, type(None) in args, required)
    return out
