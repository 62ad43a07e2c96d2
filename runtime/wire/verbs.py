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


@dataclass(frozen=True)
class Setup:
    slice_index: int
    transfer_host: str
    transfer_secret: str             # hex: keys this session's transfer ids
    mesh: dict | None = None         # {data, fsdp, tensor} over all of the worker's devices; None: all on data


@dataclass(frozen=True)
class SetupReply:
    transfer_address: str


@dataclass(frozen=True)
class Connect:
    peers: dict                      # {slice: transfer address, or [one per process] for a gang}


@dataclass(frozen=True)
class LoadPrograms:
    programs: list                   # [{name, kind, data?: blob, duration_s?, outputs?}]


@dataclass(frozen=True)
class LoadProgramsReply:
    loaded: int


@dataclass(frozen=True)
class InstallPlan:
    name: str
    stream: list | None = None       # [instruction as instructions.to_json]
    encoded: dict | None = None      # blob: streams.PackedStream.to_bytes; the worker expands it


@dataclass(frozen=True)
class InstallPlanReply:
    instructions: int


@dataclass(frozen=True)
class Put:
    name: str
    arrays: list                     # [blob]
    layouts: list | None = None      # [layout], one per array; None: replicated


@dataclass(frozen=True)
class Get:
    names: list


@dataclass(frozen=True)
class GetReply:
    arrays: dict                     # {name: [blob]}


@dataclass(frozen=True)
class Delete:
    names: list


@dataclass(frozen=True)
class Run:
    plan: str
    run: int                         # the run id (never repeats: transfer keys are prefixed with it)
    after: int = -1                  # the run it waits for here (run-ahead); -1: none
    feeds: dict = field(default_factory=dict)     # {buffer name: [blob]}
    fetch: list = field(default_factory=list)     # [buffer name]
    trace: bool = False


@dataclass(frozen=True)
class RunReply:
    fetched: dict                    # {buffer name: [blob]}
    events: list                     # [[name, kind, start_ns, end_ns]]
    wall_s: float
    peak_held: int = 0
    peak_held_bytes: int = 0
    peak_bytes: int = 0


@dataclass(frozen=True)
class Save:
    items: dict                      # {directory: [buffer name] | {key: [buffer, index]}}


@dataclass(frozen=True)
class WaitSaves:
    directories: list | None = None  # None: every save started


@dataclass(frozen=True)
class WaitSavesReply:
    finalized: list


@dataclass(frozen=True)
class Restore:
    items: dict                      # {directory: [name] | {key: [[buffer, index], ...]}}
    staged: bool = False
    layouts: dict | None = None      # {buffer: [layout]}


@dataclass(frozen=True)
class FinishRestore:
    commit: bool


@dataclass(frozen=True)
class HeartbeatReply:
    pid: int
    running: bool                    # a run holds the executor's turn
    progress: list | None = None     # [run id, instructions done, doing]; None: not set up


@dataclass(frozen=True)
class Abort:
    run: int                         # this run and every earlier one


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


# -- the table -----------------------------------------------------------------------------
class Verb(NamedTuple):
    name: str
    request: type
    reply: type
    caller: str          # "job", "admin" or "any" (see the module docstring)


VERBS: dict[str, Verb] = {v.name: v for v in (
    Verb("Hello", Empty, HelloReply, "any"),
    Verb("Setup", Setup, SetupReply, "job"),
    Verb("Connect", Connect, Empty, "job"),
    Verb("LoadPrograms", LoadPrograms, LoadProgramsReply, "job"),
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
    Verb("Shutdown", Empty, Empty, "job"),      # admin too: see runtime/worker/service.py route
    Verb("OpenSession", OpenSession, Empty, "admin"),
    Verb("CloseSession", CloseSession, CloseSessionReply, "admin"),
    Verb("Sessions", Empty, SessionsReply, "admin"),
)}
# The verb of each request record that only one verb takes (Empty is several verbs').
_VERB_OF = {v.request: v.name for v in VERBS.values() if v.request is not Empty}


def verb_of(request) -> str:
    """The verb a request record is sent as."""
    return _VERB_OF[type(request)]


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


def decode_request(verb: str, header: dict):
    """The request record of `verb` from a received header; ValueError naming the verb and
    the field that is missing, of the wrong type, or not one of the verb's."""
    if verb not in VERBS:
        raise ValueError(f"no verb {verb!r}; the verbs are {', '.join(VERBS)}")
    return _decode(VERBS[verb].request, header, f"{verb} request")


def decode_reply(verb: str, header: dict):
    """The reply record of `verb` from a received header (ValueError as decode_request)."""
    return _decode(VERBS[verb].reply, header, f"{verb} reply")


def _decode(record: type, header: dict, what: str):
    fields = _fields(record)
    unknown = sorted(set(header) - set(fields))
    if unknown:
        raise ValueError(f"{what} has no field {unknown[0]!r}; its fields are "
                         f"{', '.join(fields) or 'none'}")
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
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
            else (hint,)
        kinds = tuple(a for a in args if a is not type(None))
        assert kinds and all(k in (bool, int, float, str, list, dict) for k in kinds), (record, f.name, hint)
        required = f.default is _EMPTY and f.default_factory is _EMPTY
        out[f.name] = (kinds, type(None) in args, required)
    return out
