"""The Trainer's programs on the slices: the layout in force, what was lowered and shipped
for it, and the runs that use them.

The layout in force is a schedule (stages -> slices, the order of tasks) and each slice's
mesh with every stage's state laid out on it (mpmd.lowering.core.Layout). Programs are
compiled once per microbatch shape (the training batch, a sampling batch, ...):
`compile(specs, pair)` lowers the pipeline for those shapes, ships each slice its
programs and plans under a suffix naming the shape (names.variant), so several shapes live
side by side on the slices, and the first compile creates the optimizer state there. A move
to another layout (mpmd/train/relayout.py) forgets what was shipped, since every slice
starts afresh; lowerings are kept by (schedule, placement, meshes, shapes), so a layout moved
back to ships its programs again without lowering and exporting them anew.

Every cluster run gets a fresh id from `launch` (transfer keys must never repeat): the
training steps, the setup plans and the in-memory snapshots all go through it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpmd.lowering import core as lowering
from mpmd.runtime.worker.instructions import Run
from mpmd.schedules import core as schedules
from mpmd.stages import abstract, names
from mpmd.stages import batch as batches

PLANS = ("train", "grads", "eval", "predict", "init")  # installed per microbatch shape
PUT_BYTES = 64 << 20  # init_params' arrays are read and sent in parts of at most this


class Programs:
    """What the slices of `cluster` hold for `pipeline` under the layout in force, starting
    from `run` (mpmd/train/layout.py: the schedule, each slice's mesh, every stage's
    layouts, the checked logical-axis rules and where FSDP weights are gathered)."""

    def __init__(
        self,
        pipeline,
        optimizer,
        cluster,
        run,
        *,
        max_grad_norm=None,
        recv_window: int | None = None,
        init_params=None,
    ):
        self.pipeline, self.optimizer, self.cluster = pipeline, optimizer, cluster
        self._init_params = init_params  # a stage's parameter paths -> their initial arrays, or None
        self._max_grad_norm, self._recv_window = max_grad_norm, recv_window
        self._schedule, self._layout = run.schedule, run.layout
        self._compiled: dict = {}  # microbatch shapes -> (name suffix, Lowered), shipped to the slices
        self._lowerings: dict = {}  # (schedule, placement, meshes, microbatch shapes) -> Lowered
        self._lowered = None  # the Lowered of the shapes compiled last
        self._train_specs = None  # a training microbatch's BatchPlan (mpmd/stages/batch.py)
        self._opt_ready = False  # the slices hold optimizer state
        self._runs = 0

    # -- the layout in force ---------------------------------------------------------------
    @property
    def schedule(self) -> schedules.Schedule:
        return self._schedule

    @property
    def placement(self) -> tuple[int, ...]:
        """stage -> slice"""
        return self._schedule.placement

    @property
    def num_slices(self) -> int:
        return self._schedule.num_slices

    @property
    def layout(self) -> lowering.Layout:
        return self._layout

    def layout_for(self, schedule: schedules.Schedule, meshes) -> lowering.Layout:
        """Every stage's state laid out on `meshes` under `schedule`'s placement; ValueError
        naming a parameter a mesh axis does not divide."""
        lay = self._layout
        return lowering.layout(self.pipeline, self.optimizer, meshes, schedule.placement, lay.rules, lay.fsdp_gather)

    def move_to(self, schedule: schedules.Schedule, layout: lowering.Layout) -> None:
        """The cluster was resized to `schedule`'s slices, each started afresh: nothing shipped
        is there any more, nor any state (the caller restores it)."""
        self._schedule, self._layout = schedule, layout
        self._compiled, self._lowered, self._opt_ready = {}, None, False

    # -- what the slices hold ----------------------------------------------------------------
    @property
    def lowered(self) -> lowering.Lowered | None:
        """The programs and plans of the microbatch shapes compiled last."""
        return self._lowered

    @property
    def train_specs(self):
        """A training microbatch's BatchPlan (its specs and where they go), once a training
        step was compiled."""
        return self._train_specs

    @property
    def opt_state_ready(self) -> bool:
        """Whether the slices hold optimizer state (created by the first compile, or restored)."""
        return self._opt_ready

    def state_restored(self) -> None:
        """Every slice's parameters and optimizer state were restored from a checkpoint."""
        self._opt_ready = True

    def launch(self, plan: str, feeds: dict | None = None, fetch: dict | None = None, trace: bool = False):
        """Send `plan` to every slice behind whatever is in flight, with a fresh run id; the
        cluster's PendingRun."""
        self._runs += 1
        return self.cluster.launch(plan, self._runs, feeds or {}, fetch or {}, trace)

    def run_setup(self, plan: str) -> None:
        """Run a plan that takes no feeds and returns nothing: it creates state on the slices."""
        self.launch(plan).result()

    def materialize(self, pretrained: bool = True) -> None:
        """Put each stage's initial parameters on its slice, laid out on its mesh: those
        init_params gives (read for one stage at a time; unless not `pretrained`: a
        checkpoint is about to replace them), else the module's own values,
        shipped once, or for an abstract model (mpmd.abstract) created there, already
        sharded, by its seeded init; and its initial stage state, if any (an abstract
        model's made there by the same init, which then makes only what is not given)."""
        plans: dict[int, list] = {}
        for k, (fn, stage) in enumerate(zip(self.pipeline.fns, self.pipeline.stages)):
            r = self.placement[k]
            state = fn.state is not None
            given = self._init_params is not None and pretrained
            concrete = not abstract.is_abstract(fn.param_leaves)
            layouts = [tuple(p) for p in self._layout.params[k]]
            if given:
                # Read and sent in parts of at most PUT_BYTES: the controller holds one part
                # (and its message) at a time, never a whole stage.
                for i, (start, arrays) in enumerate(self._given_params(k)):
                    part = layouts[start : start + len(arrays)]
                    self.cluster.put(r, names.params(k), arrays, part, append=i > 0)
            elif concrete:
                self.cluster.put(r, names.params(k), fn.param_leaves, layouts)
            if concrete:
                if state:  # stage state: replicated on the slice's mesh
                    self.cluster.put(r, names.stage_state(k), fn.state.leaves, [()] * len(fn.state.leaves))
                continue
            if not given or state:
                # Created on the slice by the model's seeded init, parameters already sharded
                # (unless given), stage state (replicated) with them.
                init = names.program("init_params", k)
                mesh = self._layout.meshes[r].abstract()
                shardings = [jax.sharding.NamedSharding(mesh, p) for p in self._layout.params[k]] if not given else None
                replicated = (
                    [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())] * len(fn.state.leaves)
                    if state
                    else None
                )
                self.cluster.load_programs(
                    r, {init: abstract.init_program(stage, fn.param_tree, shardings, replicated)}
                )
                made = ((names.params(k),) if not given else ()) + ((names.stage_state(k),) if state else ())
                plans.setdefault(r, []).append(Run(init, (), made, f"init params s{k}"))
        if plans:
            for r in range(self.num_slices):
                self.cluster.install_plan(r, "init_params", plans.get(r, []))
            self.run_setup("init_params")

    def _given_params(self, k: int):
        """Stage k's initial parameters from init_params, in parts of at most PUT_BYTES (a
        larger leaf alone): (index of the part's first leaf, its arrays), each checked against
        the stage's own shapes and dtypes (ValueError naming the first that differs)."""
        fn, paths = self.pipeline.fns[k], self.pipeline.param_paths[k]
        sizes = [int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in fn.param_leaves]
        if not paths:
            yield 0, []  # a stage without parameters still binds its (empty) buffer
        start = 0
        while start < len(paths):
            end, size = start + 1, sizes[start]
            while end < len(paths) and size + sizes[end] <= PUT_BYTES:
                size, end = size + sizes[end], end + 1
            given = [np.asarray(a) for a in self._init_params(tuple(paths[start:end]))]
            if len(given) != end - start:
                raise ValueError(
                    f"init_params gave {len(given)} arrays for {end - start} parameters of stage {k} "
                    f"({paths[start]}...)"
                )
            for path, array, leaf in zip(paths[start:end], given, fn.param_leaves[start:end]):
                if array.shape != tuple(leaf.shape) or array.dtype != leaf.dtype:
                    raise ValueError(
                        f"init_params gave {path} as {array.dtype.name}{list(array.shape)}; stage {k} "
                        f"holds it as {jnp.dtype(leaf.dtype).name}{list(leaf.shape)}"
                    )
            yield start, given
            start = end

    def reset_state(self) -> None:
        """Back to the initial state: the initial parameters again, and fresh optimizer state
        if programs were compiled (else the next compile creates it)."""
        self.materialize()
        for suffix, *_ in list(self._compiled.values())[:1]:
            self.run_setup("init" + suffix)
        self._opt_ready = bool(self._compiled)

    def compile(self, specs: dict, pair: bool, training: bool) -> tuple[str, batches.BatchPlan]:
        """Lower and ship the programs for one microbatch of these shapes ({batch key: specs},
        mpmd/stages/batch.py; `pair`: given as inputs and targets) once; returns the suffix
        naming that shape's programs and plans, and where the batch's keys go. `training`:
        these are a training step's shapes (kept for pricing layouts, mpmd/train/relayout.py)."""
        key = (pair, jax.tree.structure(specs), tuple(jax.tree.leaves(specs)))
        if key in self._compiled:
            suffix, self._lowered, feeds = self._compiled[key]
        else:
            suffix = names.variant(len(self._compiled))
            feeds = batches.plan(self.pipeline, specs, pair)
            layout_key = (self._schedule.name, self.placement, tuple(self._layout.meshes), key)
            low = self._lowerings.get(layout_key)
            if low is None:
                low = self._lowerings[layout_key] = lowering.lower(
                    self.pipeline,
                    self._schedule,
                    self.optimizer,
                    self._max_grad_norm,
                    feeds.inputs,
                    feeds.targets,
                    self._layout,
                    self._recv_window,
                    feeds=feeds,
                )
            rename = lambda stream: stream.with_templates(
                lambda t: t._replace(program=t.program + suffix) if isinstance(t, Run) else t
            )
            for r in range(low.num_slices):
                self.cluster.load_programs(r, {name + suffix: spec for name, spec in low.programs[r].items()})
                for plan in PLANS:
                    self.cluster.install_plan(r, plan + suffix, rename(getattr(low, plan)[r]))
            if not self._opt_ready:  # first compile: create optimizer state on each slice
                self.run_setup("init" + suffix)
                self._opt_ready = True
            self._compiled[key] = (suffix, low, feeds)
            self._lowered = low
        if training:
            self._train_specs = feeds
        return suffix, feeds
