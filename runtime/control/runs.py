"""How the control plane waits for a run on gRPC workers, and aborts it: RunWatch.

No step waits forever. The first error reply from any slice aborts the step everywhere at
once; one that is not the echo of a lost slice is raised as StepFailed (slice, instruction,
the worker's message). A slice is lost when an RPC to it fails for transport reasons
(process gone: UNAVAILABLE at once) or when it has not answered a heartbeat for the control
plane's `failure_timeout_s` (hung, stopped, cut off): the run is then cancelled everywhere
and WorkerLost names the slice. A live worker whose heartbeats are answered can still be
stuck (a receive whose sender never sends, a program that never returns): each heartbeat
reply carries the slice's position in its stream (run id, instructions done, what it is
doing), and a step in which no slice moves and none finishes for `step_timeout_s` is aborted
by a watchdog and reported as WorkerLost for an unfinished slice, preferring one that is not
merely waiting for a peer, so the Trainer replaces it, restores and replays.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import TYPE_CHECKING

import grpc

from mpmd.runtime.wire import format as wire
from mpmd.runtime.wire import verbs
from mpmd.runtime.control.cluster import InFlight, PendingRun, StepFailed, WorkerLost
from mpmd.runtime.control.rpc import GONE, WorkerClient, WorkerError, receive, send
from mpmd.runtime.wire.results import Aborted, Event, StepResult
from mpmd.runtime.worker.service import FAILED_AT_KEY

if TYPE_CHECKING:
    from mpmd.runtime.control.client import ControlPlane

# The watchdog's timeout when step_timeout_s is None: max(MIN_STEP_TIMEOUT_S, STEP_TIMEOUT_FACTOR
# x the median of the last completed steps' times). Before any step has completed, the first
# runs compile their programs (seconds to minutes), hence FIRST_STEP_TIMEOUT_S.
MIN_STEP_TIMEOUT_S = 60.0
STEP_TIMEOUT_FACTOR = 20
FIRST_STEP_TIMEOUT_S = 300.0


class RunWatch:
    """Waits for the runs of `plane` (its clients, its `lost_slice()` from heartbeats, its
    failure_timeout_s), with the watchdog's clock and the recent step times it derives its
    timeout from. step_timeout_s: see ControlPlane."""

    def __init__(self, plane: ControlPlane, step_timeout_s: float | None):
        if step_timeout_s is not None and not (isinstance(step_timeout_s, (int, float)) and step_timeout_s > 0):
            raise ValueError(
                f"step_timeout_s must be positive or None (derived from step times), got {step_timeout_s!r}"
            )
        self._plane = plane
        self.step_timeout_s = step_timeout_s
        self.step_times: collections.deque = collections.deque(maxlen=20)
        self._collected_at = 0.0  # monotonic time the last run was collected

    def step_timeout(self) -> float:
        """The watchdog's timeout for the next step, in seconds."""
        if self.step_timeout_s is not None:
            return self.step_timeout_s
        if not self.step_times:
            return FIRST_STEP_TIMEOUT_S
        return max(MIN_STEP_TIMEOUT_S, STEP_TIMEOUT_FACTOR * statistics.median(self.step_times))

    def wait(self, run: PendingRun, in_flight: InFlight) -> list[StepResult]:
        """One StepResult per slice once `run` is done everywhere; else abort every run in
        flight (`in_flight` drops them) and raise WorkerLost or StepFailed."""
        try:
            return self._wait(run, in_flight)
        finally:
            self._collected_at = time.monotonic()

    def _wait(self, run: PendingRun, in_flight: InFlight) -> list[StepResult]:
        # A run sent ahead starts on the slices once the one before it is done: its clock
        # (watchdog, step times) starts when that one was collected, or when it was sent.
        clients = self._plane.clients
        run_id, futs = run.run, run.futures
        t0 = max(run.sent_at, self._collected_at)
        timeout_s = self.step_timeout()
        # Wake on every completion (a sleep-poll here cost ~5 ms per step), and at least every
        # 50 ms to look for a silent slice or a stalled step. `failed` keeps the order in
        # which slices failed: the first is the root cause, later ones may be its echoes.
        changed = threading.Event()
        failed: list[int] = []
        last_done = [t0]

        def done(i, f):
            last_done[0] = time.monotonic()
            if not f.cancelled() and f.exception() is not None:
                failed.append(i)
            changed.set()

        for i, f in enumerate(futs):
            f.add_done_callback(lambda f, i=i: done(i, f))
        lost = stalled = None
        while lost is None and stalled is None and not failed and not all(f.done() for f in futs):
            changed.wait(0.05)
            changed.clear()
            lost = self._plane.lost_slice() or _gone(futs)
            stalled = self._stalled(run_id, futs, max(last_done[0], t0), timeout_s)
        lost = lost or self._plane.lost_slice() or _gone(futs)
        if lost is None and stalled is None and not failed:
            self.step_times.append(time.monotonic() - t0)
            return [_step_result(c, f) for c, f in zip(clients, futs)]
        # Every run in flight goes: this one, and those sent ahead of it (never run, or
        # aborted where they started). Aborting the newest id aborts every earlier one.
        later = [r.futures for r in in_flight.runs if r is not run]
        newest = in_flight.drop_all(f"run {run_id} before it failed")
        if lost is None and stalled is not None:
            # The stalled slice is alive (it answers heartbeats): abort it too, wait not for it.
            self._abort_all(newest, [futs] + later, stalled[0], abort_lost=True)
            raise WorkerLost(stalled[0], clients[stalled[0]].address, stalled[1])
        self._abort_all(newest, [futs] + later, lost[0] if lost else None)
        # A survivor's error may be only the echo of a peer's death (its transfer broke):
        # ask everyone before blaming the slice that reported first.
        lost = lost or self._probe()
        if lost is not None:
            raise WorkerLost(lost[0], clients[lost[0]].address, lost[1])
        order = failed + [
            i
            for i, f in enumerate(futs)
            if f.done() and not f.cancelled() and f.exception() is not None and i not in failed
        ]
        root = [i for i in order if futs[i].exception().code() != grpc.StatusCode.ABORTED] or order
        raise self._step_failed(root[0], futs[root[0]].exception())

    def _stalled(self, run: int, futs, last_done: float, timeout_s: float) -> tuple[int, str] | None:
        """(slice, why) to blame if no slice has finished or advanced in run `run` for
        timeout_s; the blamed one is unfinished and, if any is, not waiting for a peer."""
        clients = self._plane.clients
        now = time.monotonic()
        moved = [c.progress_at for c in clients if c.progress is not None and c.progress.run == run]
        if now - max([last_done] + moved) <= timeout_s:
            return None
        unfinished = [i for i, f in enumerate(futs) if not f.done()]
        where = {i: clients[i].progress for i in unfinished}
        busy = [i for i in unfinished if where[i] is None or where[i].run != run or where[i].doing != "recv"]
        blame = (busy or unfinished)[0]
        at = {
            i: (f"instruction {p.done} ({p.doing})" if p is not None and p.run == run else "not started")
            for i, p in where.items()
        }
        return blame, (
            f"run {run} made no progress for {now - max([last_done] + moved):.1f} s "
            f"(step_timeout_s={timeout_s:g}); unfinished slices: " + ", ".join(f"{i} at {a}" for i, a in at.items())
        )

    def _step_failed(self, slice_index: int, e: grpc.RpcError) -> Exception:
        """The error a failed Run reply stands for: StepFailed naming slice and instruction."""
        trailing = dict(e.trailing_metadata() or ())
        at = trailing.get(FAILED_AT_KEY)
        at = at.decode(errors="replace") if isinstance(at, bytes) else "Run"
        address = self._plane.clients[slice_index].address
        return StepFailed(slice_index, at, f"{e.code().name} from worker {address}: {e.details()}")

    def _probe(self) -> tuple[int, str] | None:
        futs = [
            send(c, verbs.Empty(), timeout_s=min(2.0, self._plane.failure_timeout_s), verb="Heartbeat")
            for c in self._plane.clients
        ]
        for f in futs:
            f.exception()  # wait
        return _gone(futs)

    def _abort_all(self, run: int, runs=(), lost: int | None = None, abort_lost: bool = False) -> None:
        """Abort run `run` (and every earlier one) everywhere; `runs`: the per-slice Run
        futures of each run in flight. The lost slice, if known, is not waited for: it is hung
        or gone, and its Run is simply cancelled (it is sent the Abort too if `abort_lost`)."""
        clients = self._plane.clients
        live = [i for i in range(len(clients)) if i != lost or abort_lost]
        aborts = [(clients[i], send(clients[i], verbs.Abort(run), timeout_s=2.0)) for i in live]
        for c, f in aborts:
            try:
                receive(c, "Abort", f)
            except (WorkerError, Aborted):
                pass
        # Survivors answer ABORTED promptly once aborted.
        deadline = time.monotonic() + 2.0
        for futs in runs:
            for i, f in enumerate(futs):
                while i != lost and not f.done() and time.monotonic() < deadline:
                    time.sleep(0.01)
                f.cancel()


def _gone(futs) -> tuple[int, str] | None:
    for i, f in enumerate(futs):
        e = f.exception() if f.done() and not f.cancelled() else None
        if isinstance(e, grpc.RpcError) and e.code() in GONE:
            return i, f"{e.code().name}: {e.details()}"
    return None


def _step_result(c: WorkerClient, fut) -> StepResult:
    reply, blobs = receive(c, "Run", fut)
    fetched = {n: tuple(wire.blob(blobs, r) for r in refs) for n, refs in reply.fetched.items()}
    return StepResult(
        fetched,
        tuple(Event(*e) for e in reply.events),
        reply.wall_s,
        reply.peak_held,
        reply.peak_held_bytes,
        reply.peak_bytes,
        reply.compiles,
        reply.compiled,
        reply.cache_loads,
    )
