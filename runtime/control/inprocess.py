"""InProcessCluster: every slice is an executor on its own thread and its own JAX devices
(a mesh of this process's devices: slice 0 the first D_0, slice 1 the next D_1, ...).

Transfers between slices are in-memory hand-offs, cut and put together by runtime/wire/reshard.py
exactly as between processes (only the wire is missing).
It runs exactly the programs and instruction streams the multi-process clusters run, so the
two are pinned to identical results by the tests.
"""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from mpmd.runtime.worker import mesh
from mpmd.runtime.worker import streams
from mpmd.runtime.wire import reshard
from mpmd.runtime.wire import verbs
from mpmd.runtime.control.cluster import InFlight, PendingRun, ReplaceUnsupported, RunDispatch
from mpmd.runtime.wire.results import Aborted, StepResult
from mpmd.runtime.worker.executor import Executor


class _Hub:
    """Rendezvous of sends and receives by key; whichever side comes first creates the slot."""

    def __init__(self):
        self._lock = threading.Lock()
        self._slots: dict[str, Future] = {}

    def slot(self, key: str) -> Future:
        with self._lock:
            fut = self._slots.get(key)
            if fut is None:
                fut = self._slots[key] = Future()
            return fut

    def drop(self, key: str) -> None:
        with self._lock:
            self._slots.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()


class MemoryTransport:
    def __init__(self, hub: _Hub, slice_mesh: jax.sharding.Mesh):
        self._hub = hub
        self._mesh = slice_mesh

    def send(self, key: str, arrays, dst_slice: int, pieces: tuple[int, ...] = ()) -> None:
        counts = pieces or (1,) * len(arrays)
        self._hub.slot(key).set_result(tuple(reshard.cut(a, n) for a, n in zip(arrays, counts)))

    def recv(self, key: str, src_slice: int, specs, pieces: tuple[int, ...] = ()) -> Future:
        out: Future = Future()
        slice_mesh = self._mesh

        def land(src: Future):
            self._hub.drop(key)
            if src.cancelled():
                out.cancel()
            elif not out.cancelled():
                # Asynchronous: the copies wait for the producer on the device.
                out.set_result(
                    tuple(
                        reshard.assemble(parts, s.shape, s.layout, slice_mesh) for parts, s in zip(src.result(), specs)
                    )
                )

        self._hub.slot(key).add_done_callback(land)
        return out

    def close(self) -> None:
        pass


def meshes_for(shapes, devices=None) -> list[jax.sharding.Mesh]:
    """Each slice's mesh shape bound to its own run of this process's devices."""
    devices = list(devices) if devices is not None else jax.devices()
    try:
        return mesh.bind_all(shapes, devices)
    except ValueError as e:
        need = sum(int(np.prod(mesh.shape_of(s))) for s in shapes)
        raise ValueError(
            f"InProcessCluster: {e}. On CPU, get more by setting "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX starts."
        ) from None


class InProcessCluster(RunDispatch):
    """All slices in this process (the Cluster protocol of runtime/control/cluster.py). `devices`
    defaults to jax.devices()."""

    def __init__(self, devices=None):
        self._devices = devices
        self.executors: list[Executor] = []
        self._pool: ThreadPoolExecutor | None = None
        self._hub = _Hub()
        self._in_flight = InFlight()
        self._removed = 0  # slices removed and not added back
        self._generation = 0  # a start, a shrink or a grow: as a ControlPlane counts them
        self._incarnation = secrets.token_hex(3)

    @property
    def num_slices(self) -> int:
        return len(self.executors)

    @property
    def devices_per_slice(self) -> None:
        """None: each slice takes the mesh `start` gives it, from this process's devices."""
        return None

    @property
    def generation_tag(self) -> str:
        """As ControlPlane's (the name checkpoint parts are written under); in-process slices
        are never left behind, but their checkpoints are laid out the same way."""
        return f"g{self._generation}-{self._incarnation}"

    def start(self, num_slices: int, root: str | None = None, meshes=None) -> None:
        # root is not enforced: in-process slices are this process, with its own rights.
        if self.executors:
            raise RuntimeError("this InProcessCluster is already started; make a new one per Trainer")
        self._shapes = list(meshes) if meshes is not None else [(1, 1, 1)] * num_slices
        bound = meshes_for(self._shapes, self._devices)
        self._generation += 1
        self.executors = [Executor(i, m, MemoryTransport(self._hub, m)) for i, m in enumerate(bound)]
        self._pool = ThreadPoolExecutor(2 * num_slices, thread_name_prefix="mpmd-slice")

    # Each verb builds the record a worker's service takes (runtime/wire/verbs.py) as the control
    # plane builds it, objects (arrays, program specs, instructions) in place of blob references
    # and JSON, and checks it: a request the table refuses is refused here too, for every verb.
    def load_programs(self, slice_index: int, specs) -> None:
        r = verbs.check(verbs.LoadPrograms(list(specs.items())))
        self.executors[slice_index].load_programs(dict(r.programs))

    def install_plan(self, slice_index: int, name: str, stream) -> None:
        # A packed stream stands for the blob the wire's `encoded` references: only its name is a field.
        packed = isinstance(stream, streams.PackedStream)
        r = verbs.check(verbs.InstallPlan(name, stream=None if packed else list(stream)))
        self.executors[slice_index].install_plan(r.name, stream if packed else r.stream)

    def put(self, slice_index: int, name: str, arrays, layouts=None, append: bool = False) -> None:
        r = verbs.check(verbs.Put(name, list(arrays), list(layouts) if layouts is not None else None, append or None))
        self.executors[slice_index].put(r.name, r.arrays, r.layouts, bool(r.append))

    def get(self, slice_index: int, names) -> dict:
        return self.executors[slice_index].get(verbs.check(verbs.Get(list(names))).names)

    def delete(self, slice_index: int, names) -> None:
        self.executors[slice_index].delete(verbs.check(verbs.Delete(list(names))).names)

    def save(self, slice_index: int, items: dict, digests: bool = True) -> None:
        r = verbs.check(verbs.Save(items, digests))
        self.executors[slice_index].save(r.items, r.digests)

    def wait_saves(self, slice_index: int, directories=None) -> dict[str, dict[str, str]]:
        r = verbs.check(verbs.WaitSaves(None if directories is None else list(directories)))
        return self.executors[slice_index].wait_saves(r.directories)

    def restore(self, slice_index: int, items: dict, staged: bool = False, layouts=None, digests=None) -> None:
        r = verbs.check(
            verbs.Restore(items, staged, dict(layouts) if layouts else None, dict(digests) if digests else None)
        )
        self.executors[slice_index].restore(r.items, r.staged, r.layouts, r.digests)

    def finish_restore(self, slice_index: int, commit: bool) -> None:
        self.executors[slice_index].finish_restore(verbs.check(verbs.FinishRestore(commit)).commit)

    def _send(self, plan, run, after, feeds, fetch, trace) -> list[Future]:
        # The pool runs tasks in submission order, so every task of a run has a thread before
        # any task of a later one: a task waiting for its turn never starves the one it waits for.
        requests = [
            verbs.check(verbs.Run(plan, run, after, dict(feeds.get(i) or {}), list(fetch.get(i, ())), trace))
            for i in range(len(self.executors))
        ]
        return [
            self._pool.submit(ex.run, r.plan, r.run, r.feeds, tuple(r.fetch), r.trace, r.after)
            for ex, r in zip(self.executors, requests)
        ]

    def _wait(self, run: PendingRun) -> list[StepResult]:
        def abort():
            newest = self._in_flight.drop_all(f"run {run.run} before it failed")
            for ex in self.executors:
                ex.abort(newest)

        return gather(run.futures, on_error=abort, cleanup=self._hub.clear)

    def replace(self, slice_index: int, wait_s: float | None = None) -> None:
        """Always ReplaceUnsupported: a slice here is a thread of this very process, so it is
        never lost on its own (nothing raises WorkerLost) and there is nothing to replace it with."""
        raise ReplaceUnsupported(
            f"slice {slice_index} runs inside this process (InProcessCluster); "
            f"an in-process slice cannot be replaced: use LocalCluster, "
            f"StaticCluster or RayCluster for recovery from lost workers"
        )

    def remove(self, slice_index: int, meshes=None) -> None:
        """Every remaining slice gets a fresh executor (see Cluster.remove). In-process slices
        are never lost, so only a caller that asks for fewer slices gets here."""
        self._resize(len(self.executors) - 1, meshes)
        self._removed += 1

    def add(self, meshes=None, before_reset=None) -> None:
        if not self._removed:
            raise ReplaceUnsupported("no slice of this InProcessCluster was removed: there is none to add back")
        if before_reset is not None:
            before_reset()
        self._resize(len(self.executors) + 1, meshes)
        self._removed -= 1

    def _resize(self, num_slices: int, meshes) -> None:
        meshes = list(meshes) if meshes is not None else [self._shapes[0]] * num_slices
        self.close()
        self.start(num_slices, meshes=meshes)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.executors = []


def gather(futures: list[Future], on_error, cleanup=lambda: None) -> list:
    """Results of per-slice futures in order. On the first failure, abort the rest (they may
    be waiting for data the failed slice will never send), wait for them, and re-raise the
    root cause rather than the aborts it triggered."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    if all(f.exception() is None for f in done) and len(done) == len(futures):
        return [f.result() for f in futures]
    on_error()
    wait(futures)
    cleanup()
    errors = [f.exception() for f in futures if f.exception() is not None]
    root = [e for e in errors if not isinstance(e, Aborted)]
    raise (root or errors)[0]
