"""The tuner's search: every (schedule, virtual stages, microbatch count) on p slices, its
stages cut at cost-balanced points of the profiled units, priced by the simulator with the
measured costs and transfer model, kept when every slice fits the memory cap.

    ranked, excluded = search(profile, num_slices=2, batch_size=32, memory_bytes=8 * 2**30)

Pricing a candidate (microbatch size = batch / m, the profile's costs at that size):
- cuts: mpmd.split.balanced_boundaries over each unit's F + B + W (the slowest stage sets
  the pace), into S = v * p stages;
- a stage's F, B, W: the sums over its units' compute (net of the per-program cost, which
  the profile measured and took out) plus the profile's task_gap_s once per task, whatever
  the stage's size: the executor walks one program; a schedule without split backward runs
  B + W as one task (one charge); the first stage's B runs nothing in a split backward (its
  W is its whole backward), as the runtime does (mpmd/lowering/dryrun.py); a stage's update
  is one program too (one charge);
- transfers: every cross-slice dependency waits latency + bytes / bandwidth, with the
  largest boundary's bytes (mpmd.schedules.simulate charges one figure per transfer);
- step: the latest slice's end plus that slice's optimizer updates, plus the measured
  per-step overhead; where slices share cores (the profile's core_groups), simulated with
  the cores shared among the slices running at each moment (mpmd.tuner.profile.shared_step_s);
- memory per slice: parameters and accumulated gradients and optimizer state of its stages,
  plus the schedule's peak of saved activations (mpmd.schedules.simulate.peak_saved_bytes: residuals
  from F until the last backward task, and in a split backward what B keeps for W). Not
  counted: activations in transit and XLA's temporaries.

The space is small (tens to a few hundred candidates), and each is one vectorised
simulation; candidates are taken in order of a lower bound (the busiest slice's work plus
its updates plus the overhead: no schedule beats it) and the walk stops once the bound
passes the `keep`-th best simulated step, so a large space costs little more than its best
`keep` candidates.
"""

from __future__ import annotations

from typing import NamedTuple

from mpmd.schedules import core as schedules
from mpmd.schedules.core import BACKWARD, FORWARD, WEIGHT
from mpmd.schedules.simulate import FULL_BACKWARD, peak_saved_bytes
from mpmd.stages.split import balanced_boundaries
from mpmd.tuner.profile import Profile, shared_step_s


class NoCandidateFits(ValueError):
    """Every candidate's predicted peak exceeds the memory cap."""


class Candidate(NamedTuple):
    schedule: str
    num_stages: int
    virtual_stages: int
    num_microbatches: int
    cuts: tuple[int, ...]  # unit index where each stage after the first begins
    predicted_step_s: float
    peak_bytes: tuple[int, ...]  # predicted, per slice

    @property
    def label(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{self.schedule}{v} S={self.num_stages} m={self.num_microbatches} cuts={list(self.cuts)}"

    def keys(self) -> dict:
        """The config keys that make this candidate (recipes' pipeline section)."""
        return {
            "pipeline.schedule": self.schedule,
            "pipeline.num_stages": self.num_stages,
            "pipeline.virtual_stages": self.virtual_stages,
            "pipeline.num_microbatches": self.num_microbatches,
            "pipeline.cuts": list(self.cuts),
        }


class _Priced(NamedTuple):
    schedule: schedules.Schedule
    costs: list
    updates: list
    comm_s: float
    bounds: list
    peak_bytes: tuple
    lower_bound_s: float


def space(
    profile: Profile,
    num_slices: int,
    batch_size: int,
    microbatch_counts=None,
    schedule_names=None,
    max_virtual_stages: int = 4,
):
    """(schedule name, virtual_stages, num_microbatches) of every combination to try: every
    schedule, microbatch counts dividing the batch whose size was profiled, and as many
    stages per slice (each schedule's spec range, an open one up to max_virtual_stages:
    interleaved 2..max_virtual_stages, V schedules 2, others 1) as the units allow."""
    names = list(schedules.SCHEDULES) if schedule_names is None else list(schedule_names)
    counts = (
        [m for m in range(1, batch_size + 1) if batch_size % m == 0]
        if microbatch_counts is None
        else list(microbatch_counts)
    )
    counts = [m for m in counts if batch_size // m in profile.microbatch_sizes]
    out = []
    for name in names:
        least, most = schedules.schedule_spec(name).virtual_stages
        vs = range(least, (max_virtual_stages if most is None else most) + 1)
        for v in vs:
            if v * num_slices > profile.num_units:
                continue
            out.extend((name, v, m) for m in counts)
    return out


def _price(profile: Profile, name: str, v: int, m: int, num_slices: int, batch_size: int):
    """A _Priced candidate, or None when the schedule cannot be built with these counts."""
    S = v * num_slices
    try:
        schedule = schedules.make(name, S, m, v)
    except ValueError:
        return None
    if schedule.num_slices != num_slices:
        return None
    i = profile.size_index(batch_size // m)
    f, b, w = profile.forward_s[i], profile.input_grad_s[i], profile.weight_grad_s[i]
    bounds = balanced_boundaries(f + b + w, S)
    gap = profile.task_gap_s
    ranges = list(zip(bounds, bounds[1:]))
    costs = []
    for k, (a, z) in enumerate(ranges):
        fs, bs, ws = f[a:z].sum(), b[a:z].sum(), w[a:z].sum()
        if schedule.split_backward and k == 0:
            stage = {FORWARD: fs + gap, BACKWARD: 0.0, WEIGHT: bs + ws + gap}
        else:
            stage = {FORWARD: fs + gap, BACKWARD: bs + gap, WEIGHT: ws + gap}
        stage[FULL_BACKWARD] = bs + ws + gap
        costs.append(stage)
    updates = [
        sum(profile.update_s[i, a:z].sum() + gap for a, z in (ranges[k] for k in schedule.stages_on(r)))
        for r in range(num_slices)
    ]
    crossing = [profile.boundary_bytes[i, c] for c in bounds[1:-1]]
    comm_s = profile.transfer_s(max(crossing)) if crossing and num_slices > 1 else 0.0
    resid = [profile.residual_bytes[i, a:z].sum() for a, z in ranges]
    kept = [profile.kept_bytes[i, a:z].sum() for a, z in ranges] if schedule.split_backward else None
    saved = peak_saved_bytes(schedule, resid, kept)
    state = [
        sum(
            2 * profile.param_bytes[a:z].sum() + profile.optimizer_bytes[a:z].sum()
            for a, z in (ranges[k] for k in schedule.stages_on(r))
        )
        for r in range(num_slices)
    ]
    peak = tuple(int(s + a) for s, a in zip(state, saved))
    backward = BACKWARD if schedule.split_backward else FULL_BACKWARD
    busy = [
        m
        * sum(
            costs[k][FORWARD] + costs[k][backward] + (costs[k][WEIGHT] if schedule.split_backward else 0.0)
            for k in schedule.stages_on(r)
        )
        + updates[r]
        for r in range(num_slices)
    ]
    return _Priced(schedule, costs, updates, comm_s, bounds, peak, max(busy) + profile.step_overhead_s)


def search(
    profile: Profile,
    num_slices: int,
    batch_size: int,
    memory_bytes: float = float("inf"),
    microbatch_counts=None,
    schedule_names=None,
    max_virtual_stages: int = 4,
    keep: int | None = 10,
) -> tuple[list[Candidate], list[Candidate]]:
    """(ranked, excluded): the best `keep` candidates that fit `memory_bytes` per slice,
    fastest predicted step first (keep=None: every one, no pruning), and every candidate
    whose predicted peak exceeds the cap (their predicted_step_s is nan: never simulated)."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive integer or None (all), got {keep!r}")
    priced, excluded = [], []
    for name, v, m in space(profile, num_slices, batch_size, microbatch_counts, schedule_names, max_virtual_stages):
        p = _price(profile, name, v, m, num_slices, batch_size)
        if p is None:
            continue
        if max(p.peak_bytes) > memory_bytes:
            excluded.append(_candidate(p, float("nan")))
        else:
            priced.append(p)
    priced.sort(key=lambda p: p.lower_bound_s)
    ranked: list[Candidate] = []
    for p in priced:
        if keep is not None and len(ranked) >= keep and p.lower_bound_s > ranked[keep - 1].predicted_step_s:
            break  # every later candidate's bound is higher still
        step = shared_step_s(p.schedule, p.costs, p.updates, p.comm_s, profile.core_groups)
        ranked.append(_candidate(p, step + profile.step_overhead_s))
        ranked.sort(key=lambda c: c.predicted_step_s)
    return (ranked if keep is None else ranked[:keep]), excluded


def _candidate(p: _Priced, step_s: float) -> Candidate:
    s = p.schedule
    return Candidate(
        s.name, s.num_stages, s.virtual_stages, s.num_microbatches, tuple(p.bounds[1:-1]), step_s, p.peak_bytes
    )
