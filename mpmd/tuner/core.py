"""`mpmd.tune`: choose the split, schedule, microbatch count and virtual stages of a
pipeline from measured costs, under a per-slice memory cap, and confirm the best on the
cluster.

    result = mpmd.tune(model.layers(), models.lm_loss, optax.adamw(1e-3), inputs, targets,
                       cluster=mpmd.LocalCluster(num_workers=2), num_slices=2)
    best = result.ranked[0]          # a Candidate: schedule, num_stages, virtual_stages, ...
    stages = mpmd.stages.split.cut(model.layers(), best.cuts)

Three passes, each its own module: profile the units on the cluster (mpmd/tuner/profile.py),
search the space with the simulator (mpmd/tuner/search.py), then run the `confirm` best for a
few real steps each on the same cluster and measure their step time and peak memory
(the workers' own count of bytes held: Trainer.step(trace=True)["peak_bytes"]). The
winner is the confirmed candidate with the fastest measured step.

`units` are the smallest pieces a stage is cut from: a model's `layers()`, or a user's own
stages (then a tuned stage is a run of consecutive user stages).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from mpmd.schedules import core as schedules
from mpmd.tuner import search as tune_search
from mpmd.stages.split import cut
from mpmd.tuner.profile import Profile, profile as measure_profile
from mpmd.tuner.search import Candidate


class Confirmed(NamedTuple):
    candidate: Candidate
    measured_step_s: float
    measured_peak_bytes: int  # the most any slice held (workers' count)


class TuneResult(NamedTuple):
    ranked: list[Candidate]  # fastest predicted first, all within the memory cap
    excluded: list[Candidate]  # over the memory cap
    confirmed: list[Confirmed]  # in ranked order
    profile: Profile
    search_s: float  # seconds the search took

    @property
    def best(self) -> Candidate:
        """The confirmed candidate with the fastest measured step (else the best predicted)."""
        if self.confirmed:
            return min(self.confirmed, key=lambda c: c.measured_step_s).candidate
        return self.ranked[0]

    def table(self) -> str:
        """The confirmed candidates: predicted against measured step and peak memory."""
        rows = [f"{'candidate':<52} {'pred step':>10} {'meas step':>10} {'err':>6} {'pred MiB':>9} {'meas MiB':>9}"]
        for c in self.confirmed:
            err = (c.candidate.predicted_step_s - c.measured_step_s) / c.measured_step_s
            mark = " *" if c.candidate == self.best else ""
            rows.append(
                f"{c.candidate.label:<52} {c.candidate.predicted_step_s * 1e3:>8.1f}ms "
                f"{c.measured_step_s * 1e3:>8.1f}ms {100 * err:>+5.0f}% "
                f"{max(c.candidate.peak_bytes) / 2**20:>9.1f} {c.measured_peak_bytes / 2**20:>9.1f}{mark}"
            )
        return "\n".join(rows)


def _check(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def tune(
    units,
    loss_fn,
    optimizer,
    inputs,
    targets,
    cluster,
    num_slices: int,
    memory_gb: float | None = None,
    confirm: int = 3,
    confirm_steps: int = 5,
    microbatch_counts=None,
    schedule_names=None,
    max_virtual_stages: int = 4,
    max_grad_norm: float | None = None,
    profile: Profile | None = None,
    log=print,
) -> TuneResult:
    """Profile, search and confirm (see the module doc). `inputs`/`targets`: one global batch
    (its rows set the batch size); `cluster`: started with `num_slices` slices and left open
    (the caller closes it); `memory_gb`: per-slice cap (None: no cap); `confirm`: how many of
    the best to run for real (0: none); `profile`: a Profile to use instead of measuring."""
    units = list(units)
    batch = len(inputs)
    _check("num_slices", num_slices, 1)
    _check("confirm", confirm, 0)
    _check("confirm_steps", confirm_steps, 1)
    _check("max_virtual_stages", max_virtual_stages, 1)
    if num_slices > len(units):
        raise ValueError(f"num_slices={num_slices} needs at least as many units, got {len(units)}")
    if memory_gb is not None and (
        isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not memory_gb > 0
    ):
        raise ValueError(f"memory_gb must be a number > 0 (GiB per slice) or None, got {memory_gb!r}")
    counts = microbatch_counts_for(batch, microbatch_counts)
    if schedule_names is not None:
        unknown = sorted(set(schedule_names) - set(schedules.SCHEDULES))
        if unknown or not schedule_names:
            raise ValueError(
                f"schedule_names must be a non-empty list of {sorted(schedules.SCHEDULES)}, "
                f"got {list(schedule_names)!r}"
            )
    if profile is None:
        profile = measure_profile(
            units,
            loss_fn,
            optimizer,
            inputs,
            targets,
            cluster,
            num_slices,
            sorted({batch // m for m in counts}),
            max_grad_norm=max_grad_norm,
            log=log,
        )
    t0 = time.perf_counter()
    cap = float("inf") if memory_gb is None else memory_gb * 2**30
    ranked, excluded = tune_search.search(
        profile, num_slices, batch, cap, counts, schedule_names, max_virtual_stages, keep=max(10, confirm)
    )
    search_s = time.perf_counter() - t0
    log(f"searched {len(ranked)} ranked + {len(excluded)} over the memory cap in {search_s:.2f} s")
    if not ranked:
        smallest = min(max(c.peak_bytes) for c in excluded) / 2**30
        raise tune_search.NoCandidateFits(
            f"no candidate fits memory_gb={memory_gb:.3g}: the smallest predicted peak is {smallest:.3f} GiB per slice"
        )
    confirmed = [
        run_candidate(c, units, loss_fn, optimizer, inputs, targets, cluster, confirm_steps, max_grad_norm, log)
        for c in ranked[:confirm]
    ]
    return TuneResult(ranked, excluded, confirmed, profile, search_s)


def microbatch_counts_for(batch_size: int, microbatch_counts=None) -> list[int]:
    """The microbatch counts to try: those given (each must divide the batch), else every
    divisor of the batch size."""
    divisors = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
    if microbatch_counts is None:
        return divisors
    bad = [m for m in microbatch_counts if isinstance(m, bool) or not isinstance(m, int) or m not in divisors]
    if bad or not microbatch_counts:
        raise ValueError(
            f"microbatch counts must be a non-empty list of divisors of the batch size "
            f"{batch_size} ({divisors}), got {list(microbatch_counts)!r}"
        )
    return sorted(set(microbatch_counts))


def run_candidate(
    candidate: Candidate, units, loss_fn, optimizer, inputs, targets, cluster, steps: int, max_grad_norm=None, log=print
) -> Confirmed:
    """Train `candidate` for two warm-up steps, `steps` timed steps and one traced step on
    `cluster`. The first warm-up step compiles; the second still ran slower than the steps
    after it (by 6-60 % in 8 of 12 runs of gpt_small on 4 workers, 2026-12-05), and one
    warm-up let it into the median. The step time is the median of the timed steps' (a step
    returns once its loss is back while its update may still run, so each waits for the one
    before: in a row, each takes one step's time; the median shrugs off a burst of other
    load), the peak the workers' largest count of bytes held in the traced step."""
    from mpmd.stages.pipeline import Pipeline
    from mpmd.train.trainer import Trainer

    pipe = Pipeline(cut(units, candidate.cuts), loss_fn)
    trainer = Trainer(
        pipe,
        optimizer,
        schedule=candidate.schedule,
        num_microbatches=candidate.num_microbatches,
        virtual_stages=candidate.virtual_stages,
        cluster=cluster,
        max_grad_norm=max_grad_norm,
    )
    try:
        for _ in range(2):
            trainer.step(inputs, targets)
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            trainer.step(inputs, targets)
            times.append(time.perf_counter() - begin)
        traced = trainer.step(inputs, targets, trace=True)
    finally:
        trainer.close(close_cluster=False)
    peak = int(max(traced["peak_bytes"]))
    step_s = float(np.median(times))
    log(
        f"confirmed {candidate.label}: predicted {candidate.predicted_step_s * 1e3:.1f} ms, "
        f"measured {step_s * 1e3:.1f} ms"
    )
    return Confirmed(candidate, step_s, peak)


def mean_abs_error(confirmed) -> float:
    """Mean |predicted - measured| / measured over confirmed candidates."""
    return (
        float(np.mean([abs(c.candidate.predicted_step_s - c.measured_step_s) / c.measured_step_s for c in confirmed]))
        if confirmed
        else float("nan")
    )
