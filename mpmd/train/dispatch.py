"""The Trainer's step dispatcher: steps sent to the slices and collected, run ahead.

`submit` sends a step's Run (with its microbatches) and returns a PendingStep at once; each
slice queues it behind the step it is running, so the gap between steps (the controller
collecting results, the recipe logging, the next batch's dispatch) is hidden. At most
`run_ahead` steps are in flight beyond the oldest one: `submit` first collects the oldest
when there would be more. Everything else that touches the slices (save, evaluate, params,
...) first collects every step in flight, so it sees the state after the last submitted
step. A checkpoint step is never run ahead of: its successor is submitted only once the step
and its save are done, because the save snapshots the slices' state and must not see the
next step's update (the alternative, queueing the Save behind the Run on each worker, would
reorder the checkpoint verbs; this costs one step's overlap every `Checkpointing.every`
steps). An in-memory snapshot is sent right behind its step, one in flight at a time.

A lost slice discards the steps in flight behind the one that failed: none of their updates
is kept, none of their metrics is returned; `events.lost` (the Trainer's recovery) raises
the Rewound that says where to resume. A step whose loss or gradient norm is not finite is
never saved: the steps in flight behind it run out and are discarded (nothing may see the
slices while they run), and `events.nonfinite(step, metrics)` raises what the Trainer's
Recovery.on_nonfinite says (NonFinite, or Rewound after a rewind). Steps are counted here:
`step_count` is the updates applied so far, `rewind` puts it back after a restore.
"""

from __future__ import annotations

import time
from typing import NoReturn, Protocol

import jax
import numpy as np

from mpmd.runtime.control.cluster import WorkerLost
from mpmd.stages import batch as batches
from mpmd.stages import names


class StepEvents(Protocol):
    """What becomes of each step the dispatcher collects, loses or finds not finite; the
    Trainer's recovery policy (mpmd/train/relayout.py) implements it."""

    def collected(self, step: int, step_s: float, data_state, save: bool, retry: bool) -> None:
        """Step `step` was collected `step_s` after it started; `save` when it is a checkpoint
        step (`retry`: a failed save's retry, to be waited for)."""

    def lost(self, lost: WorkerLost, failed_since: float) -> NoReturn:
        """A slice was lost (`failed_since`: perf_counter when the failed attempt started):
        recover and raise Rewound."""

    def nonfinite(self, step: int, metrics: dict) -> NoReturn:
        """Step `step`'s loss or gradient norm is not finite (it is never saved): raise."""


class Dispatcher:
    """Steps of `programs` (mpmd/train/programs.py) on its slices; `checkpointer` says which
    steps save (mpmd/train/checkpointer.py); `events` (StepEvents, set once by the Trainer)
    hears what became of each step."""

    def __init__(self, programs, checkpointer, num_microbatches: int, num_stages: int, max_grad_norm, run_ahead: int):
        self._programs, self._checkpointer = programs, checkpointer
        self.num_microbatches, self._num_stages, self._max_grad_norm = num_microbatches, num_stages, max_grad_norm
        self.run_ahead = run_ahead
        self.events: StepEvents | None = None
        self.finite = True  # the state at hand comes from steps whose loss and grad norm were finite
        self._pending: list[PendingStep] = []  # submitted, not yet collected; oldest first
        self._last_collected_at = 0.0  # perf_counter when the last step was collected
        self._last_step_s = 0.0
        self._step = 0
        self._attempted = 0  # the step being computed (a failure replays from here)

    @property
    def step_count(self) -> int:
        """Updates applied so far (restored ones included)."""
        return self._step

    @property
    def attempted(self) -> int:
        """The newest step computed or being computed: a restore replays up to it."""
        return max(self._attempted, self._step)

    @property
    def in_flight(self) -> int:
        """Steps submitted and not yet collected."""
        return len(self._pending)

    def rewind(self, step: int) -> None:
        """Every slice holds the state after `step` now (restored)."""
        assert not self._pending, "rewound with steps in flight"
        self._step = step
        self.finite = True

    # -- training steps ----------------------------------------------------------------------
    def submit(self, batch: dict, pair: bool, trace: bool, data_state) -> PendingStep:
        """Send one training step and return at once (see the module docstring)."""
        while len(self._pending) > self.run_ahead:
            self._pending[0].result()
        if self._pending and (self._checkpointer.due(self._pending[-1].number) or self._checkpointer.retry_due()):
            self.collect_all()
        number = self._step + len(self._pending) + 1
        try:
            launched = self._launch("train", batch, pair, trace)
        except WorkerLost as e:  # shipping programs (the first step of a layout) found a slice gone
            self._discard()
            self.events.lost(e, time.perf_counter())
        snapshot = None
        if self._checkpointer.memory_due(number):
            # Sent right behind its step, so every slice snapshots the state after it before
            # the next step's update. One snapshot in flight at a time: it overwrites the
            # generation that is not the newest complete one (mpmd/train/snapshots.py).
            while any(p.snapshot is not None for p in self._pending):
                self._pending[0].result()
            snapshot = self._checkpointer.launch_snapshot(number, data_state)
        pending = PendingStep(self, number, launched, trace, data_state, time.perf_counter(), snapshot)
        self._pending.append(pending)
        return pending

    def result_of(self, pending: PendingStep) -> dict:
        """`pending`'s metrics, collecting the steps before it first."""
        if pending.discarded:
            raise RuntimeError(
                f"step {pending.number} was discarded: a step before it failed or was rewound "
                f"(nothing of it was applied); resume where the Rewound said"
            )
        while pending.metrics is None:
            if pending not in self._pending:  # its collection raised (e.g. its save)
                raise RuntimeError(f"step {pending.number} was collected and raised; see that error")
            oldest = self._pending[0]
            oldest.metrics = self._finish(oldest)
        return pending.metrics

    def collect_all(self) -> None:
        """Collect every step in flight: other verbs must see the state after the last one."""
        if self._pending:
            self._pending[-1].result()

    def discard(self) -> None:
        """Forget every step in flight (closing after a failure: nothing is left to collect)."""
        self._discard()

    def _finish(self, pending: PendingStep) -> dict:
        """Collect `pending` (the oldest step in flight), count its update and tell `events`
        (the checkpoint it triggers). Rewound after a lost slice."""
        assert self._pending and self._pending[0] is pending, "steps are collected oldest first"
        self._attempted = pending.number
        try:
            results = pending.launched.result()
            if pending.snapshot is not None:
                self._checkpointer.finish_snapshot(pending.snapshot)
        except WorkerLost as e:
            self._discard()
            self.events.lost(e, max(pending.submitted_at, self._last_collected_at))
        except BaseException:
            self._discard()
            raise
        self._pending.pop(0)
        start = max(pending.submitted_at, self._last_collected_at)
        self._last_collected_at = time.perf_counter()
        self._last_step_s = self._last_collected_at - start
        self._step += 1
        metrics = self.metrics(results, pending.trace)
        if not finite(metrics):  # never saved; the steps behind it run out, unused
            self.finite = False
            self._drain()
            self.events.nonfinite(self._step, metrics)
        # A retry is a save of the state at hand: only once no later step is in flight.
        retry = not self._pending and self._checkpointer.retry_due()
        save = retry or self._checkpointer.due(self._step)
        assert not (save and self._pending), "a checkpoint step is never run ahead of"
        self.events.collected(self._step, self._last_step_s, pending.data_state, save, retry)
        tiers = (["memory"] if pending.snapshot is not None else []) + (["persistent"] if save else [])
        if tiers:
            metrics["checkpoint"] = tiers
        return metrics

    def _drain(self) -> None:
        """Let every step in flight finish on the slices, then discard it (its metrics unread,
        never saved): the state is restored or the run ends after a non-finite step, and
        no other verb may reach a slice while a run is on it."""
        for p in self._pending:
            try:
                p.launched.result()
                if p.snapshot is not None:
                    self._checkpointer.finish_snapshot(p.snapshot)
            except Exception:  # a failure behind a non-finite step changes nothing
                pass
        self._discard()

    def lost_elsewhere(self, lost: WorkerLost) -> NoReturn:
        """A loss seen by another client of the cluster: the steps in flight are aborted with it."""
        self._discard()
        self.events.lost(lost, time.perf_counter())

    def _discard(self) -> None:
        """Forget every step in flight (the cluster aborted them with the failed one)."""
        for p in self._pending:
            p.discarded = True
        self._pending = []

    # -- other plans -----------------------------------------------------------------------
    def run(self, plan: str, batch: dict, pair: bool, trace: bool = False, feed_targets: bool = True) -> list:
        """Run a plan that is not a training step ("grads", "eval", "predict"), after every
        step in flight; the per-slice results."""
        self.collect_all()
        t0 = time.perf_counter()
        try:
            launched = self._launch(plan, batch, pair, trace, feed_targets)
            t0 = time.perf_counter()
            results = launched.result()
        except WorkerLost as e:
            self.events.lost(e, t0)
        self._last_step_s = time.perf_counter() - t0
        return results

    def _launch(self, plan: str, batch: dict, pair: bool, trace: bool, feed_targets: bool = True):
        """Compile if needed and send `plan` with the batch's microbatches, each key to the
        slices that read it (mpmd/stages/batch.py); the cluster's PendingRun."""
        m = self.num_microbatches
        specs = batches.micro_specs(batch, m)
        if plan == "train":
            self._checkpointer.check_batch(
                [[list(np.shape(l)), np.result_type(l).name] for l in jax.tree.leaves(batch)]
            )
        suffix, feeds_plan = self._programs.compile(specs, pair, training=plan == "train")
        placement = self._programs.placement
        feeds: dict[int, dict] = {r: {} for r in dict.fromkeys(placement)}
        micro = split(batch, m)
        for j, mb in enumerate(micro):
            feeds[placement[0]][names.inputs(j)] = jax.tree.leaves(mb[batches.INPUTS])
            for k, keys in enumerate(feeds_plan.side_keys):
                if keys:
                    feeds[placement[k]][names.side(k, j)] = jax.tree.leaves({key: mb[key] for key in keys})
            if feed_targets:
                told = mb[batches.TARGETS] if pair else {key: mb[key] for key in feeds_plan.loss_keys}
                feeds[placement[-1]][names.targets(j)] = jax.tree.leaves(told)
        lowered = self._programs.lowered
        fetch = {"train": lowered.fetch, "eval": lowered.eval_fetch, "predict": {}}.get(plan, lowered.loss_fetch)
        return self._programs.launch(plan + suffix, feeds, fetch, trace)

    def metrics(self, results, trace: bool) -> dict:
        """{"step", "loss", "step_s"}, "aux_loss" when stages add auxiliary losses (included in
        "loss"), "grad_norm" when clipping, "compiles" when a slice compiled during the step
        (its first, or the first after a replacement without a warm spare: executables XLA
        built or loaded from JAX's persistent compilation cache, all slices together;
        "cache_loads": how many of them were loaded), and with `trace` the events and peaks of every slice
        (Trainer.step). The loss is the mean over microbatches, or a weighted loss's
        sum(loss_sum) / sum(weight) over the step."""
        m, placement = self.num_microbatches, self._programs.placement
        io = self._programs.lowered.io
        fetched = results[placement[-1]].fetched
        losses = np.asarray([fetched[names.loss(j)][0] for j in range(m)], np.float64)
        loss = float(np.sum(losses) / float(fetched[names.weight_sum()][0])) if io.weighted else float(np.mean(losses))
        metrics = {"step": self._step, "loss": loss, "step_s": self._last_step_s}
        # Auxiliary losses, where the plan returns them (an evaluation's forwards do not).
        aux_stages = [
            k for k in range(self._num_stages) if io.adds_aux(k) and names.aux(k, 0) in results[placement[k]].fetched
        ]
        if aux_stages:
            aux = (
                sum(
                    float(
                        np.sum(
                            np.asarray(
                                [results[placement[k]].fetched[names.aux(k, j)][0] for j in range(m)], np.float64
                            )
                        )
                    )
                    for k in aux_stages
                )
                / m
            )
            metrics["aux_loss"], metrics["loss"] = aux, loss + aux
        if self._max_grad_norm is not None and names.sqnorm(0) in results[0].fetched:
            sq = [results[0].fetched[names.sqnorm(k)][0] for k in range(self._num_stages)]
            metrics["grad_norm"] = float(np.sqrt(np.sum(np.asarray(sq, np.float64))))
        compiles = sum(r.compiles for r in results)
        if compiles:
            metrics["compiles"] = compiles
            loads = sum(r.cache_loads for r in results)
            if loads:  # of them, executables loaded from JAX's persistent compilation cache
                metrics["cache_loads"] = loads
        if trace:
            metrics["events"] = [r.events for r in results]
            metrics["held"] = [(r.peak_held, r.peak_held_bytes) for r in results]
            metrics["peak_bytes"] = [r.peak_bytes for r in results]
        return metrics


def finite(metrics: dict) -> bool:
    """Whether a step's loss (and gradient norm, when clipping) is finite."""
    return all(np.isfinite(metrics[k]) for k in ("loss", "grad_norm") if k in metrics)


class PendingStep:
    """A training step sent to the slices (Trainer.submit) and not yet collected."""

    def __init__(
        self, dispatcher: Dispatcher, number: int, launched, trace: bool, data_state, submitted_at: float, snapshot=None
    ):
        self.number = number  # the step count once its update has landed
        self.launched = launched  # the cluster's PendingRun
        self.snapshot = snapshot  # the in-memory snapshot sent right behind it, if due
        self.trace = trace
        self.data_state = data_state
        self.submitted_at = submitted_at
        self.discarded = False  # an earlier step's failure dropped it
        self.metrics: dict | None = None  # set by the dispatcher once collected
        self._dispatcher = dispatcher

    def result(self) -> dict:
        """The step's metrics (Trainer.step's); collects the steps before it first."""
        return self._dispatcher.result_of(self)


def split(tree, m: int) -> list:
    """`tree` cut into m equal microbatches along axis 0."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [np.split(np.asarray(l), m, axis=0) for l in leaves]
    return [jax.tree.unflatten(treedef, [p[j] for p in parts]) for j in range(m)]
