"""Timeline of a schedule under given task costs: makespan, bubbles, live activations.

Cost convention. `costs` gives the time of one F, one B (input gradient only) and one W
(weight gradient) of a stage: a dict {"F": f, "B": b, "W": w} for every stage, or a callable
cost(task) -> float (called with kind "F", "B" or "W"), or a list of such dicts, one per
stage. A schedule with split_backward=False runs the whole backward as one B task, which
costs b + w unless a dict also gives "BW", the full backward's own cost. B + W = BW is what
zero-bubble schedules assume, and mpmd's B and W programs split one backward without
recomputing (XLA cost analysis on a GPT stage of 2 blocks, d_model 128: BW 476, B 257,
W 219 MFLOP, where W alone once cost 476); `mpmd.stages.costs.measure` gives a pipeline's
own F, B, W and BW. With F = B = W = 1 (a full backward twice a
forward, the usual rule of thumb) and no BW, p slices give:
  GPipe, 1F1B:   bubble = (p-1)/(m+p-1)      (any f, b, w: the formula does not depend on them)
  interleaved:   bubble = (p-1)/(v*m+p-1)    (m a multiple of p)
  ZB-H1:         bubble = (p-1)/(3m+p-1)     (a third of 1F1B's idle time, 3(p-1) -> p-1)
  ZB-V:          bubble = (p-1)/(6m+p-1)     (2p stages; p-1 idle units per slice, the V's minimum)
(mpmd.schedules' module doc has the table with DualPipeV and peak memory.)

The timeline comes from mpmd.schedules.timeline's vectorised walk (also the validator), so a schedule
of 1,024 slices x 8,192 microbatches simulates in seconds. Costs given as a dict or a
per-stage list are priced by table look-ups; a callable is called once per task (fine for
small schedules, slow for tens of millions of tasks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, NamedTuple, Union

import numpy as np

from mpmd.schedules import timeline
from mpmd.schedules.core import BACKWARD, FORWARD, WEIGHT, Schedule, Task
from mpmd.schedules.task_arrays import KIND_CODES, KINDS, TaskArrays, as_arrays

FULL_BACKWARD = "BW"  # a cost kind, not a task kind: B of a schedule without split backward
DEFAULT_COSTS = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0}

Costs = Union[dict, list, Callable[[Task], float], None]


class Simulation(NamedTuple):
    makespan: float
    bubble_fraction: float  # 1 - sum(busy over slices) / (num_slices * makespan)
    bubble_fraction_per_slice: tuple[float, ...]  # 1 - busy / makespan, per slice
    # Per slice, the most (stage, mb) pairs at once whose F has started and whose last
    # backward task (W if split, else B) has not finished: activations the slice must hold.
    peak_live_activations: tuple[int, ...]
    # Per slice: (task, start, end) in the slice's order. A Spans: each slice's tuple is made
    # when read, so a simulation of 50 M tasks holds arrays, not 50 M tuples.
    spans: Sequence[tuple[tuple[Task, float, float], ...]]


def cost_function(costs: Costs, split_backward: bool) -> Callable[[Task], float]:
    """task -> cost from a {"F","B","W"[,"BW"]} dict, a list of them (one per stage) or a
    callable; validates `costs` (also used by the dry run, so both price tasks the same way)."""
    if costs is None:
        costs = DEFAULT_COSTS
    if isinstance(costs, (list, tuple)):
        tables = [_kind_table(c, split_backward, f"costs[{k}]") for k, c in enumerate(costs)]

        def per_stage(task):
            if task.stage >= len(tables):
                raise ValueError(f"costs has {len(tables)} per-stage entries; {task} needs stage {task.stage}'s")
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
        raise ValueError(
            f"{what} must be None, a callable(task) -> seconds, a list of per-stage "
            f"dicts, or a dict with exactly the keys 'F', 'B', 'W' and optionally "
            f"'BW' (the full backward); got {costs!r}"
        )
    for kind, value in costs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{what}[{kind!r}] must be a number >= 0, got {value!r}")
    table = {kind: costs[kind] for kind in kinds}
    if not split_backward:
        table[BACKWARD] = costs.get(FULL_BACKWARD, costs[BACKWARD] + costs[WEIGHT])
    return table


def _peak_live(tasks: TaskArrays, split_backward: bool, size=None, kept=None, once=None) -> tuple:
    """Per slice, the most activations held at once. Slices run one task at a time, so the
    live amount changes only between tasks: +size when an F starts, -size when the
    microbatch's last backward task ends (W if split, else B); with split backward also
    +kept when B runs (what it leaves for W) and -kept when W ends. No task both grows and
    shrinks the amount, so the peak is the running sum's. Costs do not matter.
    size, kept: None (size: count 1 per stage-microbatch; kept: nothing) or per-stage arrays
    (e.g. bytes). once: None or per-stage amounts held once per step, from the stage's first
    F on the slice until its last backward task ends (FSDP weights gathered once a step)."""
    last = KIND_CODES[WEIGHT if split_backward else BACKWARD]
    peaks = []
    for r in range(len(tasks)):
        a, b = int(tasks.offsets[r]), int(tasks.offsets[r + 1])
        kind, stage = tasks.kind[a:b], tasks.stage[a:b]
        held = np.ones(b - a, dtype=np.int64) if size is None else size[stage]
        step = (kind == KIND_CODES[FORWARD]) * held - (kind == last) * held
        if split_backward and kept is not None:
            step = step + ((kind == KIND_CODES[BACKWARD]).astype(np.int64) - (kind == last)) * kept[stage]
        if once is not None:
            step = step.astype(np.float64)
            for k in np.unique(stage):
                forwards = np.flatnonzero((stage == k) & (kind == KIND_CODES[FORWARD]))
                ends = np.flatnonzero((stage == k) & (kind == last))
                if len(forwards) and len(ends):
                    step[forwards[0]] += once[k]
                    step[ends[-1]] -= once[k]
        live = np.cumsum(step)
        peaks.append(max(0, live.max()) if len(live) else 0)
    return tuple(p.item() if hasattr(p, "item") else p for p in peaks)


def peak_saved_bytes(
    schedule: Schedule,
    residual_bytes: list[float],
    kept_bytes: list[float] | None = None,
    gathered_bytes: list[float] | None = None,
) -> tuple[float, ...]:
    """Per slice, the most bytes of saved activations held at once, given the bytes stage k's
    forward keeps for its backward per microbatch (`residual_bytes[k]`, e.g. from
    mpmd.stages.costs.memory): peak_live_activations weighted by stage. Rematerialisation
    shrinks residual_bytes and so this figure. `kept_bytes[k]`: what stage k's B leaves for
    its W per microbatch, held from B until W (split-backward schedules only).
    `gathered_bytes[k]`: stage k's weights gathered over fsdp once a step (mpmd/stages/gather.py),
    held from its first F to its last backward task."""
    for what, given in (
        ("residual_bytes", residual_bytes),
        ("kept_bytes", kept_bytes),
        ("gathered_bytes", gathered_bytes),
    ):
        if given is not None and len(given) != schedule.num_stages:
            raise ValueError(f"{what} has {len(given)} entries; the schedule has {schedule.num_stages} stages")
    return _peak_live(
        as_arrays(schedule.slices),
        schedule.split_backward,
        np.asarray(residual_bytes, dtype=np.float64),
        None if kept_bytes is None else np.asarray(kept_bytes, dtype=np.float64),
        None if gathered_bytes is None else np.asarray(gathered_bytes, dtype=np.float64),
    )


def _cost_arrays(costs: Costs, schedule: Schedule, tasks: TaskArrays):
    """(cost_index per task, cost_table) for mpmd.schedules.timeline.walk: task i costs
    cost_table[cost_index[i]]. A dict prices by kind, a per-stage list by (kind, stage), a
    callable task by task."""
    split = schedule.split_backward
    if costs is None:
        costs = DEFAULT_COSTS
    if isinstance(costs, dict):
        table = _kind_table(costs, split, "costs")
        return tasks.kind, np.array([table[k] for k in KINDS])
    if isinstance(costs, (list, tuple)):
        tables = [_kind_table(c, split, f"costs[{k}]") for k, c in enumerate(costs)]
        S = schedule.num_stages
        if len(tables) < S:
            raise ValueError(f"costs has {len(tables)} per-stage entries; the schedule has {S} stages")
        flat = np.array([tables[s][k] for k in KINDS for s in range(S)])
        return tasks.kind.astype(np.int64) * S + tasks.stage, flat
    cost = cost_function(costs, split)
    per_task = np.array([cost(task) for tasks_of in tasks for task in tasks_of], dtype=np.float64)
    return np.arange(len(per_task)), per_task


class Spans(Sequence):
    """Per slice, the (task, start, end) triples of a simulation, built when a slice is read."""

    def __init__(self, run: timeline.Walk):
        self._run = run

    def __len__(self) -> int:
        return len(self._run.tasks)

    def num_tasks(self, r: int) -> int:
        offsets = self._run.tasks.offsets
        return int(offsets[r + 1] - offsets[r])

    def __getitem__(self, r):
        if isinstance(r, slice):
            return tuple(self[i] for i in range(*r.indices(len(self))))
        r = range(len(self))[r]
        a, b = int(self._run.tasks.offsets[r]), int(self._run.tasks.offsets[r + 1])
        return tuple(zip(self._run.tasks[r], self._run.starts(a, b).tolist(), self._run.end[a:b].tolist()))


def simulate(schedule: Schedule, costs: Costs = None, comm_s: float = 0.0) -> Simulation:
    """Run `schedule` (validated first; ScheduleError if broken) with the given costs.

    Every task starts as soon as its slice is free and its dependencies have ended, plus
    comm_s (seconds) for each dependency produced on another slice: a fixed latency per
    cross-slice transfer, overlapping with compute.
    """
    if isinstance(comm_s, bool) or not isinstance(comm_s, (int, float)) or not comm_s >= 0:
        raise ValueError(f"comm_s must be a number >= 0 (seconds), got {comm_s!r}")
    tasks = as_arrays(schedule.slices)
    cost_index, cost_table = _cost_arrays(costs, schedule, tasks)
    run = timeline.walk(schedule._replace(slices=tasks), cost_index, cost_table, float(comm_s))
    busy = run.busy.tolist()
    p = len(busy)
    makespan = max(run.free.tolist()) if p else 0.0
    if makespan > 0:
        per_slice = tuple(1.0 - b / makespan for b in busy)
        total = 1.0 - sum(busy) / (p * makespan)
    else:  # all costs zero: nothing to wait for
        per_slice, total = (0.0,) * p, 0.0
    peaks = _peak_live(tasks, schedule.split_backward)
    return Simulation(makespan, total, per_slice, peaks, Spans(run))


def step_s(schedule: Schedule, costs: Costs, updates: Sequence[float], comm_s: float = 0.0) -> float:
    """A training step's time: each slice's last task's end in the simulated timeline plus
    that slice's optimizer updates (`updates[r]`, seconds; they run after its last backward),
    the latest of them."""
    sim = simulate(schedule, costs, comm_s)
    return max((row[-1][2] if row else 0.0) + u for row, u in zip(sim.spans, updates))
