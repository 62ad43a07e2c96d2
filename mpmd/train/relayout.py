"""The Trainer's recovery policy: what a lost slice leads to, the moves between layouts when
slices come and go, and what they cost.

A lost slice (Recovery.on_loss). "replace" puts a new worker in its place (waiting up to
replace_timeout_s; none: RuntimeError naming the slice and the last commit); "shrink" goes on
without it: the same stages and microbatches on the survivors, in the layout mpmd/train/elastic.py
prices fastest among those that fit slice_memory_bytes; "auto" (default) replaces if a
worker comes in time, else shrinks. Either way every slice is then restored from the newest
saved state (the in-memory snapshot when one survives, else the last committed checkpoint,
else the initial state) and `lost` raises Rewound, which says where to resume. A slice
lost while recovering is handled alike; each recovery counts against max_restarts.

A shrunk run asks for a worker again at each checkpoint boundary and, once one comes, moves
back to the configured layout from that checkpoint (`grow_back`). Each move is logged in one
line and kept in `changes`; `goodput()` adds up the time lost to failures and the time run
at reduced width.

The policy is the dispatcher's StepEvents (mpmd/train/dispatch.py): it hears of every step
collected (the goodput books; at a checkpoint step the save, and a try to grow back), lost
(`lost`: recover) or not finite (`nonfinite`: stop or rewind). The layout in force is the
Trainer's Programs' (mpmd/train/programs.py): a move resizes the cluster, then tells the
programs and the checkpoint coordinator (mpmd/train/checkpointer.py); the step count is the
dispatcher's, rewound after a restore.
"""

from __future__ import annotations

import collections
import logging
import time

from mpmd.runtime.control.cluster import ClusterGone, ReplaceUnsupported, WorkerLost
from mpmd.schedules import core as schedules
from mpmd.stages import costs as stage_costs
from mpmd.stages import sharding
from mpmd.train import elastic
from mpmd.train.checkpoints import NonFinite, Rewound
from mpmd.train.options import Recovery

log = logging.getLogger("mpmd")

REPLACE_POLL_S = 1.0  # how often a replacement is asked for again within replace_timeout_s
LOST_CAUSES = ("aborted_s", "replace_s", "capacity_s", "relayout_s", "restore_s", "replayed_s")  # goodput's lost_s


def layout_record(schedule: schedules.Schedule, meshes) -> dict:
    """How a run is laid out (checkpoints.LAYOUT_KEYS), as its checkpoints record it: free to
    differ on resume, and logged when it does."""
    return {
        "num_stages": schedule.num_stages,
        "num_slices": schedule.num_slices,
        "schedule": schedule.name,
        "virtual_stages": schedule.virtual_stages,
        "placement": list(schedule.placement),
        "mesh": [sharding.describe(m) for m in meshes],
    }


class RecoveryPolicy:
    """Recovery and relayout of a Trainer's run (see the module docstring), as `options`
    says: `cluster` and its slices, `programs` (the layout in force), `checkpointer` (both
    checkpoint tiers), `steps` (the dispatcher: step_count, attempted, in_flight, rewind);
    `configured`: the (schedule, meshes) asked for, which a grow back returns to."""

    def __init__(self, options: Recovery, cluster, programs, checkpointer, steps, configured: tuple):
        self.options = options
        self._cluster, self._programs, self._checkpointer, self._steps = cluster, programs, checkpointer, steps
        self.configured = configured
        self.restarts = 0  # recoveries so far
        self._restart_times: collections.deque = collections.deque()  # when recoveries ended (monotonic s)
        self.recovery_s: dict = {}  # how the last recovery went (Trainer.recovery_s)
        self.changes: list[dict] = []  # one record per move, oldest first
        self._estimates = None  # (stage costs, per-stage bytes) for pricing layouts
        self._lost = {
            "failures": 0,
            "aborted_s": 0.0,
            "replace_s": 0.0,
            "capacity_s": 0.0,
            "relayout_s": 0.0,
            "restore_s": 0.0,
            "replayed_s": 0.0,
            "replayed_steps": 0,
        }
        self._replay_until = 0  # steps up to this one are replays of lost work
        self._narrow_s = 0.0  # time run on fewer slices than configured, finished spans
        self._narrow_since: float | None = None
        self._grown = False  # the next step is the first after a grow back
        self._rewound_nonfinite: set[int] = set()  # steps rewound over after a non-finite loss

    @property
    def narrow(self) -> bool:
        """The run is on fewer slices than configured."""
        return self._programs.num_slices < self.configured[0].num_slices

    # -- recovery ------------------------------------------------------------------------------
    def _recent_restarts(self) -> int:
        """Recoveries that ended within the last restart_window_s seconds (all of them when None):
        an older one no longer counts against max_restarts."""
        now, window = time.monotonic(), self.options.restart_window_s
        while window is not None and self._restart_times and now - self._restart_times[0] > window:
            self._restart_times.popleft()
        return len(self._restart_times)

    def lost(self, lost: WorkerLost, failed_since: float):
        """Replace the lost slice, or go on without it (on_loss), restore every slice from the
        newest state saved, rewind the step count and raise Rewound. `failed_since`: when the
        attempt that failed started (perf_counter)."""
        t0 = time.perf_counter()
        self._lost["failures"] += 1
        self._lost["aborted_s"] += t0 - failed_since
        replace_s = relayout_s = 0.0
        moved = []  # the layouts moved to (a slice may go while moving)
        while True:
            self.restarts += 1
            self._checkpointer.settle(lost)  # a save in flight commits (or fails) first, if it matters
            last = self._checkpointer.latest()
            committed = f"last committed checkpoint: {'step ' + str(last) if last is not None else 'none'}"
            recent = self._recent_restarts()
            if recent >= self.options.max_restarts:
                window = self.options.restart_window_s
                within = "in the whole run" if window is None else f"within {window:g} s"
                raise RuntimeError(
                    f"{lost}; giving up after {recent} recoveries {within} "
                    f"(max_restarts={self.options.max_restarts}, restart_window_s={window}); "
                    f"{committed}"
                ) from lost
            try:
                t1 = time.perf_counter()
                try:  # a peer's loss (another group's slice) leaves every slice here in place
                    replaced = lost.slice_index is None or self._replace(lost, committed)
                finally:
                    replace_s += time.perf_counter() - t1
                if not replaced:
                    self._checkpointer.wait()  # a relayout moves no save in flight
                    t1 = time.perf_counter()
                    try:
                        moved.append(self._shrink(lost, committed))
                    finally:
                        relayout_s += time.perf_counter() - t1
                t_restore = time.perf_counter()
                tier, step, data_state = self._restore_newest()
                break
            except WorkerLost as again:  # another slice went while replacing or restoring
                lost = again
                self._lost["failures"] += 1  # a worker lost of its own, for goodput
            finally:
                self._restart_times.append(time.monotonic())
        attempted = self._steps.attempted
        replayed = attempted - step
        self._replays(attempted)
        self._steps.rewind(step)
        moved = [self._event(m["why"], m["slowdown"]) for m in moved]  # now that `step` is known
        restore_s = time.perf_counter() - t_restore
        # A replacement waited for in vain is time lost to missing capacity, not to replacing.
        for key, value in (
            ("replace_s" if replaced else "capacity_s", replace_s),
            ("relayout_s", relayout_s),
            ("restore_s", restore_s),
        ):
            self._lost[key] += value
        self._lost["replayed_steps"] += replayed
        self.recovery_s = {
            "replace_s": replace_s,
            "relayout_s": relayout_s,
            "restore_s": restore_s,
            "total_s": time.perf_counter() - t0,
            "tier": tier,
            "replayed": replayed,
            "layout": moved[-1] if moved else None,
        }
        how = "replaced" if replaced else f"not replaced, continuing on {self._programs.num_slices} slice(s)"
        raise Rewound(step, data_state, f"recovered from {lost}; {how}", tier, replayed)

    def rewind(self, step: int, metrics: dict) -> None:
        """After step `step` was not finite (Recovery.on_nonfinite="rewind"): put every slice
        back at the last committed step (not the in-memory tier: its snapshots are taken
        before their step's loss is known) and raise Rewound; NonFinite when `step` was
        rewound over once already (the same data and state give the same NaN again)."""
        self._checkpointer.wait()
        if step in self._rewound_nonfinite:
            raise NonFinite(
                step,
                metrics,
                self._checkpointer.latest(),
                " again after a rewind (on_nonfinite=rewind rewinds a step once)",
            )
        self._rewound_nonfinite.add(step)
        t0 = time.perf_counter()
        tier, restored, data_state = self._restore_newest(memory=False)
        self._lost["restore_s"] += time.perf_counter() - t0
        replayed = self._steps.attempted - restored
        self._steps.rewind(restored)
        raise Rewound(
            restored,
            data_state,
            f"step {step} had a non-finite loss or gradient norm (on_nonfinite=rewind)",
            tier,
            replayed,
        )

    def _restore_newest(self, memory: bool = True) -> tuple[str, int, object]:
        """(tier, step, data_state) after putting every slice back at the newest saved state
        (Checkpointer.restore_newest), or the initial state when nothing was saved."""
        tier, step, data_state = self._checkpointer.restore_newest(memory)
        if tier == "initial":
            self._programs.reset_state()
        elif tier == "persistent":
            self._programs.state_restored()
        if tier != "memory" and self._programs.opt_state_ready:
            self._checkpointer.snapshot_now(step, data_state)  # the replacement holds a copy again
        return tier, step, data_state

    # -- bookkeeping -------------------------------------------------------------------------
    def _replays(self, until: int) -> None:
        """Steps up to `until` are replays of lost work."""
        self._replay_until = max(self._replay_until, until)

    def collected(self, step: int, step_s: float, data_state, save: bool, retry: bool) -> None:
        """Step `step` was collected after `step_s`: a replay is lost time, and so is the first
        step after a grow back (it compiled the programs on every slice: part of the move). At
        a checkpoint step (`save`), its save (waited for when it is a failed save's `retry`)
        and, on fewer slices than configured, a try to grow back."""
        if step <= self._replay_until:
            self._lost["replayed_s"] += step_s
        elif self._grown:
            self._lost["relayout_s"] += step_s
        self._grown = False
        if save:
            self.save(step, data_state, wait=retry)
            if self.narrow:
                self.grow_back(data_state)

    def save(self, step: int, data_state, extra: dict | None = None, wait: bool = False) -> None:
        """Checkpoint the (finite) state after `step` (Checkpointer.save); a slice lost while
        saving is recovered from (Rewound)."""
        try:
            self._checkpointer.save(step, data_state, {**(extra or {}), "finite": True}, wait=wait)
        except WorkerLost as e:
            self.lost(e, time.perf_counter())

    def nonfinite(self, step: int, metrics: dict):
        """After a step whose loss or gradient norm is not finite (never saved): Rewound after
        a rewind (on_nonfinite="rewind"), else NonFinite, once the saves before it landed."""
        if self.options.on_nonfinite == "rewind":
            self.rewind(step, metrics)
        self._checkpointer.wait()  # the saves before it land: they are what is kept
        raise NonFinite(step, metrics, self._checkpointer.latest())

    def goodput(self) -> dict:
        """Time lost to failures and run at reduced width, so far, in seconds: "failures";
        "aborted_s" (the failed attempts, from their start until the loss was declared:
        detection included); "replace_s" (getting replacements); "capacity_s" (waiting for
        capacity that did not come: a replacement waited for in vain, and the checkpoint
        boundaries' probes for a worker to grow back on that found none);
        "relayout_s" (choosing and setting up a layout on fewer or more slices, and after a
        grow back the first step, which compiles the programs on every slice: one step's
        useful work is counted in it); "restore_s";
        "replayed_s" and "replayed_steps" (recomputing the steps the restore rewound);
        "lost_s" (their sum); "reduced_width_s" (time on fewer slices than configured);
        "layout_changes"."""
        out = dict(self._lost)
        out["lost_s"] = sum(out[k] for k in LOST_CAUSES)
        narrow = self._narrow_s + (time.perf_counter() - self._narrow_since if self._narrow_since is not None else 0.0)
        out["reduced_width_s"] = narrow
        out["layout_changes"] = len(self.changes)
        return out

    def _event(self, why: str, slowdown: float) -> dict:
        """Record and log (one line) the layout the run just moved to."""
        step, schedule = self._steps.step_count, self._programs.schedule
        event = {
            "step": step,
            "num_slices": schedule.num_slices,
            "schedule": schedule.name,
            "placement": list(schedule.placement),
            "predicted_slowdown": round(slowdown, 4),
            "why": why,
        }
        self.changes.append(event)
        log.warning(
            "layout after step %d: %s (%s); predicted step time x%.2f of the configured %d slice(s)",
            step,
            elastic.describe(schedule),
            why,
            slowdown,
            self.configured[0].num_slices,
        )
        return event

    # -- moves ---------------------------------------------------------------------------------
    def _replace(self, lost: WorkerLost, committed: str) -> bool:
        """Put a new worker in the lost slice's place if on_loss allows and one comes within
        replace_timeout_s; False when the run is to go on without it instead. With
        on_loss='replace' and no worker, RuntimeError naming the slice and the last commit."""
        on_loss, timeout_s = self.options.on_loss, float(self.options.replace_timeout_s)
        if on_loss == "shrink":
            return False
        # Waiting helps only where capacity may come (Ray, a shared cluster): not where none
        # can (max_workers spent, no spare left), nor while the run is already short of a
        # slice it found no worker for, so a second loss then shrinks again at once.
        t0 = time.monotonic()
        deadline, wait = t0 + timeout_s, not self.narrow
        while True:
            try:
                # What is left of replace_timeout_s bounds the cluster's own wait for capacity
                # (Ray); a narrow run only looks.
                self._cluster.replace(lost.slice_index, wait_s=max(deadline - time.monotonic(), 0.0) if wait else 0.0)
                return True
            except ClusterGone as e:
                raise ClusterGone(f"{e}; {committed}") from lost
            except ReplaceUnsupported as e:
                why = e
            finally:
                self._checkpointer.replaced(lost.slice_index)
            left = deadline - time.monotonic()
            if left <= 0 or not (wait and why.retry):
                break
            time.sleep(min(REPLACE_POLL_S, left))
        if on_loss == "replace":
            raise RuntimeError(
                f"{lost}; cannot replace it (on_loss='replace', waited {time.monotonic() - t0:.0f} s "
                f"of replace_timeout_s={timeout_s:g}): {why}; {committed}"
            ) from lost
        log.warning("slice %d not replaced: %s", lost.slice_index, why)
        return False

    def _shrink(self, lost: WorkerLost, committed: str) -> dict:
        """Go on without the lost slice: the same stages on the survivors, in the layout the
        simulator predicts fastest among those that fit slice_memory_bytes (mpmd/train/elastic.py).
        RuntimeError, with the state committed, when none fits or no slice is left. Returns
        {"why", "slowdown"} for the event, recorded once the step restored to is known."""
        programs = self._programs
        n = programs.num_slices - 1
        if n < 1:
            raise RuntimeError(f"{lost}; not replaced and no other slice to continue on; {committed}") from lost
        costs, per_stage = self._stage_estimates()
        try:
            chosen = elastic.choose(
                programs.pipeline.num_stages,
                programs.schedule.num_microbatches,
                n,
                costs,
                per_stage,
                self.options.slice_memory_bytes,
            )
        except elastic.NoFit as e:
            raise RuntimeError(f"{lost}; not replaced, and {e}; stopped, {committed}") from lost
        meshes = [m for r, m in enumerate(programs.layout.meshes) if r != lost.slice_index]
        self._move(chosen.schedule, meshes, lambda ms: self._cluster.remove(lost.slice_index, ms))
        return {
            "why": f"slice {lost.slice_index} lost, not replaced",
            "slowdown": elastic.predicted_slowdown(chosen, self.configured[0], costs),
        }

    def grow_back(self, data_state) -> None:
        """At a checkpoint boundary of a run on fewer slices than configured: if a worker can
        be had again, let that checkpoint commit, move back to the configured layout and
        restore it (no step is lost). Nothing happens when no worker comes (ReplaceUnsupported)
        or the checkpoint did not commit: tried again at the next boundary. The commit is
        waited for only once a worker is at hand, so a run without capacity never waits."""
        assert not self._steps.in_flight, "a checkpoint step is never run ahead of"
        t0 = time.perf_counter()
        schedule, meshes = self.configured
        step_now = self._steps.step_count

        def committed():  # before any slice is reset: their saves in flight must land
            self._checkpointer.wait()
            if self._checkpointer.latest() != step_now:
                raise ReplaceUnsupported(
                    f"the checkpoint of step {step_now} did not commit; growing back at the next one"
                )

        try:
            self._move(schedule, meshes, lambda ms: self._cluster.add(ms, before_reset=committed))
            step, manifest = self._checkpointer.restore_committed()
        except ReplaceUnsupported as e:
            self._lost["capacity_s"] += time.perf_counter() - t0
            log.info("still on %d slice(s): %s", self._programs.num_slices, e)
            return
        except WorkerLost as e:
            self.lost(e, t0)
        self._programs.state_restored()
        if step != step_now:  # the newest commit did not restore: an older one did
            self._replays(step_now)
            self._steps.rewind(step)
            raise Rewound(
                step,
                manifest.get("data_state"),
                f"moved back to {schedule.num_slices} slice(s), but the checkpoint of step {step_now} did not restore",
                "persistent",
                self._replay_until - step,
            )
        self._checkpointer.snapshot_now(step, data_state)
        self._lost["relayout_s"] += time.perf_counter() - t0
        self._grown = True
        self._event("capacity back", 1.0)

    def _move(self, schedule: schedules.Schedule, meshes, resize) -> None:
        """Move to `schedule` (the same stages and microbatches) on slices of `meshes`:
        `resize(meshes)` changes the cluster (every slice starts afresh), then what was
        shipped is forgotten; the caller restores the state. ReplaceUnsupported from resize
        changes nothing."""
        layout = self._programs.layout_for(schedule, meshes)
        try:
            resize(meshes)
        finally:
            if self._cluster.num_slices == schedule.num_slices:  # resized, even if a slice went right after
                self._programs.move_to(schedule, layout)
                now, narrow = time.perf_counter(), self.narrow
                if narrow and self._narrow_since is None:
                    self._narrow_since = now
                elif not narrow and self._narrow_since is not None:
                    self._narrow_s += now - self._narrow_since
                    self._narrow_since = None
                self._checkpointer.relayout(schedule.placement, layout, layout_record(schedule, meshes))

    def _stage_estimates(self) -> tuple[list[float], list[dict] | None]:
        """(each stage's forward cost, per-stage bytes or None) for pricing layouts: XLA's
        cost analysis of a training microbatch (unit costs before any step was compiled);
        bytes only when slice_memory_bytes asks for them."""
        if self._estimates is None:
            p, feeds = self._programs, self._programs.train_specs
            if feeds is None:
                self._estimates = ([1.0] * p.pipeline.num_stages, None)
            else:
                # Each stage on its configured slice's mesh (what fsdp holds whole counted there).
                per_stage = (
                    stage_costs.memory(
                        p.pipeline,
                        p.optimizer,
                        feeds.inputs,
                        feeds.targets,
                        feeds,
                        layout=p.layout,
                        placement=p.placement,
                    )
                    if self.options.slice_memory_bytes is not None
                    else None
                )
                self._estimates = (stage_costs.fn_costs(p.pipeline.fns, feeds.inputs, feeds.side), per_stage)
        return self._estimates
