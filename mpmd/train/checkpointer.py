"""The Trainer's checkpoint coordinator over both tiers: the persistent one (Orbax, every
`Checkpointing.every` steps, mpmd/train/checkpoints.py) and the in-memory one (a snapshot in
host memory copied to a peer slice every `memory_every` steps, mpmd/train/snapshots.py).

It says when a step is due for either tier, saves, restores the newest restorable state (the
in-memory snapshot when one survives and is no older than the last commit, else the last
committed checkpoint), resumes a run directory, and checks that a resumed run trains on the
global batch its checkpoint was trained on. When the run moves to another layout
(mpmd/train/relayout.py) the persistent tier saves and restores from the new placement and
the in-memory tier starts afresh on a ring over the slices at hand.
"""

from __future__ import annotations

import logging

from mpmd.lowering import core as lowering
from mpmd.stages import leaf_paths, names
from mpmd.train import snapshots
from mpmd.train.checkpoints import LAYOUT_KEYS, StageCheckpoints, describe_layout
from mpmd.train.options import Checkpointing

log = logging.getLogger("mpmd")


def state_layouts(layout: lowering.Layout, pipeline=None) -> dict:
    """{buffer: layout per array} of every stage's parameters and optimizer state, and of
    its stage state (replicated) when `pipeline`'s stage has any."""
    out = {}
    for k in range(len(layout.params)):
        out[names.params(k)] = [tuple(p) for p in layout.params[k]]
        out[names.opt_state(k)] = [tuple(p) for p in layout.opt[k]]
        fn = pipeline.fns[k] if pipeline is not None else None
        if fn is not None and fn.state is not None:
            out[names.stage_state(k)] = [()] * len(fn.state.leaves)
    return out


class Checkpointer:
    """Both tiers of `pipeline`'s state on `cluster`, as `options` says; `run_dir`: where the
    persistent tier writes (None: no persistent tier); `partition`: what a restored run must
    match beyond its leaves (the math); `placement`, `layout` and `record` (relayout.
    layout_record): how the run is laid out now."""

    def __init__(
        self,
        options: Checkpointing,
        run_dir,
        cluster,
        pipeline,
        optimizer,
        partition: dict,
        placement: tuple[int, ...],
        layout: lowering.Layout,
        record: dict,
    ):
        if options.every and run_dir is None:
            raise ValueError(
                f"checkpoint=Checkpointing(every={options.every}) needs run_dir: where to write the checkpoints"
            )
        self.every = options.every  # steps between persistent checkpoints (0: only when asked)
        self.memory_every = options.memory_every
        self.metadata = dict(options.metadata)  # e.g. a config hash, in every manifest
        self.cluster, self.pipeline, self.optimizer = cluster, pipeline, optimizer
        self.persistent: StageCheckpoints | None = None
        self.memory: snapshots.MemorySnapshots | None = None
        self._launch = None  # sends a plan to every slice (Programs.launch), for the memory tier
        self.resumed: tuple[int, object] | None = None  # (step, data_state) when resumed from run_dir
        self.layout_change: str | None = None  # "from -> to" when resumed onto another layout
        self._resumed_batch = None  # the global batch's leaves as the resumed checkpoint saw them
        self._batch = None  # [[shape, dtype] of each input and target leaf] of the last train step
        if run_dir is not None:
            self.persistent = StageCheckpoints(
                run_dir,
                cluster,
                placement,
                partition,
                options,
                state_layouts(layout, pipeline),
                leaf_paths.state_names(pipeline, optimizer),
                record,
            )
            self.persistent.check_newest()  # a resume that changes the math fails before any worker starts

    def start(self, placement: tuple[int, ...], layout: lowering.Layout, launch) -> None:
        """The slices hold their initial state: install the in-memory tier's plans (when
        memory_every); `launch(plan)` sends a plan to every slice with a fresh run id."""
        self._launch = launch
        if self.memory_every:
            self.memory = snapshots.MemorySnapshots(
                self.cluster,
                placement,
                snapshots.state_specs(self.pipeline, self.optimizer, layout),
                self.memory_every,
                launch,
                layout.meshes,
            )

    def resume(self) -> int | None:
        """Restore the run directory's newest committed step onto every slice, if there is one:
        its step (`resumed` says where the data stands), else None."""
        restored = self.persistent.restore_latest() if self.persistent is not None else None
        if restored is None:
            return None
        step, manifest = restored
        self.resumed = (step, manifest.get("data_state"))
        self._resumed_batch = manifest.get("batch")
        self.layout_change = layout_change(manifest, self.persistent.layout)
        if self.layout_change:
            log.info("layout changed: %s", self.layout_change)
        return step

    def check_batch(self, batch: list) -> None:
        """A resumed run trains on the global batch its checkpoint was trained on (another
        batch changes the math); noted for the next checkpoint."""
        if self._resumed_batch is not None and batch != self._resumed_batch:
            show = lambda b: ", ".join(f"{'x'.join(map(str, shape))} {dtype}" for shape, dtype in b)
            raise ValueError(
                f"the global batch is {show(batch)} (per input and target leaf), but the "
                f"checkpoint this run resumed from (step {self.resumed[0]}) was trained on "
                f"{show(self._resumed_batch)}: resume with the same global batch"
            )
        self._batch = batch

    # -- the step loop -----------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether the persistent tier saves after `step`."""
        return bool(self.every) and step % self.every == 0

    def retry_due(self) -> bool:
        """A save failed and awaits its retry."""
        return self.persistent is not None and self.persistent.failed()

    def memory_due(self, step: int) -> bool:
        return self.memory is not None and self.memory.due(step)

    def launch_snapshot(self, step: int, data_state):
        """Send the in-memory snapshot of the state after `step`, to run right behind it."""
        return self.memory.launch(step, data_state)

    def finish_snapshot(self, launched) -> None:
        self.memory.finish(launched)

    def save(self, step: int, data_state, extra: dict, wait: bool) -> None:
        """A persistent checkpoint of the state after `step` (StageCheckpoints.save), with the
        metadata and the global batch in its manifest. WorkerLost if a slice is lost."""
        assert self.persistent is not None, "a save without a run_dir (the Trainer refuses it)"
        batch = {"batch": self._batch} if self._batch is not None else {}
        self.persistent.save(step, data_state, {**self.metadata, **batch, **extra}, wait=wait)

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        return self.persistent.latest() if self.persistent is not None else None

    def wait(self) -> None:
        """Until every persistent save in flight is committed (or failed)."""
        if self.persistent is not None:
            self.persistent.wait()

    def settle(self, lost: BaseException) -> None:
        """Before recovering from `lost` (a WorkerLost): the persistent saves in flight commit
        (or fail) first, unless the in-memory tier holds a step at least as new as each of
        them: then restoring cannot want them, and they are abandoned to finish in the
        background (StageCheckpoints.abandon: a survivor's write of a step the lost slice
        never finished takes as long as a save, up to a second here, for a step nobody will
        restore). restore_newest still waits for them if the memory tier does not restore
        after all (restore_latest waits)."""
        if self.persistent is None:
            return
        gen = self.memory.restorable() if self.memory is not None else None
        if gen is None or any(step > gen.step for step in self.persistent.steps_in_flight()):
            self.persistent.wait()
        else:
            self.persistent.abandon(lost)

    # -- recovery ------------------------------------------------------------------------------
    def replaced(self, slice_index: int) -> None:
        """A slice was given a new worker: the snapshots and copies it held are gone."""
        if self.memory is not None:
            self.memory.replaced(slice_index)

    def restore_newest(self, memory: bool = True) -> tuple[str, int, object]:
        """(tier, step, data_state) after putting every slice back at the newest saved state:
        tier "memory" or "persistent"; "initial" (step 0) when nothing was saved yet, and the
        caller puts the initial state back. CheckpointError when checkpoints exist but none
        restores: never train on from a state that is neither saved nor the initial one.
        memory=False: not from the in-memory tier (its snapshots are forgotten), whose
        snapshot is taken before its step's loss is known."""
        gen = self.memory.restorable() if self.memory is not None and memory else None
        last = self.latest()
        if gen is not None and (last is None or gen.step >= last):
            self.memory.restore()
            return "memory", gen.step, gen.data_state
        if self.memory is not None:
            self.memory.forget()
        restored = self.persistent.restore_latest() if self.persistent is not None else None
        if restored is None:
            return "initial", 0, None
        step, manifest = restored
        return "persistent", step, manifest.get("data_state")

    def restore_committed(self) -> tuple[int, dict]:
        """(step, manifest) of the newest committed step, restored onto every slice."""
        return self.persistent.restore_latest()

    def snapshot_now(self, step: int, data_state) -> None:
        """An in-memory snapshot of the state at hand (after a restore: the replacement holds a
        copy again), waited for; nothing without the in-memory tier."""
        if self.memory is not None:
            self.memory.snapshot(step, data_state)

    def relayout(self, placement: tuple[int, ...], layout: lowering.Layout, record: dict) -> None:
        """The stages moved onto other slices: saves and restores follow them, and the
        in-memory tier starts afresh on a ring over the slices at hand."""
        if self.persistent is not None:
            self.persistent.relayout(placement, state_layouts(layout, self.pipeline), record)
        if self.memory is not None:
            self.memory = snapshots.MemorySnapshots(
                self.cluster,
                placement,
                snapshots.state_specs(self.pipeline, self.optimizer, layout),
                self.memory.every,
                self._launch,
                layout.meshes,
            )


def layout_change(manifest: dict, layout: dict) -> str | None:
    """'from -> to' when `manifest` was saved on another layout than `layout`, else None."""
    saved = manifest.get("layout")
    if saved is None and "format" not in manifest:
        saved = manifest.get("partition", {})
    if saved is None or all(saved.get(k) == layout.get(k) for k in LAYOUT_KEYS if k in saved):
        return None
    return f"{describe_layout(saved)} -> {describe_layout(layout)}"
