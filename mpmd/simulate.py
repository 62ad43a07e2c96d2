"""Timeline of a schedule under given task costs: makespan, bubbles, live activations.

Cost convention. `costs` gives the time of one F, one B (input gradient only) and one W
(weight gradient) of a stage: a dict {"F": f, "B": b, "W": w} for every stage, or a callable
cost(task) -> float (called with kind "F", "B" or "W"), or a list of such dicts, one per
stage. A schedule with split_backward=False runs the whole backward as one B task, which
costs b + w unless a dict also gives "BW", the full backward's own cost. B + W = BW is what
zero-bubble schedules assume, and mpmd's B and W programs split one backward without
recomputing (XLA cost analysis on a GPT stage of 2 blocks, d_model 128: BW 476, B 257,
W 219 MFLOP, where W alone once cost 476); `mpmd.stage_costs.measure` gives a pipeline's
own F, B, W and BW. With F = B = W = 1 (a full backward twice a
forward, the usual rule of thumb) and no BW, p slices give:
  GPipe, 1F1B:   bubble = (p-1)/(m+p-1)      (any f, b, w: the formula does not depend on them)
  interleaved:   bubble = (p-1)/(v*m+p-1)    (m a multiple of p)
  ZB-H1:         bubble = (p-1)/(3m+p-1)     (a third of 1F1B's idle time, 3(p-1) -> p-1)
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

from mpmd.schedules import (BACKWARD, FORWARD, WEIGHT, Schedule, Task, dependencies,
                            execution_order)

FULL_BACKWARD = "BW"   # a cost kind, not a task kind: B of a schedule without split backward
DEFAULT_COSTS = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0}

Costs = Union[dict, list, Callable[[Task], float], None]


class Simulation(NamedTuple):
    makespan: float
    bubble_fraction: float  # 1 - sum(busy over slices) / (num_slices * makespan)
    bubble_fraction_per_slice: tuple[float, ...]  # 1 - busy / makespan, per slice
    # Per slice, the most (stage, mb) pairs at once whose F has started and whose last
    # backward task (W if split, else B) has not finished: activations the slice must hold.
    peak_live_activations: tuple[int, ...]
    spans: tuple[tuple[tuple[Task, float, float], ...], ...]  # per slice: (task, start, end)


def cost_function(costs: Costs, split_backward: bool) -> Callable[[Task], float]:
    """task -> cost from a {"F","B","W"[,"BW"]} dict, a list of them (one per stage) or a
    callable; validates `costs` (also used by the dry run, so both price tasks the same way)."""
    if costs is None:
        costs = DEFAULT_COSTS
    if isinstance(costs, (list, tuple)):
        tables = [_kind_table(c, split_backward, f"costs[{k}]") for k, c in enumerate(costs)]
        def per_stage(task):
            if task.stage >= len(tables):
                raise ValueError(f"costs has {len(tables)} per-stage entries; {task} needs stage "
                                 f"{task.stage}'s")
            return tables[task.stage][task.kind]
        return per_stage
    if callable(costs):
        def cost(task):
            value = costs(task)
            if not split_backward and task.kind == BACKWARD:
                value += costs(Task(task.stage, task.microbatch, WEIGHT))
            if not value >= 0:
                raise ValueError(f"costs({task}) must be a number >= 0, got {value!r}")
            return value
        return cost
    table = _kind_table(costs, split_backward, "costs")
    return lambda task: table[task.kind]


def _kind_table(costs, split_backward: bool, what: str) -> dict:
    """{"F","B","W"} -> cost of that task kind in a schedule with/without split backward."""
    kinds = {FORWARD, BACKWARD, WEIGHT}
    if not isinstance(costs, dict) or not kinds <= set(costs) <= kinds | {FULL_BACKWARD}:
        raise ValueError(f"{what} must be None, a callable(task) -> seconds, a list of per-stage "
                         f"dicts, or a dict with exactly the keys 'F', 'B', 'W' and optionally "
                         f"'BW' (the full backward); got {costs!r}")
    for kind, value in costs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{what}[{kind!r}] must be a number >= 0, got {value!r}")
    table = {kind: costs[kind] for kind in kinds}
    if not split_backward:
        table[BACKWARD] = costs.get(FULL_BACKWARD, costs[BACKWARD] + costs[WEIGHT])
    return table


def _peak_live(tasks, split_backward: bool, size: Callable[[int], float] = lambda stage: 1,
               kept: Callable[[int], float] = lambda stage: 0) -> float:
    # Slices run one task at a time, so the live amount changes only between tasks: +size
    # when an F starts, -size when the microbatch's last backward task ends; with split
    # backward also +kept when B runs (what it leaves for W), -kept when W ends. Costs do not matter.
    last = WEIGHT if split_backward else BACKWARD
    live = peak = 0
    for task in tasks:
        grow = size(task.stage) if task.kind == FORWARD else (
            kept(task.stage) if split_backward and task.kind == BACKWARD else 0)
        live += grow
        peak = max(peak, live)
        if task.kind == last:
            live -= size(task.stage) + (kept(task.stage) if split_backward else 0)
    return peak


def peak_saved_bytes(schedule: Schedule, residual_bytes: list[float],
                     kept_bytes: list[float] | None = None) -> tuple[float, ...]:
    """Per slice, the most bytes of saved activations held at once, given the bytes stage k's
    forward keeps for its backward per microbatch (`residual_bytes[k]`, e.g. from
    mpmd.stage_costs.memory): peak_live_activations weighted by stage. Rematerialisation
    shrinks residual_bytes and so this figure. `kept_bytes[k]`: what stage k's B leaves for
    its W per microbatch, held from B until W (split-backward schedules only)."""
    for what, given in (("residual_bytes", residual_bytes), ("kept_bytes", kept_bytes)):
        if given is not None and len(given) != schedule.num_stages:
            raise ValueError(f"{what} has {len(given)} entries; the schedule has "
                             f"{schedule.num_stages} stages")
    kept = kept_bytes.__getitem__ if kept_bytes is not None else (lambda stage: 0)
    return tuple(_peak_live(tasks, schedule.split_backward, residual_bytes.__getitem__, kept)
                 for tasks in schedule.slices)


def simulate(schedule: Schedule, costs: Costs = None, comm_s: float = 0.0) -> Simulation:
    """Run `schedule` (validated first; ScheduleError if broken) with the given costs.

    Every task starts as soon as its slice is free and its dependencies have ended, plus
    comm_s (seconds) for each dependency produced on another slice: a fixed latency per
    cross-slice transfer, overlapping with compute.
    """
    if isinstance(comm_s, bool) or not isinstance(comm_s, (int, float)) or not comm_s >= 0:
        raise ValueError(f"comm_s must be a number >= 0 (seconds), got {comm_s!r}")
    order = execution_order(schedule)
    cost = cost_function(costs, schedule.split_backward)
    S, p, placement = schedule.num_stages, len(schedule.slices), schedule.placement
    end = {}
    free_at = [0.0] * p
    busy = [0.0] * p
    spans = [[] for _ in range(p)]
    # execution_order puts each task after its dependencies and its slice predecessor, so
    # one pass computes every start time.
    for task in order:
        r = placement[task.stage]
        start = free_at[r]
        for dep in dependencies(task, S):
            ready = end[dep] + (comm_s if placement[dep[0]] != r else 0.0)
            if ready > start:
                start = ready
        duration = cost(task)
        finish = start + duration
        end[task] = finish
        free_at[r] = finish
        busy[r] += duration
        spans[r].append((task, start, finish))
    makespan = max(free_at)
    if makespan > 0:
        per_slice = tuple(1.0 - b / makespan for b in busy)
        total = 1.0 - sum(busy) / (p * makespan)
    else:  # all costs zero: nothing to wait for
        per_slice, total = (0.0,) * p, 0.0
    peaks = tuple(_peak_live(tasks, schedule.split_backward) for tasks in schedule.slices)
    return Simulation(makespan, total, per_slice, peaks, tuple(map(tuple, spans)))
