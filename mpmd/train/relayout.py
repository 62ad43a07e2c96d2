"""A running Trainer's moves between layouts when slices come and go, and what they cost.

A lost slice (on_loss). "replace" puts a new worker in its place (waiting up to
replace_timeout_s; none: RuntimeError naming the slice and the last commit); "shrink" goes on
without it: the same stages and microbatches on the survivors, in the layout mpmd/train/elastic.py
prices fastest among those that fit slice_memory_bytes, restored from the last commit;
"auto" (default) replaces if a worker comes in time, else shrinks. A shrunk run asks for a
worker again at each checkpoint boundary and, once one comes, moves back to the configured
layout from that checkpoint. Each move is logged in one line and kept in `changes`;
`goodput()` adds up the time lost to failures and the time run at reduced width.

The Trainer owns one Relayout. The layout in force (schedule, placement, slices, the
programs shipped for it) stays on the Trainer, which every step reads; a move changes it
there, and the Trainer's recovery (restore, Rewound) stays with the Trainer too: this object
decides and performs the moves and keeps the books.
"""
from __future__ import annotations

import logging
import math
import time

from mpmd.train import elastic
from mpmd.lowering import core as lowering
from mpmd.schedules import core as schedules
from mpmd.stages import sharding
from mpmd.train import snapshots
from mpmd.stages import costs as stage_costs
from mpmd.train.checkpoints import Rewound
from mpmd.runtime.control.cluster import ReplaceUnsupported, WorkerLost

log = logging.getLogger("mpmd")

# What the Trainer does when a slice is lost (on_loss): "replace" it (or stop), "shrink" onto
# the survivors, or "auto": a replacement if one comes within replace_timeout_s, else shrink.
ON_LOSS = ("replace", "shrink", "auto")
REPLACE_POLL_S = 1.0     # how often a replacement is asked for again within replace_timeout_s


def check_args(on_loss, replace_timeout_s, slice_memory_bytes) -> None:
    """ValueError naming the argument, for what a user passes the Trainer."""
    if on_loss not in ON_LOSS:
        raise ValueError(f"on_loss must be one of {', '.join(map(repr, ON_LOSS))} (what to do when a slice "
                         f"is lost: replace it, continue on the survivors, or replace if a worker "
                         f"comes within replace_timeout_s and else continue on the survivors), got {on_loss!r}")
    if (not isinstance(replace_timeout_s, (int, float)) or isinstance(replace_timeout_s, bool)
            or not 0 <= replace_timeout_s < math.inf):
        raise ValueError(f"replace_timeout_s must be a finite number of seconds >= 0 (how long a "
                         f"replacement is waited for; 0: one try), got {replace_timeout_s!r}")
    if slice_memory_bytes is not None and (not isinstance(slice_memory_bytes, int)
                                           or isinstance(slice_memory_bytes, bool) or slice_memory_bytes < 1):
        raise ValueError(f"slice_memory_bytes must be a positive integer (the bytes a layout on fewer "
                         f"slices may use on one slice) or None (not checked), got {slice_memory_bytes!r}")


def layout_record(schedule: schedules.Schedule, meshes) -> dict:
    """How a run is laid out (checkpoints.LAYOUT_KEYS), as its checkpoints record it: free to
    differ on resume, and logged when it does."""
    return {"num_stages": schedule.num_stages, "num_slices": schedule.num_slices, "schedule": schedule.name,
            "virtual_stages": schedule.virtual_stages, "placement": list(schedule.placement),
            "mesh": [sharding.describe(m) for m in meshes]}


class Relayout:
    """The moves of `trainer` (see the module docstring); `configured`: the (schedule,
    meshes) asked for, which a grow back returns to. The arguments are checked
    (check_args) by the Trainer before anything else."""

    def __init__(self, trainer, on_loss: str, replace_timeout_s: float, slice_memory_bytes: int | None,
                 configured: tuple):
        self._trainer = trainer
        self.on_loss, self.replace_timeout_s = on_loss, float(replace_timeout_s)
        self.slice_memory_bytes = slice_memory_bytes
        self.configured = configured
        self.changes: list[dict] = []      # one record per move, oldest first
        self._estimates = None             # (stage costs, per-stage bytes) for pricing layouts
        self._lost = {"failures": 0, "aborted_s": 0.0, "replace_s": 0.0, "relayout_s": 0.0, "restore_s": 0.0,
                      "replayed_s": 0.0, "replayed_steps": 0}
        self.replay_until = 0              # steps up to this one are replays of lost work
        self._narrow_s = 0.0               # time run on fewer slices than configured, finished spans
        self._narrow_since: float | None = None
        self._grown = False                # the next step is the first after a grow back

    @property
    def narrow(self) -> bool:
        """The run is on fewer slices than configured."""
        return self._trainer.num_slices < self.configured[0].num_slices

    # -- bookkeeping -------------------------------------------------------------------------
    def failed(self, aborted_s: float) -> None:
        """A slice was lost; the failed attempt ran `aborted_s` until the loss was declared."""
        self._lost["failures"] += 1
        self._lost["aborted_s"] += aborted_s

    def replays(self, until: int) -> None:
        """Steps up to `until` are replays of lost work."""
        self.replay_until = max(self.replay_until, until)

    def recovered(self, replace_s: float, relayout_s: float, restore_s: float, replayed: int) -> None:
        for key, value in (("replace_s", replace_s), ("relayout_s", relayout_s), ("restore_s", restore_s)):
            self._lost[key] += value
        self._lost["replayed_steps"] += replayed

    def collected(self, step: int, step_s: float) -> None:
        """Step `step` was collected after `step_s`: a replay is lost time, and so is the first
        step after a grow back (it compiled the programs on every slice: part of the move)."""
        if step <= self.replay_until:
            self._lost["replayed_s"] += step_s
        elif self._grown:
            self._lost["relayout_s"] += step_s
        self._grown = False

    def goodput(self) -> dict:
        """Time lost to failures and run at reduced width, so far, in seconds: "failures";
        "aborted_s" (the failed attempts, from their start until the loss was declared:
        detection included); "replace_s" (getting replacements, or waiting for one in vain);
        "relayout_s" (choosing and setting up a layout on fewer or more slices, and after a
        grow back the first step, which compiles the programs on every slice: one step's
        useful work is counted in it); "restore_s";
        "replayed_s" and "replayed_steps" (recomputing the steps the restore rewound);
        "lost_s" (their sum); "reduced_width_s" (time on fewer slices than configured);
        "layout_changes"."""
        out = dict(self._lost)
        out["lost_s"] = sum(out[k] for k in ("aborted_s", "replace_s", "relayout_s", "restore_s", "replayed_s"))
        narrow = self._narrow_s + (time.perf_counter() - self._narrow_since if self._narrow_since is not None else 0.0)
        out["reduced_width_s"] = narrow
        out["layout_changes"] = len(self.changes)
        return out

    def event(self, why: str, slowdown: float) -> dict:
        """Record and log (one line) the layout the run just moved to."""
        t = self._trainer
        event = {"step": t.step_count, "num_slices": t.num_slices, "schedule": t.schedule.name,
                 "placement": list(t.placement), "predicted_slowdown": round(slowdown, 4), "why": why}
        self.changes.append(event)
        log.warning("layout after step %d: %s (%s); predicted step time x%.2f of the configured %d slice(s)",
                    t.step_count, elastic.describe(t.schedule), why, slowdown, self.configured[0].num_slices)
        return event

    # -- moves ---------------------------------------------------------------------------------
    def replace(self, lost: WorkerLost, committed: str) -> bool:
        """Put a new worker in the lost slice's place if on_loss allows and one comes within
        replace_timeout_s; False when the run is to go on without it instead. With
        on_loss='replace' and no worker, RuntimeError naming the slice and the last commit."""
        if self.on_loss == "shrink":
            return False
        t = self._trainer
        deadline = time.monotonic() + self.replace_timeout_s
        while True:
            try:
                t.cluster.replace(lost.slice_index)
                return True
            except ReplaceUnsupported as e:
                why = e
            finally:
                if t.memory is not None:
                    t.memory.replaced(lost.slice_index)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(REPLACE_POLL_S, left))
        if self.on_loss == "replace":
            raise RuntimeError(f"{lost}; cannot replace it (on_loss='replace', waited replace_timeout_s="
                               f"{self.replace_timeout_s:g}): {why}; {committed}") from lost
        log.warning("slice %d not replaced: %s", lost.slice_index, why)
        return False

    def shrink(self, lost: WorkerLost, committed: str) -> dict:
        """Go on without the lost slice: the same stages on the survivors, in the layout the
        simulator predicts fastest among those that fit slice_memory_bytes (mpmd/train/elastic.py).
        RuntimeError, with the state committed, when none fits or no slice is left. Returns
        {"why", "slowdown"} for the event, recorded once the step restored to is known."""
        t = self._trainer
        n = t.num_slices - 1
        if n < 1:
            raise RuntimeError(f"{lost}; not replaced and no other slice to continue on; {committed}") from lost
        costs, per_stage = self._stage_estimates()
        try:
            chosen = elastic.choose(t.pipeline.num_stages, t.num_microbatches, n, costs, per_stage,
                                    self.slice_memory_bytes)
        except elastic.NoFit as e:
            raise RuntimeError(f"{lost}; not replaced, and {e}; stopped, {committed}") from lost
        meshes = [m for r, m in enumerate(t.layout.meshes) if r != lost.slice_index]
        self._move(chosen.schedule, meshes, lambda ms: t.cluster.remove(lost.slice_index, ms))
        return {"why": f"slice {lost.slice_index} lost, not replaced",
                "slowdown": elastic.predicted_slowdown(chosen, self.configured[0], costs)}

    def grow_back(self, data_state) -> None:
        """At a checkpoint boundary of a run on fewer slices than configured: if a worker can
        be had again, let that checkpoint commit, move back to the configured layout and
        restore it (no step is lost). Nothing happens when no worker comes (ReplaceUnsupported)
        or the checkpoint did not commit: tried again at the next boundary. The commit is
        waited for only once a worker is at hand, so a run without capacity never waits."""
        t = self._trainer
        assert not t.in_flight, "a checkpoint step is never run ahead of"
        t0 = time.perf_counter()
        schedule, meshes = self.configured
        step_now = t.step_count

        def committed():     # before any slice is reset: their saves in flight must land
            t.checkpoints.wait()
            if t.checkpoints.latest() != step_now:
                raise ReplaceUnsupported(f"the checkpoint of step {step_now} did not commit; "
                                         f"growing back at the next one")
        try:
            self._move(schedule, meshes, lambda ms: t.cluster.add(ms, before_reset=committed))
            step, manifest = t.checkpoints.restore_latest()
        except ReplaceUnsupported as e:
            log.info("still on %d slice(s): %s", t.num_slices, e)
            return
        except WorkerLost as e:
            t._recover(e, t0)
        t._opt_ready = True
        if step != step_now:      # the newest commit did not restore: an older one did
            self.replays(step_now)
            t._step = step
            raise Rewound(step, manifest.get("data_state"), "grow back", "persistent", self.replay_until - step)
        if t.memory is not None:
            t.memory.snapshot(step, data_state)
        self._lost["relayout_s"] += time.perf_counter() - t0
        self._grown = True
        self.event("capacity back", 1.0)

    def _move(self, schedule: schedules.Schedule, meshes, resize) -> None:
        """Move to `schedule` (the same stages and microbatches) on slices of `meshes`:
        `resize(meshes)` changes the cluster (every slice starts afresh), then what was
        shipped is forgotten; the caller restores the state. ReplaceUnsupported from resize
        changes nothing."""
        t = self._trainer
        layout = lowering.layout(t.pipeline, t.optimizer, meshes, schedule.placement, t._rules)
        try:
            resize(meshes)
        finally:
            if t.cluster.num_slices == schedule.num_slices:    # resized, even if a slice went right after
                t.schedule, t.placement, t.num_slices = schedule, schedule.placement, schedule.num_slices
                t.layout = layout
                t._compiled, t._lowered, t._opt_ready = {}, None, False
                now, narrow = time.perf_counter(), self.narrow
                if narrow and self._narrow_since is None:
                    self._narrow_since = now
                elif not narrow and self._narrow_since is not None:
                    self._narrow_s += now - self._narrow_since
                    self._narrow_since = None
                if t.checkpoints is not None:
                    t.checkpoints.relayout(t.placement, t._state_layouts(), layout_record(schedule, meshes))
                if t.memory is not None:     # a new ring over the slices at hand
                    t.memory = snapshots.MemorySnapshots(
                        t.cluster, t.placement, snapshots.state_specs(t.pipeline, t.optimizer, layout),
                        t.memory.every, t._launch_setup)

    def _stage_estimates(self) -> tuple[list[float], list[dict] | None]:
        """(each stage's forward cost, per-stage bytes or None) for pricing layouts: XLA's
        cost analysis of a training microbatch (unit costs before any step was compiled);
        bytes only when slice_memory_bytes asks for them."""
        t = self._trainer
        if self._estimates is None:
            if t._train_specs is None:
                self._estimates = ([1.0] * t.pipeline.num_stages, None)
            else:
                per_stage = (stage_costs.memory(t.pipeline, t.optimizer, *t._train_specs)
                             if self.slice_memory_bytes is not None else None)
                self._estimates = (stage_costs.fn_costs(t.pipeline.fns, t._train_specs[0]), per_stage)
        return self._estimates
