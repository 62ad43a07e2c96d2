"""The cluster contract, in one place: what the Trainer may ask of a cluster, and what a
launcher must do for the one gRPC control plane.

Two protocols:
- `Cluster`: the verbs the Trainer calls. InProcessCluster (threads, runtime/control/inprocess.py)
  and the control plane behind StaticCluster, LocalCluster, RayCluster and SharedCluster
  (runtime/control/client.py) implement them; both take `run` and `launch` from RunDispatch.
- `Launcher`: the three verbs that start and stop workers (start -> addresses, replace one
  -> its address, stop). The control plane (runtime/control/client.py) owns everything else:
  clients, heartbeats, run/abort/probe, and what was shipped to each slice so a replacement
  can be brought up to date. Launchers: StaticLauncher (runtime/launchers/static.py), LocalLauncher
  (runtime/launchers/local.py), RayLauncher (runtime/launchers/ray.py), SharedLauncher
  (runtime/launchers/shared.py: workers leased from a shared cluster's manager).

Slices are numbered 0..num_slices-1. Errors: a slice that is gone (process died, hung past
the failure timeout, unreachable) surfaces as `WorkerLost` from `run`, `wait_saves` and the
per-slice verbs; an error raised while a slice walks its stream (a program that fails, a
plan that reads a missing buffer) aborts the run everywhere and surfaces as `StepFailed`
naming the slice and the instruction: it would fail again, so it is not recovered from. A
run that makes no progress for the cluster's step timeout is aborted by a watchdog and
reported as `WorkerLost` for one of the slices that did not finish. Any other error a worker
reports on a per-slice verb is re-raised as what it is.
A cluster that cannot put a new worker in a lost slice's place
raises `ReplaceUnsupported` from `replace`: the Trainer catches that one type and gives up
with the last committed checkpoint in its message (no `hasattr` probing, no capability
flag: whether a replacement exists is only known when one is asked for, e.g. a
StaticCluster whose spares ran out).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from mpmd.runtime.wire.results import StepFailed, StepResult  # noqa: F401  (StepFailed: what `run` raises)

if TYPE_CHECKING:
    import numpy as np

    from mpmd.runtime.worker.instructions import Instruction
    from mpmd.runtime.worker.programs import ProgramSpec


class WorkerLost(RuntimeError):
    """Slice `slice_index` is gone (died, hung or unreachable); the run was aborted everywhere."""

    def __init__(self, slice_index: int, address: str, why: str):
        super().__init__(f"slice {slice_index} (worker {address}) lost: {why}")
        self.slice_index = slice_index
        self.address = address


class PeerLost(WorkerLost):
    """A slice outside this cluster's view was lost (another group's, on a cluster shared by
    several clients: mpmd/groups/cluster.py) and is already being replaced by whoever owns it.
    The run was aborted here too, so this cluster's state must be restored, but none of its
    slices needs a new worker: `slice_index` is None, `peer` the slice of the whole cluster."""

    def __init__(self, peer: int, address: str, why: str):
        RuntimeError.__init__(self, f"slice {peer} of another group (worker {address}) lost: {why}")
        self.slice_index = None
        self.address = address
        self.peer = peer


class ReplaceUnsupported(RuntimeError):
    """This cluster cannot put a new worker in a lost slice's place (an in-process slice, or
    a StaticCluster with no spare address left). The message says why. `retry`: whether
    asking again soon may give one (Ray or a shared cluster out of capacity now) or not (a
    LocalCluster's max_workers spent, no spare address left): the Trainer waits up to
    replace_timeout_s only for the first."""

    def __init__(self, message: str, retry: bool = False):
        super().__init__(message)
        self.retry = retry


class ClusterGone(RuntimeError):
    """The cluster itself is gone (a shared cluster shut down by `mpmd cluster down`): no
    worker will come again, so a lost slice ends the run rather than waiting or shrinking."""


class ClusterUnavailable(RuntimeError):
    """The cluster to run on cannot be had: its address does not answer within
    connect_timeout_s, or its nodes cannot hold the workers asked for (Ray). The message is
    one line naming what and what to check; `mpmd train` prints it as its error."""


class Discarded(RuntimeError):
    """A run sent ahead was dropped, unrun or aborted, because a run before it failed; the
    error of that earlier run says what happened."""


class PendingRun:
    """A run sent to every slice and not yet collected (Cluster.launch). `result()` waits
    for it and gives what Cluster.run gives; runs are collected oldest first.

    run: its run id. futures: per slice, in slice order, what the cluster waits on: the
    gRPC future of the slice's Run RPC (ControlPlane) or the concurrent.futures.Future of
    its executor's run (InProcessCluster); both have done(), cancel() and exception().
    sent_at: time.monotonic() when it was sent (the control plane's watchdog starts there)."""

    def __init__(self, run: int, collect: Callable[[PendingRun], list[StepResult]], futures: Sequence, sent_at: float):
        self.run = run
        self.futures = list(futures)
        self.sent_at = sent_at
        self._collect = collect
        self.discarded: str | None = None  # why, once an earlier run's failure dropped it

    def result(self) -> list[StepResult]:
        if self.discarded is not None:
            raise Discarded(f"run {self.run} was discarded: {self.discarded}")
        return self._collect(self)


class InFlight:
    """The runs a cluster has launched and not yet collected, oldest first. Each new run is
    sent naming the newest of them (`after`): a slice runs it only once that one finished
    there, so runs sent ahead queue on the slices in the order they were sent."""

    def __init__(self):
        self.runs: list[PendingRun] = []

    def after(self) -> int:
        """The run id a run launched now must follow on every slice (-1: none in flight)."""
        return self.runs[-1].run if self.runs else -1

    def add(self, run: PendingRun) -> PendingRun:
        self.runs.append(run)
        return run

    def collecting(self, run: PendingRun) -> None:
        assert self.runs and self.runs[0] is run, f"run {run.run} collected out of order"

    def done(self, run: PendingRun) -> None:
        """`run` was collected: it leaves, unless a failure already dropped every run."""
        if self.runs and self.runs[0] is run:
            self.runs.remove(run)

    def drop_all(self, why: str) -> int:
        """Forget every run in flight, marking those not being collected as discarded; returns
        the newest run id, the one to abort up to (an abort covers every earlier id)."""
        newest = max((r.run for r in self.runs), default=-1)
        for r in self.runs[1:]:
            r.discarded = why
        self.runs = []
        return newest


class RunDispatch:
    """`run` and `launch` as every cluster has them (run-ahead dispatch): a run is sent to
    every slice naming the newest run in flight (`after`), kept in `_in_flight` and collected
    oldest first; `run` is `launch(...).result()`. A cluster gives `_send` (start the run on
    every slice: one future per slice, in slice order) and `_wait` (wait for those futures:
    one StepResult per slice, or raise what Cluster.run raises, after dropping every run in
    flight if it aborted them)."""

    _in_flight: InFlight

    def run(
        self,
        plan: str,
        run: int,
        feeds: Mapping[int, Mapping[str, Sequence]],
        fetch: Mapping[int, Sequence[str]],
        trace: bool = False,
    ) -> list[StepResult]:
        return self.launch(plan, run, feeds, fetch, trace).result()

    def launch(
        self,
        plan: str,
        run: int,
        feeds: Mapping[int, Mapping[str, Sequence]],
        fetch: Mapping[int, Sequence[str]],
        trace: bool = False,
    ) -> PendingRun:
        """Send run `run` to every slice (its feeds with it) and return; see Cluster.launch."""
        futures = self._send(plan, run, self._in_flight.after(), feeds, fetch, trace)
        return self._in_flight.add(PendingRun(run, self._collect, futures, time.monotonic()))

    def _collect(self, run: PendingRun) -> list[StepResult]:
        self._in_flight.collecting(run)
        try:
            return self._wait(run)
        finally:
            self._in_flight.done(run)

    def _send(
        self,
        plan: str,
        run: int,
        after: int,
        feeds: Mapping[int, Mapping[str, Sequence]],
        fetch: Mapping[int, Sequence[str]],
        trace: bool,
    ) -> list:
        raise NotImplementedError

    def _wait(self, run: PendingRun) -> list[StepResult]:
        raise NotImplementedError


@runtime_checkable
class Cluster(Protocol):
    """What the Trainer may call. Every verb but `start`, `run` and `close` addresses one
    slice; all are synchronous unless said otherwise. A cluster that must reserve the run
    directory before anything under it is touched also has `claim(num_slices, root, meshes)`
    (SharedCluster: the manager refuses a root another live job holds); recipes/run/train.py
    calls it where it exists."""

    @property
    def num_slices(self) -> int:
        """Slices attached by the last `start` (0 before it and after `close`)."""

    @property
    def devices_per_slice(self) -> int | None:
        """The devices of one slice's mesh when the cluster fixes it before `start` (Local,
        Ray: devices_per_worker x processes_per_slice), so a mesh that does not fit is refused
        before any worker starts; None when each slice takes the mesh `start` gives it
        (InProcess: a run of this process's devices) or it is known only to workers started
        elsewhere (Static, Shared: a worker refuses a mesh its devices do not fit)."""

    @property
    def generation_tag(self) -> str:
        """The current generation of the cluster's view of its workers, as a name (a new one
        at every start, replacement, shrink and grow: runtime/control/client.py,
        "Generations"); checkpoint parts are written to directories named for it."""

    def start(self, num_slices: int, root: str | None = None, meshes: Sequence | None = None) -> None:
        """Give every slice 0..num_slices-1 a fresh executor. ValueError if the cluster has
        too few workers (or devices) for that many. `root`: the directory the run saves
        checkpoints under (the Trainer passes its run_dir); a cluster that starts its own
        workers confines them to it, and ValueError if its workers already run confined to
        a root that does not hold it. Workers started elsewhere keep their own --root.
        `meshes`: per slice, the shape of its mesh ({"data", "fsdp", "tensor"} sizes, or
        mpmd.stages.sharding.SliceMesh) over all its devices; None: each slice's devices on `data`."""

    def load_programs(self, slice_index: int, specs: Mapping[str, ProgramSpec]) -> None:
        """Load (deserialize and compile) programs by name; a name loaded again is replaced."""

    def install_plan(self, slice_index: int, name: str, stream: Sequence[Instruction]) -> None:
        """Install one instruction stream under `name`, a list of instructions or an encoded
        stream (runtime/worker/streams.py: it travels as compact bytes and the worker finishes and
        expands it); ValueError if it runs a program not loaded."""

    def put(
        self, slice_index: int, name: str, arrays: Sequence, layouts: Sequence | None = None, append: bool = False
    ) -> None:
        """Store host arrays as buffer `name` on the slice's mesh, each laid out as its entry
        of `layouts` (a PartitionSpec as a tuple; default: replicated); with `append`, after
        the arrays it holds (a large buffer sent in parts, so no one message holds it all)."""

    def get(self, slice_index: int, names: Iterable[str]) -> dict[str, tuple[np.ndarray, ...]]:
        """Copy buffers back to the host; an error naming any buffer that does not exist."""

    def delete(self, slice_index: int, names: Iterable[str]) -> None:
        """Free buffers; names that do not exist are ignored."""

    def run(
        self,
        plan: str,
        run: int,
        feeds: Mapping[int, Mapping[str, Sequence]],
        fetch: Mapping[int, Sequence[str]],
        trace: bool = False,
    ) -> list[StepResult]:
        """Run plan `plan` on every slice at once, as run id `run` (ids must never repeat:
        transfer keys are prefixed with it). `feeds[slice]` are buffers to put first,
        `fetch[slice]` the buffers to bring back. One StepResult per slice, in slice order.
        An error on any slice aborts the run everywhere; WorkerLost if a slice is gone.
        The same as `launch(...).result()`."""

    def launch(
        self,
        plan: str,
        run: int,
        feeds: Mapping[int, Mapping[str, Sequence]],
        fetch: Mapping[int, Sequence[str]],
        trace: bool = False,
    ) -> PendingRun:
        """Send run `run` and return at once (run-ahead dispatch): each slice runs it after
        the runs launched before it. Collect results oldest first with `.result()`, which
        raises what `run` raises; a failure there aborts and discards every later run in
        flight too (their `.result()` raises Discarded). Other verbs do not wait for runs in
        flight: collect them first."""

    def save(self, slice_index: int, items: Mapping, digests: bool = True) -> None:
        """Start an asynchronous save (Orbax, on the slice) of {directory: [buffer names]}
        (whole bundles) or {directory: {key: [buffer, index]}} (single arrays under keys),
        each single array digested once written when `digests` (slice_store.digest)."""

    def wait_saves(self, slice_index: int, directories: Sequence[str] | None = None) -> dict[str, dict[str, str]]:
        """Block until the slice's saves of `directories` (default: all it started) are on
        disk; {directory finalized: {key: digest}}. Raises the first write error among them;
        WorkerLost if the slice is lost meanwhile."""

    def restore(
        self,
        slice_index: int,
        items: Mapping,
        staged: bool = False,
        layouts: Mapping[str, Sequence] | None = None,
        digests: Mapping[str, str] | None = None,
    ) -> None:
        """Replace buffers with those saved under {directory: [buffer names]}, or built from
        the keys of {directory: {key: [[buffer, index], ...]}} (only those keys are read);
        all or nothing.
        staged=True only reads them, held aside until finish_restore. `layouts`: {buffer:
        [layout per array]} on this slice's mesh, whatever mesh saved them (default replicated).
        `digests` ({key: digest} recorded at the save): a key read back otherwise raises
        slice_store.Damaged, naming the part and the key."""

    def finish_restore(self, slice_index: int, commit: bool) -> None:
        """Bind what a staged restore read (commit=True) or drop it: every slice switches
        only once all have read their part."""

    def replace(self, slice_index: int, wait_s: float | None = None) -> None:
        """Put a new worker in place of lost slice `slice_index`, with the programs and plans
        the old one had and every slice's transfers reconnected. Buffers are NOT restored:
        the caller restores state from a checkpoint. ReplaceUnsupported if impossible.
        `wait_s`: at most how long to wait for capacity (Launcher.replace; the Trainer passes
        what is left of replace_timeout_s, 0 while the run is narrow)."""

    def remove(self, slice_index: int, meshes: Sequence | None = None) -> None:
        """Go on without lost slice `slice_index` (no replacement for it): slices after it
        move down one index, and every remaining slice starts afresh, as after `start`, with
        `meshes` (one per remaining slice; None: as before): no programs, plans or buffers,
        the caller re-ships and restores. The workers of the survivors stay the same."""

    def add(self, meshes: Sequence | None = None, before_reset: Callable[[], None] | None = None) -> None:
        """Undo a `remove` once capacity is back: a new worker becomes the last slice, and
        every slice starts afresh as after `start` (`meshes` one per slice). ReplaceUnsupported
        (nothing changed) if no worker can be had now, or nothing was removed.
        `before_reset` is called once the new worker answers and before any slice is reset
        (the Trainer lets its saves in flight commit there); what it raises propagates, and
        the new worker is left out (its slot stays free). Never waits for capacity: a launcher
        that has none now says so at once (ReplaceUnsupported)."""

    def close(self) -> None:
        """Stop the workers this cluster started (or shut down/reset those it attached to)."""


@runtime_checkable
class Launcher(Protocol):
    """Starts and stops the worker processes a control plane talks to. Addresses are gRPC
    `host:port` strings of workers that hold the control plane's token; a slot served by a
    gang (runtime/worker/gang.py) has a tuple of them, one per process, process 0 first."""

    addresses: list
    """Every worker (or gang) this launcher knows, by slot (spares included)."""

    readmits: bool
    """Whether a lost worker of its slots may come back to serve again (workers started
    elsewhere: a partition healed, a pause ended, the operator restarted it at the same
    address): then, with no other worker to hand out, the control plane takes the lost one
    back once it answers, in a new generation. False where the launcher stops lost workers
    itself (local, Ray) or leases replacements (a shared cluster)."""

    def start(self, num_slices: int, root: str | None = None) -> list[str]:
        """Make sure at least `num_slices` workers are up and return all their addresses: the
        first `num_slices` serve slices, the rest are idle spares. ValueError (before starting
        anything) if it cannot have that many. Called again on a started launcher, it
        returns the running workers. On failure it stops what it started, then raises.
        `root` as in Cluster.start (see mpmd.runtime.launchers.workers.worker_root)."""

    def replace(self, slot: int, wait_s: float | None = None) -> str:
        """The address of a worker to take over slot `slot`, whose worker was lost (the old
        one must not come back and act on stale state: the control plane fences it out by
        generation, runtime/control/client.py). ReplaceUnsupported if there is none.
        `wait_s`: how long a launcher whose capacity may free up (Ray) waits for it; 0 only
        looks (a grow-back probe), None is the launcher's own start timeout. Launchers that
        start or hand out a worker at once (local, static, shared) have nothing to wait for."""

    def serves(self, slot: int, slice_index: int) -> None:
        """The worker in `slot` now serves slice `slice_index` (a hot spare promoted). A
        launcher that places workers by slice moves it there (LocalLauncher: the slice's
        cores); the others have nothing to do."""

    def stop(self) -> None:
        """Stop every worker this launcher started (after the control plane's Shutdown RPC)."""
