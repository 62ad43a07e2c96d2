"""Trainer: the single controller's training loop over any cluster.

    trainer = mpmd.Trainer(pipe, optimizer=optax.adamw(3e-4), schedule="1f1b",
                           num_microbatches=8, cluster=mpmd.InProcessCluster())
    metrics = trainer.step(inputs, targets)   # {"loss": ...}
    params = trainer.params()                 # per stage nnx.Param state, host arrays

    pending = trainer.submit(inputs, targets) # run-ahead: sent now, runs after the steps
    metrics = pending.result()                # sent before it; result() waits for it

Parameters and optimizer state are created on their slices and stay there; a step sends
each slice one message (the plan name, the step number, and the microbatches it needs).
Programs are compiled for the microbatch shapes seen at the first step (or at construction
when the pipeline has a sample input) and shipped to the slices once.

Run-ahead dispatch. `submit` sends a step's Run (with its microbatches) and returns a
PendingStep at once; each slice queues it behind the step it is running, so the gap between
steps (the controller collecting results, the recipe logging, the next batch's dispatch)
is hidden. At most `run_ahead` steps are in flight beyond the oldest one: `submit` first
collects the oldest when there would be more. Everything else that touches the slices
(save, evaluate, params, ...) first collects every step in flight, so it sees the state
after the last submitted step. A checkpoint step is never run ahead of: its successor is
submitted only once the step and its save are done, because the save snapshots the slices'
state and must not see the next step's update (the alternative, queueing the Save behind
the Run on each worker, would reorder the checkpoint verbs; this costs one step's overlap
every checkpoint_every steps). A lost slice discards the steps in flight behind the one
that failed: none of their updates is kept, none of their metrics is returned, and the
Rewound raised says where to resume, as without run-ahead.

A lost slice (on_loss: replace it, go on with fewer slices, grow back) is the business of
the Trainer's Relayout (mpmd/train/relayout.py): the moves between layouts and the goodput books.
"""
from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np
import optax

from mpmd.stages import abstract as lazy
from mpmd.stages import leaf_paths
from mpmd.lowering import core as lowering
from mpmd.stages import names
from mpmd.train import relayout
from mpmd.schedules import core as schedules
from mpmd.stages import sharding
from mpmd.train import snapshots
from mpmd.train.checkpoints import Rewound, StageCheckpoints, layout_change
from mpmd.stages.pipeline import Pipeline
from mpmd.runtime.control.cluster import Cluster, WorkerLost
from mpmd.runtime.worker.instructions import Run

log = logging.getLogger("mpmd")


class Trainer:
    def __init__(self, pipeline: Pipeline, optimizer: optax.GradientTransformation,
                 schedule: str | schedules.Schedule = "1f1b",
                 num_microbatches: int | None = None, cluster: Cluster | None = None, virtual_stages: int | None = None,
                 max_grad_norm: float | None = None, run_dir=None, checkpoint_every: int = 0,
                 keep: int = 2, async_checkpoint: bool = True, max_restarts: int = 3,
                 checkpoint_metadata: dict | None = None, max_failed_saves: int = 1,
                 mesh=None, rules: dict | None = None, memory_every: int = 0, run_ahead: int = 1,
                 recv_window: int | None = None, on_loss: str = "auto", replace_timeout_s: float = 60.0,
                 slice_memory_bytes: int | None = None):
        if not isinstance(pipeline, Pipeline):
            raise ValueError(f"pipeline must be an mpmd.Pipeline, got {type(pipeline).__name__}")
        if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
            raise ValueError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
        if not isinstance(run_ahead, int) or isinstance(run_ahead, bool) or run_ahead < 0:
            raise ValueError(f"run_ahead must be a non-negative integer (steps sent ahead of the one "
                             f"running; 0: none), got {run_ahead!r}")
        self.run_ahead = run_ahead
        if recv_window is not None and (not isinstance(recv_window, int) or isinstance(recv_window, bool)
                                        or recv_window < 1):
            raise ValueError(f"recv_window must be a positive integer (receives a slice posts ahead of "
                             f"use) or None (each slice's peak of live activations in the schedule), "
                             f"got {recv_window!r}")
        self.recv_window = recv_window
        relayout.check_args(on_loss, replace_timeout_s, slice_memory_bytes)
        self._pending: list[PendingStep] = []     # submitted, not yet collected; oldest first
        self._last_collected_at = 0.0             # perf_counter when the last step was collected
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        S = pipeline.num_stages
        self.schedule = _schedule(schedule, S, num_microbatches, virtual_stages)
        num_microbatches = self.schedule.num_microbatches
        self.pipeline = pipeline
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.num_microbatches = num_microbatches
        if cluster is None:
            from mpmd.runtime.control.inprocess import InProcessCluster
            cluster = InProcessCluster()
        self.cluster = cluster
        self.num_slices = self.schedule.num_slices
        self.placement = self.schedule.placement     # stage -> slice
        # Each slice's mesh and every stage's layouts, checked before any worker starts.
        meshes = sharding.slice_meshes(mesh, self.num_slices, cluster.devices_per_slice)
        self._rules = sharding.check_rules(rules)
        self.layout = lowering.layout(pipeline, optimizer, meshes, self.placement, self._rules)
        # The layout asked for; a lost slice without replacement moves the run onto fewer
        # slices (mpmd/train/elastic.py) and a checkpoint boundary moves it back once it can.
        self.relayout = relayout.Relayout(self, on_loss, replace_timeout_s, slice_memory_bytes,
                                          (self.schedule, meshes))
        self._train_specs = None                  # a training microbatch's (input, target) specs
        self._compiled: dict = {}     # microbatch shapes -> (name suffix, Lowered), shipped to the slices
        # (schedule, placement, meshes, microbatch shapes) -> Lowered: a layout moved back to (a grow back, the
        # same shrink again) ships its programs again without lowering and exporting them anew.
        self._lowerings: dict = {}
        self._lowered = None
        self._step = 0
        self._runs = 0      # every cluster run gets a fresh id: transfer keys must never repeat
        self._closed = False
        if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be a non-negative integer (0: only when asked), got {checkpoint_every!r}")
        if checkpoint_every and run_dir is None:
            raise ValueError("checkpoint_every needs run_dir: where to write the checkpoints")
        if not isinstance(memory_every, int) or isinstance(memory_every, bool) or memory_every < 0:
            raise ValueError(f"memory_every must be a non-negative integer (steps between in-memory "
                             f"snapshots; 0: none), got {memory_every!r}")
        self.checkpoint_every = checkpoint_every
        self._checkpoint_metadata = dict(checkpoint_metadata or {})   # e.g. a config hash, in every manifest
        self.max_restarts = max_restarts
        self.restarts = 0
        self.resumed: tuple[int, object] | None = None   # (step, data_state) when resumed from run_dir
        self.layout_change: str | None = None   # "from -> to" when resumed onto another layout
        self._resumed_batch = None    # the global batch's leaves as the resumed checkpoint saw them
        self._batch = None            # [[shape, dtype] of each input and target leaf] of the last train step
        self._opt_ready = False
        self.checkpoints = None
        self.memory = None           # the in-memory tier (mpmd/train/snapshots.py), when memory_every
        self._attempted = 0          # the step being computed (a failure replays from here)
        self.recovery_s: dict = {}
        if run_dir is not None:
            # What a restored run must match beyond its leaves (the math), and how this one is
            # laid out (free to differ from the checkpoint's).
            partition = {"num_microbatches": num_microbatches, "max_grad_norm": max_grad_norm}
            self.checkpoints = StageCheckpoints(run_dir, self.cluster, self.placement, partition, keep, async_checkpoint,
                                                max_failed_saves, self._state_layouts(),
                                                leaf_paths.state_names(pipeline, optimizer),
                                                relayout.layout_record(self.schedule, meshes))
            self.checkpoints.check_newest()   # a resume that changes the math fails before any worker starts
        # The workers may save and restore only below run_dir (a cluster that starts its own
        # workers confines them to it).
        self.cluster.start(self.num_slices, root=os.path.abspath(run_dir) if run_dir is not None else None,
                           meshes=meshes)
        try:
            self._materialize()
            if memory_every:
                self.memory = snapshots.MemorySnapshots(
                    self.cluster, self.placement, snapshots.state_specs(pipeline, optimizer, self.layout),
                    memory_every, self._launch_setup)
            if self.checkpoints is not None:
                restored = self.checkpoints.restore_latest()
                if restored is not None:
                    self._step, manifest = restored
                    self._opt_ready = True
                    self.resumed = (self._step, manifest.get("data_state"))
                    self._resumed_batch = manifest.get("batch")
                    self.layout_change = layout_change(manifest, self.checkpoints.layout)
                    if self.layout_change:
                        log.info("layout changed: %s", self.layout_change)
        except BaseException:
            self.cluster.close()
            raise

    def _state_layouts(self) -> dict:
        """{buffer: layout per array} of every stage's parameters and optimizer state."""
        out = {}
        for k in range(self.pipeline.num_stages):
            out[names.params(k)] = [tuple(p) for p in self.layout.params[k]]
            out[names.opt_state(k)] = [tuple(p) for p in self.layout.opt[k]]
        return out

    def _materialize(self) -> None:
        """Put each stage's initial parameters on its slice, laid out on its mesh: the
        module's own values, shipped once, or for an abstract model (mpmd.abstract) created
        there, already sharded, by its seeded init."""
        plans: dict[int, list] = {}
        for k, (fn, stage) in enumerate(zip(self.pipeline.fns, self.pipeline.stages)):
            r = self.placement[k]
            if lazy.is_abstract(fn.param_leaves):
                init = names.program("init_params", k)
                mesh = self.layout.meshes[r].abstract()
                shardings = [jax.sharding.NamedSharding(mesh, p) for p in self.layout.params[k]]
                self.cluster.load_programs(r, {init: lazy.init_program(stage, fn.param_tree, shardings)})
                plans.setdefault(r, []).append(Run(init, (), (names.params(k),), f"init params s{k}"))
            else:
                self.cluster.put(r, names.params(k), fn.param_leaves, [tuple(p) for p in self.layout.params[k]])
        if plans:
            for r in range(self.num_slices):
                self.cluster.install_plan(r, "init_params", plans.get(r, []))
            self._run_setup("init_params")

    def _run_setup(self, plan: str) -> None:
        """Run a plan that takes no feeds and returns nothing: it creates state on the slices."""
        self._launch_setup(plan).result()

    def _launch_setup(self, plan: str):
        """Send such a plan behind whatever is in flight; the cluster's PendingRun."""
        self._runs += 1
        return self.cluster.launch(plan, self._runs, {}, {})

    # -- compile -------------------------------------------------------------------------
    def _micro_specs(self, inputs, targets):
        m = self.num_microbatches
        sizes = {np.shape(l)[0] if np.ndim(l) else None for l in jax.tree.leaves((inputs, targets))}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"inputs and targets must share a leading batch axis, got batch sizes {sorted(map(str, sizes))}")
        (batch,) = sizes
        if batch % m:
            ok = [d for d in range(1, batch + 1) if batch % d == 0]
            raise ValueError(f"batch size {batch} is not divisible by num_microbatches={m}; "
                             f"allowed num_microbatches for this batch: {ok}")
        micro = lambda x: jax.ShapeDtypeStruct((batch // m,) + np.shape(x)[1:], np.result_type(x))
        return jax.tree.map(micro, inputs), jax.tree.map(micro, targets)

    def _compile(self, in_spec, tgt_spec) -> str:
        """Lower and ship the programs for these microbatch shapes once; returns the suffix
        naming that shape's programs and plans, so several shapes (training batches,
        a sampling batch) live side by side on the slices without recompiling."""
        key = (jax.tree.structure((in_spec, tgt_spec)), tuple(jax.tree.leaves((in_spec, tgt_spec))))
        if key in self._compiled:
            suffix, self._lowered = self._compiled[key]
            return suffix
        suffix = names.variant(len(self._compiled))
        layout_key = (self.schedule.name, self.placement, tuple(self.layout.meshes), key)
        low = self._lowerings.get(layout_key)
        if low is None:
            low = self._lowerings[layout_key] = lowering.lower(
                self.pipeline, self.schedule, self.optimizer, self.max_grad_norm, in_spec, tgt_spec, self.layout,
                self.recv_window)
        rename = lambda stream: stream.with_templates(
            lambda t: t._replace(program=t.program + suffix) if isinstance(t, Run) else t)
        for r in range(low.num_slices):
            self.cluster.load_programs(r, {name + suffix: spec for name, spec in low.programs[r].items()})
            for plan in ("train", "grads", "eval", "predict", "init"):
                self.cluster.install_plan(r, plan + suffix, rename(getattr(low, plan)[r]))
        if not self._opt_ready:   # first compile: create optimizer state on each slice
            self._run_setup("init" + suffix)
            self._opt_ready = True
        self._compiled[key] = (suffix, low)
        self._lowered = low
        return suffix

    # -- public --------------------------------------------------------------------------
    def step(self, inputs, targets, trace: bool = False, data_state=None) -> dict:
        """One training step on a global batch split along axis 0 into equal microbatches:
        `submit(...).result()`.

        Returns {"step", "loss" (mean over microbatches), "step_s"} plus "grad_norm" when
        clipping and, with trace=True, "events": per slice, the timed tasks and transfers,
        "held": per slice, (most receives outstanding at once, their most bytes), and
        "peak_bytes": per slice, the most bytes of its buffers and outstanding receives.
        `data_state` (JSON-able) is saved with the checkpoint this step may trigger.

        With memory_every=k, every k-th step also snapshots every slice's state in host
        memory, copied to a peer slice (mpmd/train/snapshots.py); "checkpoint" in the metrics lists
        the tiers this step saved to ("memory", "persistent").

        If a slice is lost during the step (or the step stalls past the cluster's step
        timeout), the Trainer replaces it, restores the newest saved state (the in-memory
        snapshot when one survives, else the last committed checkpoint) and raises `Rewound`
        (see mpmd/train/checkpoints.py), which says which tier it used. A slice that fails at an instruction raises
        mpmd.runtime.control.cluster.StepFailed, which is not recovered from: a replay would fail alike.
        A checkpoint that failed to save is retried (waited for) after the next step;
        CheckpointError once its retries are spent.
        """
        return self.submit(inputs, targets, trace, data_state).result()

    def submit(self, inputs, targets, trace: bool = False, data_state=None) -> PendingStep:
        """Send one training step and return at once; `.result()` of the PendingStep gives
        what `step` returns (and raises what it raises). Steps are collected oldest first;
        collecting a step collects those before it. Submitting collects the oldest step first
        when `run_ahead` steps beyond it are in flight already, and every step in flight when
        the newest is a checkpoint step or a failed save awaits its retry (see the module
        docstring); a Rewound can therefore come from here too: the batch was not sent."""
        self._check_open()
        while len(self._pending) > self.run_ahead:
            self._pending[0].result()
        if self._pending and (self._saves_after(self._pending[-1].number) or self._retry_due()):
            self._collect_all()
        number = self._step + len(self._pending) + 1
        try:
            launched = self._launch("train", inputs, targets, trace)
        except WorkerLost as e:      # shipping programs (the first step of a layout) found a slice gone
            self._discard_pending()
            self._recover(e, time.perf_counter())
        snapshot = None
        if self.memory is not None and self.memory.due(number):
            # Sent right behind its step, so every slice snapshots the state after it before
            # the next step's update. One snapshot in flight at a time: it overwrites the
            # generation that is not the newest complete one (mpmd/train/snapshots.py).
            while any(p.snapshot is not None for p in self._pending):
                self._pending[0].result()
            snapshot = self.memory.launch(number, data_state)
        pending = PendingStep(self, number, launched, trace, data_state, time.perf_counter(), snapshot)
        self._pending.append(pending)
        return pending

    def _saves_after(self, number: int) -> bool:
        return bool(self.checkpoint_every) and number % self.checkpoint_every == 0

    def _retry_due(self) -> bool:
        return self.checkpoints is not None and self.checkpoints.failed()

    def _collect_all(self) -> None:
        """Collect every step in flight: other verbs must see the state after the last one."""
        if self._pending:
            self._pending[-1].result()

    def _finish(self, pending: PendingStep) -> dict:
        """Collect `pending` (the oldest step in flight), count its update, log nothing (the
        caller does), and start the checkpoint it triggers. Raises Rewound after a lost slice."""
        assert self._pending and self._pending[0] is pending, "steps are collected oldest first"
        self._attempted = pending.number
        try:
            results = pending.launched.result()
            if pending.snapshot is not None:
                self.memory.finish(pending.snapshot)
        except WorkerLost as e:
            self._discard_pending()
            self._recover(e, max(pending.submitted_at, self._last_collected_at))
        except BaseException:
            self._discard_pending()
            raise
        self._pending.pop(0)
        start = max(pending.submitted_at, self._last_collected_at)
        self._last_collected_at = time.perf_counter()
        self._last_step_s = self._last_collected_at - start
        self._step += 1
        self.relayout.collected(self._step, self._last_step_s)
        metrics = self._metrics(results, pending.trace)
        # A retry is a save of the state at hand: only once no later step is in flight.
        retry = not self._pending and self._retry_due()
        tiers = ["memory"] if pending.snapshot is not None else []
        if retry or self._saves_after(self._step):
            assert not self._pending, "a checkpoint step is never run ahead of"
            self.save(pending.data_state, wait=retry)
            tiers.append("persistent")
            if self.relayout.narrow:
                self.relayout.grow_back(pending.data_state)
        if tiers:
            metrics["checkpoint"] = tiers
        return metrics

    def _discard_pending(self) -> None:
        """Forget every step in flight (the cluster aborted them with the failed one)."""
        for p in self._pending:
            p.discarded = True
        self._pending = []

    @property
    def in_flight(self) -> int:
        """Steps submitted and not yet collected."""
        return len(self._pending)

    @property
    def step_count(self) -> int:
        """Updates applied so far (restored ones included)."""
        return self._step

    def save(self, data_state=None, wait: bool = False, **extra) -> None:
        """Checkpoint the state after the current step, with `data_state` (JSON-able: where the
        data loader stands) in the manifest. Asynchronous unless `wait` or the Trainer's
        async_checkpoint=False; a waited-for save that fails is retried, then raises
        CheckpointError. A slice lost while saving (or, waited for, before the step committed)
        is recovered as in `step`: Rewound says where to resume; save again after replaying."""
        self._check_open()
        if self.checkpoints is None:
            raise ValueError("this Trainer has no run_dir to save checkpoints in")
        self._collect_all()
        batch = {"batch": self._batch} if self._batch is not None else {}
        try:
            self.checkpoints.save(self._step, data_state, {**self._checkpoint_metadata, **batch, **extra}, wait=wait)
        except WorkerLost as e:
            self._recover(e, time.perf_counter())

    def _recover(self, lost: WorkerLost, failed_since: float):
        """Replace the lost slice, or go on without it (on_loss), restore every slice from the
        newest state saved (the in-memory tier's snapshot, else the last committed checkpoint,
        else the initial state), and tell the caller where to resume by raising Rewound. A
        slice lost while recovering is handled alike (each counts against max_restarts).
        `failed_since`: when the attempt that failed started (perf_counter)."""
        t0 = time.perf_counter()
        self.relayout.failed(t0 - failed_since)
        replace_s = relayout_s = 0.0
        moved = []        # the layouts moved to (a slice may go while moving)
        while True:
            self.restarts += 1
            last = self.checkpoints.latest() if self.checkpoints is not None else None
            committed = f"last committed checkpoint: {'step ' + str(last) if last is not None else 'none'}"
            if self.restarts > self.max_restarts:
                raise RuntimeError(f"{lost}; giving up after {self.restarts - 1} recoveries (max_restarts="
                                   f"{self.max_restarts}); {committed}") from lost
            if self.checkpoints is not None:
                self.checkpoints.wait()
            try:
                t1 = time.perf_counter()
                try:
                    replaced = self.relayout.replace(lost, committed)
                finally:
                    replace_s += time.perf_counter() - t1
                if not replaced:
                    t1 = time.perf_counter()
                    try:
                        moved.append(self.relayout.shrink(lost, committed))
                    finally:
                        relayout_s += time.perf_counter() - t1
                t_restore = time.perf_counter()
                tier, step, data_state = self._restore_newest()
                break
            except WorkerLost as again:      # another slice went while replacing or restoring
                lost = again
        replayed = max(self._attempted, self._step) - step
        self.relayout.replays(max(self._attempted, self._step))
        self._step = step
        moved = [self.relayout.event(m["why"], m["slowdown"]) for m in moved]   # now that `step` is known
        restore_s = time.perf_counter() - t_restore
        self.relayout.recovered(replace_s, relayout_s, restore_s, replayed)
        self.recovery_s = {"replace_s": replace_s, "relayout_s": relayout_s, "restore_s": restore_s,
                           "total_s": time.perf_counter() - t0, "tier": tier, "replayed": replayed,
                           "layout": moved[-1] if moved else None}
        raise Rewound(step, data_state, str(lost), tier, replayed)

    @property
    def layout_changes(self) -> list[dict]:
        """One record per move between layouts (mpmd/train/relayout.py), oldest first."""
        return self.relayout.changes

    def goodput(self) -> dict:
        """Time lost to failures and run at reduced width, so far (Relayout.goodput)."""
        return self.relayout.goodput()

    def _restore_newest(self) -> tuple[str, int, object]:
        """(tier, step, data_state) after putting every slice back at the newest saved state.

        Raises CheckpointError when checkpoints exist but none restores: never train on from
        a state that is neither saved nor the initial one."""
        gen = self.memory.restorable() if self.memory is not None else None
        last = self.checkpoints.latest() if self.checkpoints is not None else None
        if gen is not None and (last is None or gen.step >= last):
            self.memory.restore()
            return "memory", gen.step, gen.data_state
        if self.memory is not None:
            self.memory.forget()
        restored = self.checkpoints.restore_latest() if self.checkpoints is not None else None
        if restored is None:   # nothing committed yet: back to the initial state
            self._materialize()
            for suffix, _ in list(self._compiled.values())[:1]:
                self._run_setup("init" + suffix)
            self._opt_ready = bool(self._compiled)   # else the next compile creates it
            tier, step, data_state = "initial", 0, None
        else:
            step, manifest = restored
            tier, data_state = "persistent", manifest.get("data_state")
            self._opt_ready = True
        if self.memory is not None and (tier == "persistent" or self._compiled):   # opt state exists
            self.memory.snapshot(step, data_state)    # the replacement holds a copy again
        return tier, step, data_state

    def grads(self, inputs, targets) -> tuple[float, list]:
        """(loss, per-stage gradient state) of a batch, without updating anything.

        The gradient is that of the mean loss over the whole batch, as jax.grad of the
        unpipelined model gives it; for checking a pipeline against plain JAX.
        """
        results = self._run("grads", inputs, targets, False)
        loss = self._metrics(results, False)["loss"]
        out = []
        for k, fn in enumerate(self.pipeline.fns):
            leaves = self.cluster.get(self.placement[k], [names.grads(k)])[names.grads(k)]
            out.append(jax.tree.unflatten(fn.param_tree, list(leaves)))
        return loss, out

    def evaluate(self, inputs, targets) -> float:
        """Mean loss of a batch through a forward-only plan: no backward, no update."""
        results = self._run("eval", inputs, targets, False)
        return self._metrics(results, False)["loss"]

    def predict(self, inputs, targets_like=None):
        """The last stage's output for a batch (forward only), concatenated over microbatches.

        `targets_like` gives the targets' shape when the plan is first compiled (defaults to
        the inputs' own shape and dtype); predictions do not read targets.
        """
        targets = inputs if targets_like is None else targets_like
        self._run("predict", inputs, targets, False, feed_targets=False)
        m, last = self.num_microbatches, self.placement[-1]
        outputs = [names.output(j) for j in range(m)]
        got = self.cluster.get(last, outputs)
        self.cluster.delete(last, outputs)
        return [np.concatenate(parts, axis=0) for parts in zip(*(got[n] for n in outputs))]

    def _run(self, plan: str, inputs, targets, trace: bool, feed_targets: bool = True):
        """Run a plan that is not a training step, after every step in flight."""
        self._collect_all()
        t0 = time.perf_counter()
        try:
            launched = self._launch(plan, inputs, targets, trace, feed_targets)
            t0 = time.perf_counter()
            results = launched.result()
        except WorkerLost as e:
            self._recover(e, t0)
        self._last_step_s = time.perf_counter() - t0
        return results

    def _launch(self, plan: str, inputs, targets, trace: bool, feed_targets: bool = True):
        """Compile if needed and send `plan` with the batch's microbatches; the cluster's
        PendingRun."""
        self._check_open()
        in_spec, tgt_spec = self._micro_specs(inputs, targets)
        if plan == "train":
            self._check_batch([[list(np.shape(l)), np.result_type(l).name] for l in jax.tree.leaves((inputs, targets))])
        suffix = self._compile(in_spec, tgt_spec)
        if plan == "train":
            self._train_specs = (in_spec, tgt_spec)
        m = self.num_microbatches
        first, last = self.placement[0], self.placement[-1]
        feeds: dict[int, dict] = {first: {}, last: {}} if first != last else {first: {}}
        for j, mb in enumerate(_split(inputs, m)):
            feeds[first][names.inputs(j)] = jax.tree.leaves(mb)
        for j, mb in enumerate(_split(targets, m) if feed_targets else ()):
            feeds[last][names.targets(j)] = jax.tree.leaves(mb)
        self._runs += 1
        fetch = {"train": self._lowered.fetch, "predict": {}}.get(plan, self._lowered.loss_fetch)
        return self.cluster.launch(plan + suffix, self._runs, feeds, fetch, trace)

    def _check_batch(self, batch: list) -> None:
        """A resumed run trains on the global batch its checkpoint was trained on (another
        batch changes the math); noted for the next checkpoint."""
        if self._resumed_batch is not None and batch != self._resumed_batch:
            show = lambda b: ", ".join(f"{'x'.join(map(str, shape))} {dtype}" for shape, dtype in b)
            raise ValueError(f"the global batch is {show(batch)} (per input and target leaf), but the "
                             f"checkpoint this run resumed from (step {self.resumed[0]}) was trained on "
                             f"{show(self._resumed_batch)}: resume with the same global batch")
        self._batch = batch

    def _metrics(self, results, trace: bool) -> dict:
        m, last = self.num_microbatches, self.placement[-1]
        step_s = self._last_step_s
        losses = [results[last].fetched[names.loss(j)][0] for j in range(m)]
        metrics = {"step": self._step, "loss": float(np.mean(np.asarray(losses, np.float64))), "step_s": step_s}
        if self.max_grad_norm is not None and names.sqnorm(0) in results[0].fetched:
            sq = [results[0].fetched[names.sqnorm(k)][0] for k in range(self.pipeline.num_stages)]
            metrics["grad_norm"] = float(np.sqrt(np.sum(np.asarray(sq, np.float64))))
        if trace:
            metrics["events"] = [r.events for r in results]
            metrics["held"] = [(r.peak_held, r.peak_held_bytes) for r in results]
            metrics["peak_bytes"] = [r.peak_bytes for r in results]
        return metrics

    def params(self) -> list:
        """Per stage, its nnx.Param state with host (numpy) arrays, fetched from its slice."""
        self._check_open()
        self._collect_all()
        out = []
        for k, fn in enumerate(self.pipeline.fns):
            leaves = self.cluster.get(self.placement[k], [names.params(k)])[names.params(k)]
            out.append(jax.tree.unflatten(fn.param_tree, list(leaves)))
        return out

    def close(self, close_cluster: bool = True) -> None:
        """Release the slices; with close_cluster=False the cluster's workers stay up for the
        next Trainer (its state is dropped when that Trainer starts it). A checkpoint still
        being written is committed first."""
        if not self._closed:
            try:
                self._collect_all()    # a step sent is a step done: its update and checkpoint land
            except Exception:          # closing after a failure: nothing left to collect
                self._discard_pending()
            self._closed = True
            if self.checkpoints is not None:
                self.checkpoints.wait()
            if close_cluster:
                self.cluster.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this Trainer is closed")


class PendingStep:
    """A training step sent to the slices (Trainer.submit) and not yet collected."""

    def __init__(self, trainer: Trainer, number: int, launched, trace: bool, data_state, submitted_at: float,
                 snapshot=None):
        self.number = number          # the step count once its update has landed
        self.launched = launched      # the cluster's PendingRun
        self.snapshot = snapshot      # the in-memory snapshot sent right behind it, if due
        self.trace = trace
        self.data_state = data_state
        self.submitted_at = submitted_at
        self.discarded = False        # an earlier step's failure dropped it
        self._trainer = trainer
        self._metrics: dict | None = None

    def result(self) -> dict:
        """The step's metrics (Trainer.step's); collects the steps before it first."""
        if self.discarded:
            raise RuntimeError(f"step {self.number} was discarded: a step before it failed or was rewound "
                               f"(nothing of it was applied); resume where the Rewound said")
        while self._metrics is None:
            if self not in self._trainer._pending:      # its collection raised (e.g. its save)
                raise RuntimeError(f"step {self.number} was collected and raised; see that error")
            oldest = self._trainer._pending[0]
            metrics = self._trainer._finish(oldest)
            oldest._metrics = metrics
        return self._metrics


def _schedule(schedule, num_stages: int, num_microbatches, virtual_stages) -> schedules.Schedule:
    """The validated schedule: built by name, or a Schedule given as data (its own placement),
    which must fit the pipeline and agree with any counts also given."""
    if isinstance(schedule, schedules.Schedule):
        for field, given in (("num_microbatches", num_microbatches), ("virtual_stages", virtual_stages)):
            if given is not None and given != getattr(schedule, field):
                raise ValueError(f"{field}={given!r} disagrees with the given schedule's "
                                 f"{field}={getattr(schedule, field)}; leave it out")
        if schedule.num_stages != num_stages:
            raise ValueError(f"schedule {schedule.name!r} is for {schedule.num_stages} stages, the "
                             f"pipeline has {num_stages}")
        schedules.validate(schedule)
        return schedule
    num_microbatches = 1 if num_microbatches is None else num_microbatches
    if virtual_stages is None:
        virtual_stages = schedules.default_virtual_stages(schedule) if isinstance(schedule, str) else 1
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1 or num_stages % virtual_stages:
        raise ValueError(f"num_stages ({num_stages}) must be divisible by virtual_stages ({virtual_stages}); "
                         f"allowed virtual_stages: {[v for v in range(1, num_stages + 1) if num_stages % v == 0]}")
    built = schedules.make(schedule, num_stages, num_microbatches, virtual_stages)
    schedules.validate(built)
    return built


def _split(tree, m: int) -> list:
    leaves, treedef = jax.tree.flatten(tree)
    parts = [np.split(np.asarray(l), m, axis=0) for l in leaves]
    return [jax.tree.unflatten(treedef, [p[j] for p in parts]) for j in range(m)]
