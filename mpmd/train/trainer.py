"""Trainer: the single controller's training loop over any cluster.

    trainer = mpmd.Trainer(pipe, optimizer=optax.adamw(3e-4), schedule="1f1b",
                           num_microbatches=8, cluster=mpmd.InProcessCluster())
    metrics = trainer.step(inputs, targets)   # {"loss": ...}
    params = trainer.params()                 # per stage nnx.Param state, host arrays

    pending = trainer.submit(inputs, targets) # run-ahead: sent now, runs after the steps
    metrics = pending.result()                # sent before it; result() waits for it

Parameters and optimizer state are created on their slices and stay there; a step sends
each slice one message (the plan name, the step number, and the microbatches it needs).
Programs are compiled for the microbatch shapes seen at the first step and shipped to the
slices once.

The Trainer is its parts, each with its own state, composed here:
    programs      the layout in force and the programs shipped for it    (programs.py)
    dispatcher    steps sent and collected, run-ahead, metrics           (dispatch.py)
    checkpointer  both checkpoint tiers: due, save, restore, resume      (checkpointer.py)
    recovery      a lost slice: replace, shrink, grow back; goodput      (relayout.py)
configured by the option records `checkpoint=mpmd.Checkpointing(...)` and
`recovery=mpmd.Recovery(...)` (options.py).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import jax
import numpy as np
import optax

from mpmd.runtime.control.cluster import Cluster
from mpmd.schedules import core as schedules
from mpmd.stages import batch as batches
from mpmd.stages import names
from mpmd.stages.pipeline import Pipeline
from mpmd.train import relayout
from mpmd.train.checkpointer import Checkpointer
from mpmd.train.dispatch import Dispatcher, PendingStep
from mpmd.train.layout import Mesh, RunLayout, run_layout
from mpmd.train.options import Checkpointing, Recovery
from mpmd.train.programs import Programs


class Trainer:
    """Trains `pipeline` with `optimizer` under `schedule` (a name, with num_microbatches and
    virtual_stages, or a Schedule given as data) on `cluster` (default: in-process slices).
    Every argument after the optimizer is a keyword. `mesh`: each slice's mesh, the
    logical-axis rules and where FSDP weights are gathered, an mpmd.Mesh or its shape alone
    (mpmd/train/layout.py); `layout`: a layout already checked by
    mpmd.train.layout.run_layout, in place of schedule, num_microbatches, virtual_stages and
    mesh; `max_grad_norm`: global-norm clipping; `run_dir`: where checkpoints are written and
    a run resumes from; `run_ahead`: steps sent beyond the oldest in flight; `recv_window`:
    receives a slice posts ahead of use; `checkpoint`, `recovery`: the option records
    (mpmd/train/options.py), their defaults when None. `init_params(paths)` -> arrays: each
    stage's initial parameters by their names (`pipeline.param_paths[k]`, e.g.
    `blocks.3.mlp.up.kernel`), in place of the stages' own values or seeded init (e.g.
    `mpmd.recipes.families.hf.open(dir).read`: pretrained weights, read stage by stage); a
    recovery with nothing saved yet starts from them again."""

    def __init__(
        self,
        pipeline: Pipeline,
        optimizer: optax.GradientTransformation,
        *,
        schedule: str | schedules.Schedule | None = None,
        num_microbatches: int | None = None,
        virtual_stages: int | None = None,
        mesh: Mesh | dict | list | None = None,
        layout: RunLayout | None = None,
        cluster: Cluster | None = None,
        max_grad_norm: float | None = None,
        run_dir=None,
        run_ahead: int = 1,
        recv_window: int | None = None,
        checkpoint: Checkpointing | None = None,
        recovery: Recovery | None = None,
        init_params: Callable[[tuple[str, ...]], Sequence] | None = None,
    ):
        _check_args(pipeline, optimizer, max_grad_norm, run_ahead, recv_window, checkpoint, recovery)
        if init_params is not None and not callable(init_params):
            raise ValueError(
                f"init_params must be a function from a stage's parameter paths to their arrays "
                f"(e.g. mpmd.recipes.families.hf.open(dir).read) or None, got {type(init_params).__name__}"
            )
        if cluster is None:
            from mpmd.runtime.control.inprocess import InProcessCluster

            cluster = InProcessCluster()
        # Each slice's mesh and every stage's layouts, checked before any worker starts.
        run = _run_layout(
            pipeline, optimizer, layout, cluster.devices_per_slice, schedule, num_microbatches, virtual_stages, mesh
        )
        built = run.schedule
        self.pipeline, self.optimizer, self.max_grad_norm = pipeline, optimizer, max_grad_norm
        self.num_microbatches, self.run_ahead, self.recv_window = built.num_microbatches, run_ahead, recv_window
        self.cluster = cluster
        self.programs = Programs(
            pipeline,
            optimizer,
            cluster,
            run,
            max_grad_norm=max_grad_norm,
            recv_window=recv_window,
            init_params=init_params,
        )
        # What a restored run must match beyond its leaves (the math); how it is laid out is
        # free to differ from the checkpoint's.
        partition = {"num_microbatches": self.num_microbatches, "max_grad_norm": max_grad_norm}
        self.checkpointer = Checkpointer(
            checkpoint or Checkpointing(),
            run_dir,
            cluster,
            pipeline,
            optimizer,
            partition,
            built.placement,
            run.layout,
            relayout.layout_record(built, run.layout.meshes),
        )
        self.dispatcher = Dispatcher(
            self.programs, self.checkpointer, self.num_microbatches, pipeline.num_stages, max_grad_norm, run_ahead
        )
        # The layout asked for; a lost slice without replacement moves the run onto fewer
        # slices (mpmd/train/elastic.py) and a checkpoint boundary moves it back once it can.
        # It hears of every collected, lost or non-finite step (dispatch.StepEvents).
        self.recovery = relayout.RecoveryPolicy(
            recovery or Recovery(),
            cluster,
            self.programs,
            self.checkpointer,
            self.dispatcher,
            (built, run.layout.meshes),
        )
        self.dispatcher.events = self.recovery
        self._closed = False
        # The workers may save and restore only below run_dir (a cluster that starts its own
        # workers confines them to it).
        cluster.start(
            built.num_slices, root=os.path.abspath(run_dir) if run_dir is not None else None, meshes=run.layout.meshes
        )
        try:
            # A run that resumes reads no pretrained weights: its checkpoint replaces them (and
            # one that exists but does not restore stops the run, never a start from them).
            self.programs.materialize(pretrained=init_params is not None and self.checkpointer.latest() is None)
            self.checkpointer.start(built.placement, self.programs.layout, self.programs.launch)
            step = self.checkpointer.resume()
            if step is not None:
                self.dispatcher.rewind(step)
                self.programs.state_restored()
        except BaseException:
            cluster.close()
            raise

    # -- training --------------------------------------------------------------------------
    def step(self, batch, targets=None, trace: bool = False, data_state=None) -> dict:
        """One training step on a global batch split along axis 0 into equal microbatches:
        `submit(...).result()`.

        `batch` is a dict of arrays with the global batch on axis 0: "inputs" enters the first
        stage, a key named by a keyword-only parameter of a stage's __call__ is fed to that
        stage, and `loss_fn(outputs, batch)` reads the rest (mpmd/stages/batch.py).
        `step(inputs, targets)` is shorthand for {"inputs": inputs, "targets": targets} with
        `loss_fn(outputs, targets)`.

        Returns {"step", "loss", "step_s"}: the loss is the mean over microbatches of a scalar
        loss, or sum(loss_sum) / sum(weight) over the step of a loss returning (loss_sum,
        weight), plus the auxiliary losses stages add ("aux_loss", mpmd.add_loss); "grad_norm"
        when clipping and, with trace=True, "events": per slice, the timed tasks and transfers,
        "held": per slice, (most receives outstanding at once, their most bytes), and
        "peak_bytes": per slice, the most bytes of its buffers and outstanding receives.
        `data_state` (JSON-able) is saved with the checkpoint this step may trigger.

        With Checkpointing(memory_every=k), every k-th step also snapshots every slice's
        state in host memory, copied to a peer slice (mpmd/train/snapshots.py); "checkpoint"
        in the metrics lists the tiers this step saved to ("memory", "persistent").

        If a slice is lost during the step (or the step stalls past the cluster's step
        timeout), the Trainer replaces it or goes on without it (Recovery.on_loss), restores
        the newest saved state (the in-memory snapshot when one survives, else the last
        committed checkpoint) and raises `Rewound` (mpmd/train/checkpoints.py), which says
        which tier it used. A slice that fails at an instruction raises
        mpmd.runtime.control.cluster.StepFailed, which is not recovered from: a replay would
        fail alike. A checkpoint that failed to save is retried (waited for) after the next
        step; CheckpointError once its retries are spent.
        """
        return self.submit(batch, targets, trace, data_state).result()

    def submit(self, batch, targets=None, trace: bool = False, data_state=None) -> PendingStep:
        """Send one training step and return at once; `.result()` of the PendingStep gives
        what `step` returns (and raises what it raises). Steps are collected oldest first;
        collecting a step collects those before it. Submitting collects the oldest step first
        when `run_ahead` steps beyond it are in flight already, and every step in flight when
        the newest is a checkpoint step or a failed save awaits its retry
        (mpmd/train/dispatch.py); a Rewound can therefore come from here too: the batch was
        not sent."""
        self._check_open()
        return self.dispatcher.submit(*batches.as_batch(batch, targets, what="submit"), trace, data_state)

    def save(self, data_state=None, wait: bool = False, **extra) -> None:
        """Checkpoint the state after the current step, with `data_state` (JSON-able: where the
        data loader stands) in the manifest. Asynchronous unless `wait` or
        Checkpointing(asynchronous=False); a waited-for save that fails is retried, then
        raises CheckpointError. A slice lost while saving (or, waited for, before the step
        committed) is recovered as in `step`: Rewound says where to resume; save again after
        replaying."""
        self._check_open()
        if self.checkpoints is None:
            raise ValueError("this Trainer has no run_dir to save checkpoints in")
        self.dispatcher.collect_all()
        if not self.dispatcher.finite:
            raise ValueError(
                f"the state after step {self.step_count} comes from a step whose loss or gradient "
                f"norm was not finite: it is never saved (the last committed step is "
                f"{self.checkpointer.latest()})"
            )
        self.recovery.save(self.step_count, data_state, extra, wait=wait)

    # -- other plans -------------------------------------------------------------------------
    def grads(self, batch, targets=None) -> tuple[float, list]:
        """(loss, per-stage gradient state) of a batch (as `step` takes it), without updating
        anything.

        The gradient is that of the step's objective over the whole batch, as jax.grad of the
        unpipelined model gives it; for checking a pipeline against plain JAX.
        """
        self._check_open()
        results = self.dispatcher.run("grads", *batches.as_batch(batch, targets, what="grads"))
        loss = self.dispatcher.metrics(results, False)["loss"]
        return loss, self._fetch_per_stage(names.grads)

    def evaluate(self, batch, targets=None) -> float:
        """The loss of a batch (as `step` takes it, without auxiliary losses) through a
        forward-only plan: no backward, no update."""
        self._check_open()
        results = self.dispatcher.run("eval", *batches.as_batch(batch, targets, what="evaluate"))
        return self.dispatcher.metrics(results, False)["loss"]

    def predict(self, batch, targets_like=None):
        """The last stage's output for a batch (forward only), concatenated over microbatches.

        `batch`: the inputs, or a batch dict as `step` takes it (what the loss reads gives
        shapes only: it is not sent). `targets_like` gives the targets' shape for inputs
        given alone (defaults to the inputs' own shape and dtype).
        """
        self._check_open()
        if isinstance(batch, dict) and batches.INPUTS in batch:
            fed = batches.as_batch(batch, what="predict")
        else:
            fed = batches.as_batch(batch, batch if targets_like is None else targets_like, what="predict")
        self.dispatcher.run("predict", *fed, feed_targets=False)
        last = self.placement[-1]
        outputs = [names.output(j) for j in range(self.num_microbatches)]
        got = self.cluster.get(last, outputs)
        self.cluster.delete(last, outputs)
        return [np.concatenate(parts, axis=0) for parts in zip(*(got[n] for n in outputs))]

    def recover(self, lost) -> None:
        """Recover from a loss another client of this Trainer's cluster saw (mpmd.Groups: a
        program on another group found a slice gone): every step in flight is dropped, the
        lost slice, if it is this Trainer's, replaced, every slice restored from the newest
        saved state; raises Rewound as a step would."""
        self._check_open()
        self.dispatcher.lost_elsewhere(lost)

    def params(self) -> list:
        """Per stage, its nnx.Param state with host (numpy) arrays, fetched from its slice."""
        self._check_open()
        self.dispatcher.collect_all()
        return self._fetch_per_stage(names.params)

    def state(self) -> list:
        """Per stage, what its forward changes that is not a parameter (RNG stream counts,
        batch statistics) as {path within the stage: host array}; {} for a stage without."""
        self._check_open()
        self.dispatcher.collect_all()
        out = []
        for k, fn in enumerate(self.pipeline.fns):
            if fn.state is None:
                out.append({})
                continue
            leaves = self.cluster.get(self.placement[k], [names.stage_state(k)])[names.stage_state(k)]
            out.append(dict(zip(fn.state.paths, leaves)))
        return out

    def _fetch_per_stage(self, buffer) -> list:
        """Per stage k, the tree of its parameters' shape held in buffer(k) on its slice."""
        out = []
        for k, fn in enumerate(self.pipeline.fns):
            leaves = self.cluster.get(self.placement[k], [buffer(k)])[buffer(k)]
            out.append(jax.tree.unflatten(fn.param_tree, list(leaves)))
        return out

    # -- what the parts say ----------------------------------------------------------------
    schedule = property(lambda self: self.programs.schedule, doc="The schedule in force.")
    placement = property(lambda self: self.programs.placement, doc="stage -> slice, in force.")
    num_slices = property(lambda self: self.programs.num_slices, doc="Slices of the layout in force.")
    layout = property(lambda self: self.programs.layout, doc="Meshes and state layouts in force.")
    lowered = property(lambda self: self.programs.lowered, doc="Programs and plans compiled last.")
    step_count = property(
        lambda self: self.dispatcher.step_count, doc="Updates applied so far (restored ones included)."
    )
    in_flight = property(lambda self: self.dispatcher.in_flight, doc="Steps submitted and not yet collected.")
    checkpoints = property(lambda self: self.checkpointer.persistent, doc="The persistent tier, or None.")
    memory = property(lambda self: self.checkpointer.memory, doc="The in-memory tier, or None.")
    resumed = property(lambda self: self.checkpointer.resumed, doc="(step, data_state) when resumed from run_dir.")
    layout_change = property(
        lambda self: self.checkpointer.layout_change, doc='"from -> to" when resumed onto another layout.'
    )
    restarts = property(lambda self: self.recovery.restarts, doc="Recoveries so far.")
    recovery_s = property(lambda self: self.recovery.recovery_s, doc="How the last recovery went.")
    layout_changes = property(lambda self: self.recovery.changes, doc="One record per move between layouts.")

    @property
    def checkpoint_every(self) -> int:
        """Steps between persistent checkpoints (0: only when `save` is called); may be changed
        while training."""
        return self.checkpointer.every

    @checkpoint_every.setter
    def checkpoint_every(self, every: int) -> None:
        self.checkpointer.every = Checkpointing(every=every).every  # checked as the record checks it

    def goodput(self) -> dict:
        """Time lost to failures and run at reduced width, so far (RecoveryPolicy.goodput)."""
        return self.recovery.goodput()

    # -- closing -----------------------------------------------------------------------------
    def close(self, close_cluster: bool = True, abandon: bool = False) -> None:
        """Release the slices; with close_cluster=False the cluster's workers stay up for the
        next Trainer (its state is dropped when that Trainer starts it). A checkpoint still
        being written is committed first, unless `abandon`: then the steps in flight and a
        save not yet committed are dropped without waiting (a preempted run out of time; the
        run keeps its last commit)."""
        if not self._closed:
            try:
                if abandon:
                    self.dispatcher.discard()
                else:
                    self.dispatcher.collect_all()  # a step sent is a step done: its update and checkpoint land
            except Exception:  # closing after a failure: nothing left to collect
                self.dispatcher.discard()
            self._closed = True
            if not abandon:
                self.checkpointer.wait()
            if close_cluster:
                self.cluster.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this Trainer is closed")


def _check_args(pipeline, optimizer, max_grad_norm, run_ahead, recv_window, checkpoint, recovery) -> None:
    """ValueError naming the argument, for what a user passes the Trainer (the option records
    check their own fields when they are made)."""
    if not isinstance(pipeline, Pipeline):
        raise ValueError(f"pipeline must be an mpmd.Pipeline, got {type(pipeline).__name__}")
    if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
        raise ValueError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
    if not isinstance(run_ahead, int) or isinstance(run_ahead, bool) or run_ahead < 0:
        raise ValueError(
            f"run_ahead must be a non-negative integer (steps sent ahead of the one "
            f"running; 0: none), got {run_ahead!r}"
        )
    if recv_window is not None and (
        not isinstance(recv_window, int) or isinstance(recv_window, bool) or recv_window < 1
    ):
        raise ValueError(
            f"recv_window must be a positive integer (receives a slice posts ahead of "
            f"use) or None (each slice's peak of live activations in the schedule), "
            f"got {recv_window!r}"
        )
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
    if checkpoint is not None and not isinstance(checkpoint, Checkpointing):
        raise ValueError(
            f"checkpoint must be an mpmd.Checkpointing (e.g. mpmd.Checkpointing(every=50, "
            f"memory_every=5)) or None (no periodic checkpoints), got {type(checkpoint).__name__}"
        )
    if recovery is not None and not isinstance(recovery, Recovery):
        raise ValueError(
            f"recovery must be an mpmd.Recovery (e.g. mpmd.Recovery(on_loss='shrink')) or None "
            f"(the defaults: on_loss='auto'), got {type(recovery).__name__}"
        )


def _run_layout(
    pipeline, optimizer, layout, devices_per_slice, schedule, num_microbatches, virtual_stages, mesh
) -> RunLayout:
    """The given checked layout (then nothing else may say where things go), or the one made
    from schedule, its counts and mesh; either on the cluster's `devices_per_slice`."""
    if layout is None:
        schedule = "1f1b" if schedule is None else schedule
        return run_layout(pipeline, optimizer, schedule, num_microbatches, virtual_stages, mesh, devices_per_slice)
    if not isinstance(layout, RunLayout):
        raise ValueError(
            f"layout must be what mpmd.train.layout.run_layout returns, or None, got {type(layout).__name__}"
        )
    given = {"schedule": schedule, "num_microbatches": num_microbatches, "virtual_stages": virtual_stages, "mesh": mesh}
    if named := [k for k, v in given.items() if v is not None]:
        raise ValueError(f"give layout= or {', '.join(named)}, not both: the layout already says them")
    if len(layout.layout.params) != pipeline.num_stages:
        raise ValueError(f"layout is for {len(layout.layout.params)} stages, the pipeline has {pipeline.num_stages}")
    layout.check_devices(devices_per_slice)
    return layout
