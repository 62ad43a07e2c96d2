"""The worker's gRPC service: one Executor behind the control plane.

Methods (service `mpmd.Worker`, unary, bodies in the frame format of runtime/wire.py):
  Hello        -> {pid, devices, platform}
  Setup        {slice_index, transfer_host, transfer_secret (hex: keys the transfer ids)}
                                                        -> {transfer_address}
  Connect      {peers: {slice: transfer_address}}
  LoadPrograms {programs: [{name, kind, data, duration_s, outputs}]}
  InstallPlan  {name, stream: [instruction as runtime.instructions.to_json]}
  Put          {name, arrays: [blob]}                   Get {names} -> {arrays: {name: [blob]}}
  Delete       {names}
  Run          {plan, step, feeds: {name: [blob]}, fetch: [name], trace} -> {fetched, events, wall_s}
  Save         {items: {directory: [buffer name]}}      (asynchronous Orbax save; every
               directory must lie below the worker's root, as must Restore's)
  WaitSaves    -> {finalized: [directory]}              Restore {items: {directory: [name]}, staged}
  FinishRestore {commit}: bind (or drop) what a staged Restore read
  Heartbeat    -> {pid, step_running}
  Abort        {step}: run `step` (running or not yet arrived) raises at its next wait
  Shutdown
Every call must carry the cluster token in metadata `mpmd-token`; a call without it, or
with a wrong one, is refused (UNAUTHENTICATED) and logged. A malformed body gets
INVALID_ARGUMENT naming what is wrong; the worker keeps serving.
"""
from __future__ import annotations

import hmac
import logging
import os
import threading
import time
import traceback

import grpc
import jax

from runtime import instructions, programs, wire
from runtime.checkpoint import confine
from runtime.executor import Aborted, Executor
from runtime.instructions import Spec

SERVICE = "mpmd.Worker"
TOKEN_KEY = "mpmd-token"
# Shipped programs and activations can be large; gRPC's 4 MB default would refuse them.
GRPC_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
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
        self._running = threading.Lock()

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
        if self.transport is not None:
            self.transport.close()
        self.transport = TransferTransport(index, self.device, listen_host=_str(h, "transfer_host"), secret=secret)
        self.executor = Executor(index, self.device, self.transport)
        self.attached = True
        return {"transfer_address": self.transport.address}, []

    def Connect(self, h, b):
        peers = h.get("peers")
        if not isinstance(peers, dict):
            raise ValueError("Connect needs 'peers': {slice index: transfer address}")
        self._exec().transport.connect_peers({int(k): str(v) for k, v in peers.items()})
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
        stream = [instructions.from_json(i) for i in _list(h, "stream")]
        self._exec().install_plan(_str(h, "name"), stream)
        return {"instructions": len(stream)}, []

    def Put(self, h, b):
        self._exec().put(_str(h, "name"), [wire.blob(b, r) for r in _list(h, "arrays")])
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
        with self._running:
            result = self._exec().run(_str(h, "plan"), _int(h, "step"), feeds,
                                      tuple(str(n) for n in h.get("fetch", [])), bool(h.get("trace", False)))
        out = wire.Builder()
        fetched = {n: [out.add(a) for a in arrays] for n, arrays in result.fetched.items()}
        return {"fetched": fetched, "events": [list(e) for e in result.events], "wall_s": result.wall_s}, out.blobs

    def Save(self, h, b):
        self._exec().save(confine(_items(h), self.root))
        return {}, []

    def WaitSaves(self, h, b):
        return {"finalized": self._exec().wait_saves()}, []

    def Restore(self, h, b):
        self._exec().restore(confine(_items(h), self.root), staged=bool(h.get("staged", False)))
        return {}, []

    def FinishRestore(self, h, b):
        self._exec().finish_restore(bool(h.get("commit", False)))
        return {}, []

    def Heartbeat(self, h, b):
        return {"pid": os.getpid(), "step_running": self._running.locked()}, []

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
        names = ["Hello", "Setup", "Connect", "LoadPrograms", "InstallPlan", "Put", "Get", "Delete",
                 "Run", "Save", "WaitSaves", "Restore", "FinishRestore", "Heartbeat", "Abort", "Shutdown"]
        return grpc.method_handlers_generic_handler(
            SERVICE, {n: grpc.unary_unary_rpc_method_handler(self._wrap(n)) for n in names})

    def _wrap(self, name: str):
        method = getattr(self, name)

        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            token = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
            if not hmac.compare_digest(token.encode(), self._token):
                log.warning("refused %s from %s: %s token", name, context.peer(), "wrong" if token else "missing")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{name}: missing or wrong {TOKEN_KEY}")
            self.last_contact = time.monotonic()
            try:
                header, blobs = wire.decode(request)
                reply, out = method(header, blobs)
                return wire.encode(reply, out)
            except Aborted as e:
                context.abort(grpc.StatusCode.ABORTED, f"{name}: {e}")
            except (ValueError, KeyError, TypeError) as e:
                log.warning("bad %s request: %s", name, e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {type(e).__name__}: {e}")
            except Exception as e:
                log.error("%s failed:\n%s", name, traceback.format_exc())
                context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(e).__name__}: {e}")
        return call


def _items(h: dict) -> dict[str, list[str]]:
    items = h.get("items")
    if not isinstance(items, dict) or not all(isinstance(v, list) for v in items.values()):
        raise ValueError("'items' must be {directory: [buffer name, ...]}")
    return {str(d): [str(n) for n in names] for d, names in items.items()}


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
