"""The worker's gRPC service: one Executor behind the control plane.

Methods (service `mpmd.Worker`, unary, bodies in the frame format of runtime/wire.py):
  Hello        -> {pid, devices, platform}
  Setup        {slice_index, transfer_host, transfer_secret (hex: keys the transfer ids),
                mesh: {data, fsdp, tensor} (the slice's mesh over all of this worker's devices)}
                                                        -> {transfer_address}
  Connect      {peers: {slice: transfer_address, or [one per process] for a gang}}
  LoadPrograms {programs: [{name, kind, data, duration_s, outputs}]}
  InstallPlan  {name, stream: [instruction as runtime.instructions.to_json]}
               or {name, encoded: blob}  (runtime/streams.py Encoded.to_bytes: rows of integers
               over instruction templates; the worker checks, finishes and expands it)
  Put          {name, arrays: [blob], layouts?: [layout]}  Get {names} -> {arrays: {name: [blob]}}
  Delete       {names}
  Run          {plan, step, after?, feeds: {name: [blob]}, fetch: [name], trace}
                                -> {fetched, events, wall_s, peak_held, peak_held_bytes, peak_bytes}
               (runs one at a time; a Run waits for run `after` to finish here: run-ahead)
  Save         {items: {directory: [buffer name] | {key: [buffer, index]}}}  (a snapshot,
               written in the background;
               blocks while two saves are queued; every directory must lie below the
               worker's root, as must Restore's)
  WaitSaves    {directories?} -> {finalized: [directory]}  (those, default all started)
  Restore      {items: {directory: [name] | {key: [[buffer, index], ...]}}, staged,
               layouts?: {name: [layout]}}  (a keyed entry reads only those keys)
  FinishRestore {commit}: bind (or drop) what a staged Restore read
  Heartbeat    -> {pid, step_running, progress: [run id, instructions done, doing] | null}
  Abort        {step}: run `step` (running or not yet arrived) raises at its next wait
  Shutdown
A layout is a PartitionSpec over the mesh axes as JSON (runtime/instructions.py layout_to_json).
Every call must carry the cluster token in metadata `mpmd-token`; a call without it, or
with a wrong one, is refused (UNAUTHENTICATED) and logged, from its metadata alone, before
its body is read: the refusing handler takes the request as a stream it never reads, so a
400 MB body sent without the token costs the worker at most gRPC's flow-control window.
A malformed body gets INVALID_ARGUMENT naming what is wrong; the worker keeps serving. A
Run that fails at an instruction answers INVALID_ARGUMENT (a bad plan) or INTERNAL (a
program that raised) with trailing metadata naming the slice and the instruction, which
the controller raises as runtime.cluster.StepFailed.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import struct
import threading
import time
import traceback

import grpc
import jax

from runtime import instructions, mesh, programs, streams, wire
from runtime.checkpoint import confine
from runtime.cluster import StepFailed
from runtime.executor import Aborted, Executor
from runtime.instructions import Spec

SERVICE = "mpmd.Worker"
TOKEN_KEY = "mpmd-token"
# Shipped programs and activations can be large; gRPC's 4 MB default would refuse them.
GRPC_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
# The server's own: a port another process listens on is refused, not shared (with
# SO_REUSEPORT two workers on one port would both serve and split the requests), and one
# connection may not open more than MAX_STREAMS calls at once (the controller needs a few).
MAX_STREAMS = 64
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", MAX_STREAMS)]
# Trailing metadata of a failed Run: which slice and instruction (UTF-8; "-bin": any bytes).
FAILED_SLICE_KEY, FAILED_AT_KEY = "mpmd-failed-slice", "mpmd-failed-at-bin"
# Errors that mean "this request is malformed" whichever handler raised them.
_BAD_REQUEST = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, struct.error,
                json.JSONDecodeError)
log = logging.getLogger("mpmd.worker")


class WorkerService:
    """root: the only directory tree Save and Restore may touch (default: the current directory)."""

    def __init__(self, token: str, on_shutdown, root: str | None = None):
        self._token = token.encode()
        self.root = os.path.realpath(root if root is not None else os.getcwd())
        self._on_shutdown = on_shutdown
        self.device = jax.devices()[0]
        self.executor: Executor | None = None
        self.transport = None
        self.last_contact = time.monotonic()
        self.attached = False          # a controller has called Setup

    # -- handlers: (header, blobs) -> (header, blobs) ------------------------------------
    def Hello(self, h, b):
        return {"pid": os.getpid(), "devices": len(jax.devices()), "platform": self.device.platform}, []

    def Setup(self, h, b):
        from runtime.transport import TransferTransport, check_secret
        index = _int(h, "slice_index")
        try:     # checked before the session is touched; never echoed
            secret = check_secret(bytes.fromhex(_str(h, "transfer_secret")))
        except ValueError:
            raise ValueError("'transfer_secret' must be 16 to 64 bytes as a hex string") from None
        shape = mesh.shape_of(h.get("mesh") or {"data": len(jax.devices())})
        slice_mesh = mesh.bind(shape, jax.devices())
        if self.transport is not None:
            self.transport.close()
        self.transport = TransferTransport(index, slice_mesh, listen_host=_str(h, "transfer_host"), secret=secret)
        agreement = None
        if jax.process_count() > 1:     # a gang (runtime/gang.py): one namespace per session and slice
            from runtime.gang import Agreement
            from runtime.transport import key_to_uuid
            agreement = Agreement(f"mpmd/{key_to_uuid(f'gang{index}', secret):016x}")
        self.executor = Executor(index, slice_mesh, self.transport, agreement)
        self.attached = True
        return {"transfer_address": self.transport.address}, []

    def Connect(self, h, b):
        peers = h.get("peers")
        address = lambda v: isinstance(v, str) and v.rpartition(":")[2].isdigit()
        if not isinstance(peers, dict) or not all(address(v) or (isinstance(v, list) and v and all(map(address, v)))
                                                  for v in peers.values()):
            raise ValueError(f"Connect needs 'peers': {{slice index: 'host:port' transfer address, or a list "
                             f"of them (a gang: one per process)}}, got {peers!r:.200}")
        peers = {int(k): v for k, v in peers.items()}
        try:
            self._exec().transport.connect_peers(peers)
        except RuntimeError as e:      # XLA's own refusal of an address
            raise ValueError(f"cannot connect to peers {peers}: {e}") from None
        return {}, []

    def LoadPrograms(self, h, b):
        specs = {}
        for p in _list(h, "programs"):
            outputs = tuple(tuple(Spec(tuple(s), d) for s, d in bundle) for bundle in p.get("outputs", []))
            data = wire.blob(b, p["data"], bytes) if "data" in p else b""
            specs[_str(p, "name")] = programs.ProgramSpec(_str(p, "kind"), data, float(p.get("duration_s", 0.0)), outputs)
        self._exec().load_programs(specs)
        return {"loaded": len(specs)}, []

    def InstallPlan(self, h, b):
        if "encoded" in h:
            stream = streams.from_bytes(wire.blob(b, h["encoded"], bytes))
        else:
            stream = [instructions.from_json(i) for i in _list(h, "stream")]
        return {"instructions": self._exec().install_plan(_str(h, "name"), stream)}, []

    def Put(self, h, b):
        layouts = [instructions.layout_from_json(l) for l in _list(h, "layouts")] if "layouts" in h else None
        self._exec().put(_str(h, "name"), [wire.blob(b, r) for r in _list(h, "arrays")], layouts)
        return {}, []

    def Get(self, h, b):
        got = self._exec().get([str(n) for n in _list(h, "names")])
        out = wire.Builder()
        return {"arrays": {n: [out.add(a) for a in arrays] for n, arrays in got.items()}}, out.blobs

    def Delete(self, h, b):
        self._exec().delete([str(n) for n in _list(h, "names")])
        return {}, []

    def Run(self, h, b):
        feeds = h.get("feeds", {})
        if not isinstance(feeds, dict):
            raise ValueError("Run 'feeds' must be {buffer name: [blob, ...]}")
        feeds = {str(n): [wire.blob(b, r) for r in refs] for n, refs in feeds.items()}
        after = _int(h, "after") if "after" in h else -1
        # The executor takes turns: a Run sent ahead waits there behind the one running.
        result = self._exec().run(_str(h, "plan"), _int(h, "step"), feeds,
                                  tuple(str(n) for n in h.get("fetch", [])), bool(h.get("trace", False)), after)
        out = wire.Builder()
        fetched = {n: [out.add(a) for a in arrays] for n, arrays in result.fetched.items()}
        return {"fetched": fetched, "events": [list(e) for e in result.events], "wall_s": result.wall_s,
                "peak_held": result.peak_held, "peak_held_bytes": result.peak_held_bytes,
                "peak_bytes": result.peak_bytes}, out.blobs

    def Save(self, h, b):
        self._exec().save(confine(_items(h), self.root))
        return {}, []

    def WaitSaves(self, h, b):
        directories = None
        if "directories" in h:
            directories = list(confine({str(d): [] for d in _list(h, "directories")}, self.root))
        return {"finalized": self._exec().wait_saves(directories)}, []

    def Restore(self, h, b):
        layouts = h.get("layouts", {})
        if not isinstance(layouts, dict) or not all(isinstance(v, list) for v in layouts.values()):
            raise ValueError("Restore 'layouts' must be {buffer name: [layout, ...]}")
        layouts = {str(n): [instructions.layout_from_json(l) for l in ls] for n, ls in layouts.items()}
        self._exec().restore(confine(_items(h), self.root), staged=bool(h.get("staged", False)), layouts=layouts)
        return {}, []

    def FinishRestore(self, h, b):
        self._exec().finish_restore(bool(h.get("commit", False)))
        return {}, []

    def Heartbeat(self, h, b):
        progress = list(self.executor.progress) if self.executor is not None else None
        running = self.executor is not None and self.executor.busy
        return {"pid": os.getpid(), "step_running": running, "progress": progress}, []

    def Abort(self, h, b):
        """Stop a running step and drop this slice's pending transfers (peers waiting on them
        fail instead of hanging; nothing of the aborted step can pair with a later one)."""
        if self.executor is not None:
            self.executor.abort(_int(h, "step"))
            self.transport.reset()
        return {}, []

    def Shutdown(self, h, b):
        threading.Thread(target=self._on_shutdown, args=("controller asked",), daemon=True).start()
        return {}, []

    def reset(self) -> None:
        """Drop the slice (buffers, programs, transfer server) and wait for a controller."""
        if self.transport is not None:
            self.transport.close()
        self.executor, self.transport, self.attached = None, None, False

    # -- plumbing --------------------------------------------------------------------------
    def _exec(self) -> Executor:
        if self.executor is None:
            raise ValueError("worker is not set up: call Setup first")
        return self.executor

    def handler(self) -> grpc.GenericRpcHandler:
        return _Handler(self)

    def authorized(self, metadata) -> bool:
        token = dict(metadata or ()).get(TOKEN_KEY, "")
        return isinstance(token, str) and hmac.compare_digest(token.encode(), self._token)

    def wrap(self, name: str):
        method = getattr(self, name)

        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.last_contact = time.monotonic()
            try:
                header, blobs = wire.decode(request)
                reply, out = method(header, blobs)
                return wire.encode(reply, out)
            except Aborted as e:
                context.abort(grpc.StatusCode.ABORTED, f"{name}: {e}")
            except StepFailed as e:
                bad_plan = isinstance(e.__cause__, _BAD_REQUEST)
                (log.warning if bad_plan else log.error)("%s failed: %s\n%s", name, e,
                                                         "" if bad_plan else traceback.format_exc())
                context.set_trailing_metadata(((FAILED_SLICE_KEY, str(e.slice_index)),
                                               (FAILED_AT_KEY, e.instruction.encode())))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT if bad_plan else grpc.StatusCode.INTERNAL,
                              e.message)
            except _BAD_REQUEST as e:
                log.warning("bad %s request: %s", name, e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {type(e).__name__}: {e}")
            except Exception as e:
                log.error("%s failed:\n%s", name, traceback.format_exc())
                context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(e).__name__}: {e}")
        return call


class _Handler(grpc.GenericRpcHandler):
    """Routes a call by its method name and metadata, before gRPC reads its body. A call
    without the token gets a handler that takes the request as a stream and never reads it:
    the refusal costs a few bytes whatever the body's size (the wire format of a unary and a
    streaming request is the same)."""

    METHODS = ("Hello", "Setup", "Connect", "LoadPrograms", "InstallPlan", "Put", "Get", "Delete",
               "Run", "Save", "WaitSaves", "Restore", "FinishRestore", "Heartbeat", "Abort", "Shutdown")

    def __init__(self, service: WorkerService):
        self._service = service
        self._handlers = {f"/{SERVICE}/{n}": grpc.unary_unary_rpc_method_handler(service.wrap(n))
                          for n in self.METHODS}

    def service(self, details: grpc.HandlerCallDetails):
        handler = self._handlers.get(details.method)
        if handler is None or self._service.authorized(details.invocation_metadata):
            return handler
        token = dict(details.invocation_metadata or ()).get(TOKEN_KEY)
        name = details.method.rpartition("/")[2]

        def refuse(_unread_requests, context: grpc.ServicerContext):
            log.warning("refused %s from %s: %s token", name, context.peer(), "wrong" if token else "missing")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{name}: missing or wrong {TOKEN_KEY}")
        return grpc.stream_unary_rpc_method_handler(refuse)


def _items(h: dict) -> dict:
    """{directory: [buffer name]} or {directory: {key: [buffer, index]}} (Save) or {directory:
    {key: [[buffer, index], ...]}} (Restore), checked and typed."""
    items = h.get("items")
    if not isinstance(items, dict):
        raise ValueError("'items' must be {directory: [buffer name, ...] or {key: [buffer, index]}}")
    out = {}
    for d, entries in items.items():
        if isinstance(entries, list):
            out[str(d)] = [str(n) for n in entries]
        elif isinstance(entries, dict):
            out[str(d)] = {str(k): _targets(v) for k, v in entries.items()}
        else:
            raise ValueError(f"'items' entry of {str(d)!r} must be a list of buffer names or "
                             f"{{key: [buffer, index]}}, got {type(entries).__name__}")
    return out


def _targets(v):
    """[buffer, index] (a Save's key) or [[buffer, index], ...] (a Restore's)."""
    pair = lambda p: (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                      and isinstance(p[1], int) and not isinstance(p[1], bool) and p[1] >= 0)
    if pair(v):
        return (v[0], v[1])
    if isinstance(v, list) and v and all(pair(p) for p in v):
        return [(p[0], p[1]) for p in v]
    raise ValueError(f"a keyed checkpoint entry must be [buffer, index] or [[buffer, index], ...], got {v!r:.80}")


def _int(h: dict, key: str) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"'{key}' must be an integer, got {v!r:.50}")
    return v


def _str(h: dict, key: str) -> str:
    v = h.get(key)
    if not isinstance(v, str):
        raise ValueError(f"'{key}' must be a string, got {v!r:.50}")
    return v


def _list(h: dict, key: str) -> list:
    v = h.get(key)
    if not isinstance(v, list):
        raise ValueError(f"'{key}' must be a list, got {type(v).__name__}")
    return v
