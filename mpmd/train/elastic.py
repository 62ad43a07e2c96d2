"""The layout a run takes on fewer slices: the same stages and microbatches, mapped onto
the slices that survive a loss no replacement could be found for (`cluster.on_loss`).

Stages and microbatches stay as configured, so the math is unchanged: every stage still
accumulates its microbatches' gradients in microbatch order, and each stage's checkpoint
bundle (`step_N/stage_k`) restores onto whichever slice now holds it. Only the placement
and the order of tasks on each slice change.

Candidates: every way of cutting the stages into `num_slices` contiguous blocks in order
(C(S-1, p-1) of them; past MAX_ENUMERATED only the block cut that balances the stages'
costs best), each run by GPipe and by 1F1B over the blocks (schedules.gpipe / one_f_one_b
with a placement). Contiguous blocks keep every transfer going to the next slice, as the
configured layout does. Each candidate is priced by the simulator with the stages' costs
and, when a per-slice memory budget is given, kept only if its busiest slice fits
(mpmd.stages.costs.slice_memory); the fastest that fits is chosen, the smaller memory peak
breaking ties.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

from mpmd.schedules import core as schedules

from mpmd.schedules import timeline
from mpmd.schedules.simulate import simulate
from mpmd.stages.costs import slice_memory

MAX_ENUMERATED = 256  # block cuts priced one by one; more: the balanced cut only


class Candidate(NamedTuple):
    schedule: schedules.Schedule
    makespan: float  # simulated step time, in the costs' unit
    peak_bytes: int | None  # the most bytes one slice holds; None: memory not known


class NoFit(ValueError):
    """No layout of the stages on the slices at hand fits the memory budget."""


def block_placements(costs: list[float], num_slices: int) -> list[tuple[int, ...]]:
    """Placements cutting the stages (whose costs are `costs`) into `num_slices` contiguous
    blocks in slice order: all of them, or past MAX_ENUMERATED the best balanced one."""
    S = len(costs)
    if not 1 <= num_slices <= S:
        raise ValueError(f"{S} stages cannot be placed on {num_slices} slice(s): every slice needs a stage")
    if math.comb(S - 1, num_slices - 1) > MAX_ENUMERATED:
        return [_balanced(costs, num_slices)]
    return [_from_cuts(S, cuts) for cuts in itertools.combinations(range(1, S), num_slices - 1)]


def _from_cuts(num_stages: int, cuts) -> tuple[int, ...]:
    bounds = (0, *cuts, num_stages)
    return tuple(r for r in range(len(bounds) - 1) for _ in range(bounds[r + 1] - bounds[r]))


def _balanced(costs: list[float], num_slices: int) -> tuple[int, ...]:
    """The contiguous cut whose costliest block costs least (linear partition, O(S^2 p))."""
    S = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]
    # best[j][k]: the least max-block cost of the first k stages in j blocks; cut[j][k] its last cut.
    best = [[math.inf] * (S + 1) for _ in range(num_slices + 1)]
    cut = [[0] * (S + 1) for _ in range(num_slices + 1)]
    best[0][0] = 0.0
    for j in range(1, num_slices + 1):
        for k in range(j, S + 1):
            for i in range(j - 1, k):
                value = max(best[j - 1][i], prefix[k] - prefix[i])
                if value < best[j][k]:
                    best[j][k], cut[j][k] = value, i
    cuts, k = [], S
    for j in range(num_slices, 1, -1):
        k = cut[j][k]
        cuts.append(k)
    return _from_cuts(S, sorted(cuts))


def candidates(
    num_stages: int,
    num_microbatches: int,
    num_slices: int,
    stage_costs: list[float],
    per_stage_bytes: list[dict] | None = None,
) -> list[Candidate]:
    """Every candidate layout on `num_slices` slices, priced (see the module docstring).
    `stage_costs[k]`: stage k's forward cost (its B and W are priced alike: a full backward
    about twice a forward); `per_stage_bytes`: mpmd.stages.costs.memory's records, or None."""
    assert len(stage_costs) == num_stages, (len(stage_costs), num_stages)
    costs = [{"F": c, "B": c, "W": c} for c in stage_costs]
    out = []
    for placement in block_placements(stage_costs, num_slices):
        for make in (schedules.one_f_one_b, schedules.gpipe):
            schedule = make(num_stages, num_microbatches, placement=placement)
            timeline.validate(schedule)
            peak = (
                max(s["total"] for s in slice_memory(schedule, per_stage_bytes))
                if per_stage_bytes is not None
                else None
            )
            out.append(Candidate(schedule, simulate(schedule, costs).makespan, peak))
    return out


def choose(
    num_stages: int,
    num_microbatches: int,
    num_slices: int,
    stage_costs: list[float],
    per_stage_bytes: list[dict] | None = None,
    budget_bytes: int | None = None,
) -> Candidate:
    """The fastest candidate whose busiest slice fits `budget_bytes` (None: any); NoFit
    naming the smallest peak found when none does."""
    found = candidates(num_stages, num_microbatches, num_slices, stage_costs, per_stage_bytes)
    fits = [c for c in found if budget_bytes is None or c.peak_bytes is None or c.peak_bytes <= budget_bytes]
    if not fits:
        least = min(found, key=lambda c: c.peak_bytes)
        raise NoFit(
            f"no layout of the {num_stages} stages on {num_slices} slice(s) fits "
            f"slice_memory_bytes={budget_bytes}: the smallest needs {least.peak_bytes} bytes on its "
            f"busiest slice ({least.schedule.name}, placement {least.schedule.placement})"
        )
    return min(fits, key=lambda c: (c.makespan, c.peak_bytes or 0))


def predicted_slowdown(chosen: Candidate, configured: schedules.Schedule, stage_costs: list[float]) -> float:
    """The chosen layout's simulated step time over the configured layout's, same costs."""
    costs = [{"F": c, "B": c, "W": c} for c in stage_costs]
    return chosen.makespan / simulate(configured, costs).makespan


def describe(schedule: schedules.Schedule) -> str:
    """'1f1b on 3 slices, stages per slice [0] [1 2] [3]' for a log line."""
    blocks = " ".join("[" + " ".join(map(str, schedule.stages_on(r))) + "]" for r in range(schedule.num_slices))
    return f"{schedule.name} on {schedule.num_slices} slice(s), stages per slice {blocks}"
