"""The per-slice executor: walks one instruction stream per step.

The same class serves the in-process cluster (one executor per thread) and the worker
process (one executor behind the gRPC service). It owns its slice's buffers, including the
persistent ones (parameters, optimizer state), which never leave the slice unless fetched.

One step:
1. every Recv of the stream is posted at once, so each transfer runs while earlier
   instructions compute;
2. the stream is walked in order; Run dispatches a program (JAX dispatch is asynchronous, so
   the walk runs ahead of the device), Send hands the bundle to the transport without
   waiting for the receiver, Delete frees a buffer after its last use;
3. the fetched buffers come back to the caller as host arrays, with the task timings when
   tracing.

An error while walking the stream is raised as `StepFailed` naming the slice and the
instruction. `progress` tells the controller's watchdog where the walk stands: (run id,
instructions done, what it is doing), read by the worker's Heartbeat, a few attributes
written per instruction.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from runtime import programs as programs_lib
from runtime.checkpoint import SliceCheckpointer, host_copy
from runtime.cluster import StepFailed
from runtime.instructions import Copy, Delete, Instruction, Recv, Run, Send

if TYPE_CHECKING:
    from runtime.transport import Transport


class Event(NamedTuple):
    """One traced interval on a slice; times are wall-clock ns (comparable across processes).
    The one definition: the dry run, the control plane and the run log all use this one."""
    name: str        # a Run's label, "recv <key>" or "send <key>"
    kind: str        # "run" | "recv" | "send"
    start_ns: int
    end_ns: int


class StepResult(NamedTuple):
    fetched: dict[str, tuple[np.ndarray, ...]]
    events: tuple[Event, ...]
    wall_s: float    # time from the step's start to its last fetched array being ready


class Aborted(RuntimeError):
    """The step was aborted (a peer slice was lost); the slice's buffers are undefined."""


class Progress(NamedTuple):
    """Where a slice's walk stands, for the watchdog: run id, instructions done in it, and
    what it does now ("idle", "run" a program, "recv" waiting for a peer, "fetch")."""
    run: int
    done: int
    doing: str


class Executor:
    """One slice: `mesh` is its devices (runtime/mesh.py); every buffer is laid out on it."""

    def __init__(self, slice_index: int, mesh: jax.sharding.Mesh, transport: Transport):
        self.slice_index = slice_index
        self.mesh = mesh
        self.transport = transport
        self.programs: dict[str, programs_lib.Program] = {}
        self.plans: dict[str, tuple[Instruction, ...]] = {}
        self.buffers: dict[str, tuple[jax.Array, ...]] = {}
        self._aborted_upto = -1      # runs with an id <= this are aborted (even if not started yet)
        self._checkpointer = SliceCheckpointer()
        self._staged: dict[str, tuple] = {}     # a restore read but not yet bound (finish_restore)
        self.progress = Progress(-1, 0, "idle")

    # -- state -----------------------------------------------------------------------
    def load_programs(self, specs: dict[str, programs_lib.ProgramSpec]) -> None:
        for name, spec in specs.items():
            self.programs[name] = programs_lib.load(spec, self.mesh)

    def install_plan(self, name: str, stream: list[Instruction]) -> None:
        for i, ins in enumerate(stream):
            if isinstance(ins, Run) and ins.program not in self.programs:
                raise ValueError(f"plan {name!r} instruction {i} runs unknown program "
                                 f"{ins.program!r}; loaded: {sorted(self.programs)[:20]}")
            if isinstance(ins, Recv):
                programs_lib.check_specs(ins.specs, f"plan {name!r} instruction {i} (recv {ins.key!r})")
        self.plans[name] = tuple(stream)

    def put(self, name: str, arrays, layouts=None) -> None:
        """Bind `name` to `arrays`, each laid out as its entry of `layouts` (a PartitionSpec
        tuple; default: replicated on the slice's devices)."""
        arrays = list(arrays)
        layouts = list(layouts) if layouts is not None else [()] * len(arrays)
        if len(layouts) != len(arrays):
            raise ValueError(f"put {name!r}: {len(arrays)} array(s) but {len(layouts)} layout(s)")
        self.buffers[name] = tuple(jax.device_put(np.asarray(a) if not isinstance(a, jax.Array) else a,
                                                  self._sharding(layout)) for a, layout in zip(arrays, layouts))

    def _sharding(self, layout) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*layout))

    def get(self, names) -> dict[str, tuple[np.ndarray, ...]]:
        missing = [n for n in names if n not in self.buffers]
        if missing:
            raise KeyError(f"slice {self.slice_index} has no buffer(s) {missing}")
        return {n: tuple(np.asarray(a) for a in self.buffers[n]) for n in names}

    def delete(self, names) -> None:
        for n in names:
            self.buffers.pop(n, None)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, items: dict[str, list[str]]) -> None:
        """Start an asynchronous save of {directory: [buffer names]}."""
        missing = [n for names in items.values() for n in names if n not in self.buffers]
        if missing:
            raise ValueError(f"slice {self.slice_index} cannot save missing buffer(s) {missing}")
        self._checkpointer.save({d: {n: self.buffers[n] for n in names} for d, names in items.items()})

    def wait_saves(self, directories=None) -> list[str]:
        """Until `directories` (default: every save started) are finalized; raises the first
        write error among them."""
        return self._checkpointer.wait(directories)

    def restore(self, items: dict[str, list[str]], staged: bool = False, layouts=None) -> None:
        """Replace buffers with a checkpoint's; nothing changes if any part fails to read.
        With staged=True the arrays are held aside (replacing any staged before) until
        finish_restore: the controller binds them only once every slice has read its part.
        `layouts` ({buffer: [layout per array]}; default replicated) lays each array out on
        this slice's mesh, whatever mesh saved it."""
        layouts = layouts or {}
        got = self._checkpointer.restore(items, lambda name, i: self._sharding(_nth(layouts.get(name), i)))
        if staged:
            self._staged = got
        else:
            self.buffers.update(got)

    def finish_restore(self, commit: bool) -> None:
        """Bind the staged arrays as buffers (commit) or drop them."""
        staged, self._staged = self._staged, {}
        if commit:
            self.buffers.update(staged)

    def abort(self, step: int) -> None:
        """Make run `step` (and any earlier one) raise `Aborted` at its next wait, whether it is
        running now or its Run message has not arrived yet."""
        self._aborted_upto = max(self._aborted_upto, step)

    # -- one step --------------------------------------------------------------------
    def run(self, plan: str, step: int, feeds: dict[str, tuple] | None = None,
            fetch: tuple[str, ...] = (), trace: bool = False) -> StepResult:
        if plan not in self.plans:
            raise ValueError(f"slice {self.slice_index}: no plan {plan!r}; installed: {sorted(self.plans)}")
        t0 = time.time_ns()
        stream = self.plans[plan]
        buffers = self.buffers
        for name, arrays in (feeds or {}).items():
            self.put(name, arrays)
        prefix = f"{step}:"
        pending = {ins.buffer: self.transport.recv(prefix + ins.key, ins.src, ins.specs, ins.pieces)
                   for ins in stream if isinstance(ins, Recv)}
        events: list[Event] = []
        where = "start"
        try:
            for i, ins in enumerate(stream):
                where = f"{plan}[{i}] {_describe(ins)}"
                if isinstance(ins, Run):
                    self.progress = Progress(step, i, "run")
                    try:
                        args = [buffers[n] for n in ins.inputs]
                    except KeyError as e:
                        raise ValueError(f"reads buffer {e.args[0]!r}, which does not exist") from None
                    start = time.time_ns() if trace else 0
                    outs = self.programs[ins.program](*args)
                    assert len(outs) == len(ins.outputs), (ins, len(outs))
                    for name, bundle in zip(ins.outputs, outs):
                        buffers[name] = tuple(bundle)
                    if trace:
                        jax.block_until_ready(outs)
                        events.append(Event(ins.label or ins.program, "run", start, time.time_ns()))
                elif isinstance(ins, Recv):
                    self.progress = Progress(step, i, "recv")
                    start = time.time_ns() if trace else 0
                    buffers[ins.buffer] = self._wait(pending.pop(ins.buffer), ins, step)
                    if trace:
                        events.append(Event(f"recv {ins.key}", "recv", start, time.time_ns()))
                elif isinstance(ins, Send):
                    self.transport.send(prefix + ins.key, buffers[ins.buffer], ins.dst, ins.pieces)
                elif isinstance(ins, Copy):
                    try:
                        arrays = buffers[ins.src]
                    except KeyError:
                        raise ValueError(f"copies buffer {ins.src!r}, which does not exist") from None
                    buffers[ins.dst] = tuple(host_copy(a) if ins.memory == "host" else _on_device(a)
                                             for a in arrays)
                else:
                    assert isinstance(ins, Delete)
                    buffers.pop(ins.buffer, None)
            self.progress = Progress(step, len(stream), "fetch")
            where = f"{plan} fetch {list(fetch)}"
            fetched = {n: tuple(np.asarray(a) for a in buffers[n]) for n in fetch}
        except Aborted:
            raise
        except Exception as e:
            if self._aborted_upto >= step:      # the echo of an abort (a peer's reset transfer)
                raise Aborted(f"slice {self.slice_index}: step aborted at {where}") from None
            raise StepFailed(self.slice_index, where, f"{type(e).__name__}: {e}") from e
        finally:
            for fut in pending.values():
                fut.cancel()
            self.progress = Progress(step, len(stream), "idle")
        return StepResult(fetched, tuple(events), (time.time_ns() - t0) / 1e9)

    def _wait(self, fut, ins: Recv, step: int):
        # Poll so an abort (a peer lost mid-step) interrupts a receive that will never land.
        while True:
            if self._aborted_upto >= step:
                raise Aborted(f"slice {self.slice_index}: step aborted while waiting for {ins.key!r}")
            try:
                return tuple(fut.result(timeout=0.05))
            except TimeoutError:
                continue


def _on_device(array: jax.Array) -> jax.Array:
    """`array` in device memory (from a host snapshot); on CPU the array itself."""
    kind = array.sharding.memory_kind
    return array if kind in (None, "device") or all(d.platform == "cpu" for d in array.sharding.device_set) \
        else jax.device_put(array, array.sharding.with_memory_kind("device"))


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
