"""The per-slice executor: walks one instruction stream per step.

The same class serves the in-process cluster (one executor per thread) and the worker
process (one executor behind the gRPC service). It owns its slice's buffers, including the
persistent ones (parameters, optimizer state), which never leave the slice unless fetched.

One step:
1. the step waits for its turn: runs execute one at a time, in the order the controller
   sent them (a Run may name the run it follows, `after`, so the controller can send step
   N+1 while step N runs: run-ahead dispatch);
2. each Recv is posted at its `post_after` mark (at the step's start unless the plan bounds
   its receive window: runtime/worker/streams.py with_recv_window), so each transfer runs
   while earlier instructions compute, and no more receives are outstanding (posted, not
   yet reached by the walk) than the window allows;
3. the stream is walked in order; Run dispatches a program (JAX dispatch is asynchronous, so
   the walk runs ahead of the device), Send hands the bundle to the transport without
   waiting for the receiver, Delete frees a buffer after its last use;
4. the fetched buffers come back to the caller as host arrays, with the task timings when
   tracing; the turn passes to the next run before the fetch waits for the device, and a
   queued run's feeds are laid out before its turn, so back-to-back runs leave no gap.

An error while walking the stream is raised as `StepFailed` naming the slice and the
instruction. `progress` tells the controller's watchdog where the walk stands: (run id,
instructions done, what it is doing), read by the worker's Heartbeat, a few attributes
written per instruction.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from mpmd.runtime.worker import failpoints
from mpmd.runtime.worker import programs as programs_lib
from mpmd.runtime.wire import reshard
from mpmd.runtime.wire import format as wire
from mpmd.runtime.wire.results import Aborted, Event, Progress, StepFailed, StepResult
from mpmd.runtime.worker.compile_cache import backend_compiles, persistent_loads
from mpmd.runtime.worker.slice_store import SliceCheckpointer, host_copy
from mpmd.runtime.worker.instructions import Copy, Delete, Instruction, Recv, Run, Send
from mpmd.runtime.worker.streams import PackedStream

if TYPE_CHECKING:
    from mpmd.runtime.wire.transport import Transport


class Executor:
    """One slice: `mesh` is its devices (runtime/worker/mesh.py); every buffer is laid out on it."""

    def __init__(
        self, slice_index: int, mesh: jax.sharding.Mesh, transport: Transport, load=programs_lib.load, agreement=None
    ):
        """load(spec, mesh) -> program: programs_lib.load, or a worker's CompileCache.load
        (runtime/worker/compile_cache.py), which shares loaded programs between sessions.
        agreement: a gang's (runtime/gang.Agreement), None for a slice of one process."""
        self.slice_index = slice_index
        self._load = load
        self.mesh = mesh
        self.transport = transport
        # A gang's (runtime/gang.Agreement): its processes stop a run together or not at all.
        self.agreement = agreement
        self.programs: dict[str, programs_lib.Program] = {}
        # Programs called since they were loaded: a program's first call reports its
        # signature whether it compiled or not (the executable may be cached from an earlier
        # session on this worker, and a hot spare still needs it).
        self._called: set[str] = set()
        self.plans: dict[str, tuple[Instruction, ...]] = {}
        self.buffers: dict[str, tuple[jax.Array, ...]] = {}
        self._aborted_upto = -1  # runs with an id <= this are aborted (even if not started yet)
        # Runs take turns: one at a time, each after the run it names (run-ahead dispatch).
        self._turn = threading.Condition()
        self._finished_upto = -1  # the newest run id that finished here (or was given up)
        self.busy = False  # a run holds the turn
        self._checkpointer = SliceCheckpointer()
        self._staged: dict[str, tuple] = {}  # a restore read but not yet bound (finish_restore)
        self.progress = Progress(-1, 0, "idle")

    # -- state -----------------------------------------------------------------------
    def load_programs(self, specs: dict[str, programs_lib.ProgramSpec]) -> None:
        for name, spec in specs.items():
            self.programs[name] = self._load(spec, self.mesh)
            self._called.discard(name)

    def install_plan(self, name: str, stream) -> int:
        """Install a list of instructions or an encoded stream (runtime/worker/streams.py, finished
        and expanded here); returns the number of instructions."""
        if isinstance(stream, PackedStream):
            stream = stream.expand()
        for i, ins in enumerate(stream):
            if isinstance(ins, Run) and ins.program not in self.programs:
                raise ValueError(
                    f"plan {name!r} instruction {i} runs unknown program "
                    f"{ins.program!r}; loaded: {sorted(self.programs)[:20]}"
                )
            if isinstance(ins, Recv):
                programs_lib.check_specs(ins.specs, f"plan {name!r} instruction {i} (recv {ins.key!r})")
                if not -1 <= ins.post_after < i:
                    raise ValueError(
                        f"plan {name!r} instruction {i} (recv {ins.key!r}) is posted after "
                        f"instruction {ins.post_after}; allowed: -1 (at the start) to {i - 1}"
                    )
        self.plans[name] = tuple(stream)
        return len(stream)

    def put(self, name: str, arrays, layouts=None, append: bool = False) -> None:
        """Bind `name` to `arrays`, each laid out as its entry of `layouts` (a PartitionSpec
        tuple; default: replicated on the slice's devices); with `append`, after the arrays
        `name` holds already (KeyError when it holds none)."""
        arrays = list(arrays)
        layouts = list(layouts) if layouts is not None else [()] * len(arrays)
        if len(layouts) != len(arrays):
            raise ValueError(f"put {name!r}: {len(arrays)} array(s) but {len(layouts)} layout(s)")
        if append and name not in self.buffers:
            raise KeyError(f"put {name!r} append: slice {self.slice_index} holds no such buffer to append to")
        placed = self._placed(arrays, layouts)
        self.buffers[name] = (*self.buffers[name], *placed) if append else placed

    def _placed(self, arrays, layouts=None) -> tuple[jax.Array, ...]:
        layouts = list(layouts) if layouts is not None else [()] * len(arrays)
        return tuple(
            jax.device_put(a, self._sharding(layout))
            if isinstance(a, jax.Array)
            else reshard.place(a, self._sharding(layout))
            for a, layout in zip(arrays, layouts)
        )

    def _sharding(self, layout) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*layout))

    def get(self, names) -> dict[str, tuple[np.ndarray, ...]]:
        missing = [n for n in names if n not in self.buffers]
        if missing:
            raise KeyError(f"slice {self.slice_index} has no buffer(s) {missing}")
        return {n: tuple(np.asarray(self._host_readable(a)) for a in self.buffers[n]) for n in names}

    def _host_readable(self, a: jax.Array) -> jax.Array:
        """`a`, or in a gang (a slice over several processes) a replicated copy when this
        process holds only part of it: a collective every process of the gang runs at the
        same point (a Get goes to all of them; a fetch is walked by all), so that each, and
        process 0 whose copy the controller reads, can turn it into host memory."""
        if a.is_fully_addressable or a.sharding.is_fully_replicated:
            return a
        return reshard.collective(reshard.replicated(self.mesh), a)

    def delete(self, names) -> None:
        for n in names:
            self.buffers.pop(n, None)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, items: dict, digests: bool = True) -> None:
        """Start an asynchronous save of {directory: [buffer names]} (whole bundles, under
        their names) or {directory: {key: [buffer, index]}} (array `index` of `buffer` under
        `key`: leaves addressed by what they are, whichever buffer holds them), each such
        array digested once written (`digests`)."""
        trees = {}
        for directory, entries in items.items():
            wanted = {b for b, _ in entries.values()} if isinstance(entries, dict) else set(entries)
            missing = sorted(wanted - set(self.buffers))
            if missing:
                raise ValueError(f"slice {self.slice_index} cannot save missing buffer(s) {missing}")
            if isinstance(entries, dict):
                bad = [k for k, (b, i) in entries.items() if not 0 <= i < len(self.buffers[b])]
                if bad:
                    raise ValueError(f"slice {self.slice_index} cannot save {bad[0]!r}: its buffer has no such array")
                trees[directory] = {key: self.buffers[b][i] for key, (b, i) in entries.items()}
            else:
                trees[directory] = {n: self.buffers[n] for n in entries}
        self._checkpointer.save(trees, digests=digests)

    def wait_saves(self, directories=None) -> dict[str, dict[str, str]]:
        """Until `directories` (default: every save started) are finalized: {directory: {key:
        digest}}; raises the first write error among them."""
        return self._checkpointer.wait(directories)

    def restore(self, items: dict, staged: bool = False, layouts=None, digests=None) -> None:
        """Replace buffers with a checkpoint's ({directory: [buffer names]} or {directory:
        {key: [[buffer, index], ...]}}, see SliceCheckpointer.restore); nothing changes if any
        part fails to read.
        With staged=True the arrays are held aside (replacing any staged before) until
        finish_restore: the controller binds them only once every slice has read its part.
        `layouts` ({buffer: [layout per array]}; default replicated) lays each array out on
        this slice's mesh, whatever mesh saved it. `digests` ({key: digest}): what each leaf
        read must match (slice_store.Damaged otherwise)."""
        if failpoints.armed:
            failpoints.hit("restore", f"reading {sorted(items)}")
        layouts = layouts or {}
        got = self._checkpointer.restore(items, lambda name, i: self._sharding(_nth(layouts.get(name), i)), digests)
        if staged:
            self._staged = got
        else:
            self.buffers.update(got)

    def finish_restore(self, commit: bool) -> None:
        """Bind the staged arrays as buffers (commit) or drop them."""
        staged, self._staged = self._staged, {}
        if commit:
            self.buffers.update(staged)

    def abort(self, run: int) -> None:
        """Make run `run` (and any earlier one) raise `Aborted` at its next wait, whether it is
        running now, waiting for its turn, or its Run message has not arrived yet."""
        with self._turn:
            self._aborted_upto = max(self._aborted_upto, run)
            self._turn.notify_all()

    def close(self) -> None:
        """Drop everything this slice holds (its session is closed): every run, running or
        queued or yet to arrive, is aborted; buffers, staged restores, plans and programs are
        let go (the arrays are freed once a run still walking has stopped, at its next
        instruction); saves already queued are still written."""
        self.abort(2**62)
        self.buffers, self._staged, self.plans, self.programs = {}, {}, {}, {}
        self._called = set()
        self._checkpointer.close()

    def _take_turn(self, run: int, after: int) -> None:
        """Wait until no run holds the turn and run `after` has finished here, then take it.
        A run sent ahead (run-ahead dispatch) queues here behind the one running."""
        with self._turn:
            while self.busy or self._finished_upto < after:
                if self._aborted_upto >= run:
                    raise Aborted(f"slice {self.slice_index}: run {run} aborted before it started")
                self._turn.wait(0.05)
            if self._aborted_upto >= run:  # e.g. the run after one that failed
                raise Aborted(f"slice {self.slice_index}: run {run} aborted before it started")
            self.busy = True

    def _end_turn(self, run: int) -> None:
        with self._turn:
            self.busy = False
            self._finished_upto = max(self._finished_upto, run)
            self._turn.notify_all()

    # -- one run --------------------------------------------------------------------
    def run(
        self,
        plan: str,
        run: int,
        feeds: dict[str, tuple] | None = None,
        fetch: tuple[str, ...] = (),
        trace: bool = False,
        after: int = -1,
    ) -> StepResult:
        """Run plan `plan` as run id `run`, once run `after` (-1: none) has finished here
        and no other run holds the turn."""
        if plan not in self.plans:
            raise ValueError(f"slice {self.slice_index}: no plan {plan!r}; installed: {sorted(self.plans)}")
        # Feeds are laid out on the devices before the turn: a run sent ahead has its inputs
        # in place when the run before it ends.
        staged = {name: self._placed(list(arrays)) for name, arrays in (feeds or {}).items()}
        try:
            self._take_turn(run, after)
        except Aborted:
            if self.agreement is not None:
                self.agreement.decide(run, "start", False)
            raise
        if self.agreement is not None and not self.agreement.decide(run, "start", self._aborted_upto < run):
            self._end_turn(run)
            raise Aborted(
                f"slice {self.slice_index}: run {run} aborted by another process of the gang before it started"
            )
        compiles_before, loads_before = backend_compiles(), persistent_loads()
        try:
            walked = self._walk(plan, run, staged, fetch, trace)
        finally:
            self._end_turn(run)
        # The turn passes before the fetch waits for this run's last results: a run queued
        # behind it dispatches its first programs while they are computed.
        try:
            fetched = {n: tuple(np.asarray(a) for a in arrays) for n, arrays in walked.fetch.items()}
        except Exception as e:
            self._raise(e, run, f"{plan} fetch {list(fetch)}")
        return StepResult(
            fetched,
            walked.events,
            (time.time_ns() - walked.t0) / 1e9,
            walked.held.peak,
            walked.held.peak_bytes,
            walked.peak_bytes,
            backend_compiles() - compiles_before,
            walked.compiled,
            persistent_loads() - loads_before,
        )

    def _walk(self, plan: str, run: int, staged: dict, fetch: tuple[str, ...], trace: bool) -> _Walked:
        t0 = time.time_ns()
        stream = self.plans[plan]
        buffers = self.buffers
        buffers.update(staged)
        held = _Held(self.transport, f"{run}:")
        posts: dict[int, list[Recv]] = {}  # instruction index -> receives posted after it
        for ins in stream:
            if isinstance(ins, Recv):
                if ins.post_after < 0:
                    held.post(ins)
                else:
                    posts.setdefault(ins.post_after, []).append(ins)
        prefix = held.prefix
        events: list[Event] = []
        compiled: dict[str, list] = {}  # program -> signatures of its calls a hot spare is to warm
        where = "start"
        peak_bytes = _bound_bytes(buffers) + held.bytes if trace else 0
        try:
            for i, ins in enumerate(stream):
                where = f"{plan}[{i}] {_describe(ins)}"
                if self._aborted_upto >= run:  # a plan without receives stops here too
                    raise Aborted(f"slice {self.slice_index}: run aborted at {where}")
                if isinstance(ins, Run):
                    self.progress = Progress(run, i, "run")
                    try:
                        args = [buffers[n] for n in ins.inputs]
                    except KeyError as e:
                        raise ValueError(f"reads buffer {e.args[0]!r}, which does not exist") from None
                    start = time.time_ns() if trace else 0
                    before = backend_compiles()
                    outs = self.programs[ins.program](*args)
                    # A call it had not compiled for, or its first: a hot spare warms it.
                    if backend_compiles() != before or ins.program not in self._called:
                        self._called.add(ins.program)
                        compiled.setdefault(ins.program, []).append(programs_lib.signature(args))
                    assert len(outs) == len(ins.outputs), (ins, len(outs))
                    for name, bundle in zip(ins.outputs, outs):
                        buffers[name] = tuple(bundle)
                    if self.agreement is not None:
                        # A gang's programs hold collectives, which must meet in the same order
                        # on every process; XLA:CPU may run programs dispatched back to back at
                        # once (a program whose inputs are ready overtakes one still running),
                        # so each runs alone, in stream order (reshard.collective likewise).
                        jax.block_until_ready(outs)
                    if trace:
                        jax.block_until_ready(outs)
                        events.append(Event(ins.label or ins.program, "run", start, time.time_ns()))
                elif isinstance(ins, Recv):
                    self.progress = Progress(run, i, "recv")
                    start = time.time_ns() if trace else 0
                    buffers[ins.buffer] = self._wait(held.take(ins), ins, run, i)
                    if trace:
                        events.append(Event(f"recv {ins.key}", "recv", start, time.time_ns()))
                elif isinstance(ins, Send):
                    if failpoints.armed:
                        failpoints.hit("transfer", f"run {run}: {where}")
                    self.transport.send(prefix + ins.key, buffers[ins.buffer], ins.dst, ins.pieces)
                elif isinstance(ins, Copy):
                    try:
                        arrays = buffers[ins.src]
                    except KeyError:
                        raise ValueError(f"copies buffer {ins.src!r}, which does not exist") from None
                    if ins.memory == "host" and failpoints.armed:
                        failpoints.hit("snapshot", f"run {run}: {where}")
                    buffers[ins.dst] = tuple(host_copy(a) if ins.memory == "host" else _on_device(a) for a in arrays)
                else:
                    assert isinstance(ins, Delete)
                    buffers.pop(ins.buffer, None)
                for later in posts.pop(i, ()):
                    held.post(later)
                if trace:
                    peak_bytes = max(peak_bytes, _bound_bytes(buffers) + held.bytes)
            where = f"{plan} fetch {list(fetch)}"
            # The arrays, not the names: a run after this one may rebind the names.
            to_fetch = {n: tuple(map(self._host_readable, buffers[n])) for n in fetch}
        except Aborted:
            raise
        except Exception as e:
            self._raise(e, run, where)
        finally:
            held.cancel()
            self.progress = Progress(run, len(stream), "idle")
        return _Walked(t0, tuple(events), held, peak_bytes, to_fetch, compiled)

    def _raise(self, e: Exception, run: int, where: str):
        if self._aborted_upto >= run:  # the echo of an abort (a peer's reset transfer)
            raise Aborted(f"slice {self.slice_index}: run aborted at {where}") from None
        raise StepFailed(self.slice_index, where, f"{type(e).__name__}: {e}") from e

    def _wait(self, fut, ins: Recv, run: int, index: int):
        # Poll so an abort (a peer lost mid-run) interrupts a receive that will never land.
        try:
            while True:
                if self._aborted_upto >= run:
                    raise Aborted(f"slice {self.slice_index}: run aborted while waiting for {ins.key!r}")
                try:
                    got = fut.result(timeout=0.05)
                    break
                except TimeoutError:
                    continue
        except BaseException:
            if self.agreement is not None:  # the gang's other processes stop here too
                self.agreement.decide(run, str(index), False)
            raise
        if self.agreement is not None and not self.agreement.decide(run, str(index), True):
            raise Aborted(f"slice {self.slice_index}: run aborted by another process of the gang at {ins.key!r}")
        # A gang's receive lands pieces only; they are put together here, in stream order.
        return got() if isinstance(got, reshard.Deferred) else tuple(got)


def _on_device(array: jax.Array) -> jax.Array:
    """`array` in device memory (from a host snapshot); on CPU the array itself."""
    kind = array.sharding.memory_kind
    return (
        array
        if kind in (None, "device") or all(d.platform == "cpu" for d in array.sharding.device_set)
        else jax.device_put(array, array.sharding.with_memory_kind("device"))
    )


class _Walked(NamedTuple):
    """A run's walk done, its results maybe still being computed."""

    t0: int  # time.time_ns() when the walk began
    events: tuple[Event, ...]
    held: _Held
    peak_bytes: int
    fetch: dict[str, tuple]  # name -> the arrays to bring back
    compiled: dict[str, list]  # program -> signatures of its first call and of calls that compiled


class _Held:
    """A step's receives that are posted and not yet reached by the walk: the memory a slice
    holds for data it has not used yet. Tracks the peak count and bytes (what the receive
    window bounds)."""

    def __init__(self, transport: Transport, prefix: str):
        self.transport, self.prefix = transport, prefix
        self.futures: dict[str, object] = {}
        self.bytes = self.peak = self.peak_bytes = 0

    def post(self, ins: Recv) -> None:
        self.futures[ins.buffer] = self.transport.recv(self.prefix + ins.key, ins.src, ins.specs, ins.pieces)
        self.bytes += wire.nbytes(ins.specs)
        self.peak = max(self.peak, len(self.futures))
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def take(self, ins: Recv):
        self.bytes -= wire.nbytes(ins.specs)
        return self.futures.pop(ins.buffer)

    def cancel(self) -> None:
        for fut in self.futures.values():
            fut.cancel()


def _bound_bytes(buffers: dict) -> int:
    return sum(a.nbytes for bundle in buffers.values() for a in bundle)


def _nth(layouts, i: int) -> tuple:
    return tuple(layouts[i]) if layouts is not None and i < len(layouts) else ()


def _describe(ins: Instruction) -> str:
    if isinstance(ins, Run):
        return f"run {ins.label or ins.program!r} (program {ins.program!r})"
    if isinstance(ins, Recv):
        return f"recv {ins.key!r} from slice {ins.src}"
    if isinstance(ins, Send):
        return f"send {ins.key!r} to slice {ins.dst}"
    if isinstance(ins, Copy):
        return f"copy {ins.src!r} to {ins.dst!r} ({ins.memory})"
    return f"delete {ins.buffer!r}"
