"""What the tuner (mpmd/tuner/core.py) knows about a model on a cluster: a `Profile`, measured by a
short pass on the cluster's own workers.

    prof = profile(layers, loss_fn, optimizer, inputs, targets, cluster, microbatch_sizes=(2, 4))

Per *unit* (a layer of `model.layers()`, or a user's stage: the smallest pieces a stage is
cut from) and per microbatch size: the core-seconds of its forward (F), input gradient (B)
and weight gradient (W) and of its optimizer update (U), net of a program's fixed cost, and
the bytes of its parameters, optimizer state, residuals (what F saves for the backward),
kept bytes (what B keeps for W) and of the activation entering it. Plus the transfer model
between two slices, seconds = latency_s + bytes / bytes_per_s, and the cost model's named
terms (the search charges them, mpmd/tuner/search.py):

- program_s: the fixed seconds in every program's traced time, whatever its size (dispatch,
  argument handling, launch, the wait for its end). A unit measured alone is one program
  and pays it; a stage of n units is one program and pays it once, not n times. Measured
  by profiling a second grouping of the same units (consecutive pairs fused into one stage,
  each pair on its units' slice): per fused stage, (its units' programs' seconds - its own
  programs' seconds) / (the programs saved) (`program_s`); taken out of every unit's times.
- task_gap_s: what one task costs an untraced training step beyond its compute (its
  program's fixed cost again, as the step pays it, and the executor's walk around it:
  sends, receives, deletes). The two groupings run the same compute in different numbers
  of tasks, so the difference of their measured steps is the difference of their task
  counts times this, plus the programs' own differences (`task_and_step_s`).
- step_overhead_s: what a step costs whatever its tasks (the controller feeding the batch
  and taking the loss back): the measured steps beyond the simulated ones, with task_gap_s.
- core_groups: the slices whose workers share cores (their CPU affinities intersect, read
  from this machine: `core_groups_of`; 4 workers on 2 cores pair them up). A traced
  program's seconds while n of its group's slices run on c cores are counted at
  min(1, c / n) (`task_durations`), so unit times are what a program takes alone, and a
  candidate's step is simulated the same way (`shared_step_s`): while n of a group's slices
  run tasks each gets min(1, c / n) of a core, so a slice runs at full speed through its
  mates' bubbles, and a schedule that keeps every slice busy gives the core to none.

How. The units become the stages of one pipeline, placed in contiguous blocks over the
cluster's slices, run by a split-backward GPipe order (all forwards, then the B and W of
each microbatch; microbatch-major, so the slices overlap as in a real pipeline and each
task is timed while the others compute) for a few traced steps per microbatch size: every
task's duration is read from the trace (median over microbatches and steps), after a traced
warm-up step (the first traced step compiles; a median of two steps, one of them compiling,
once priced a block three times too high). The step itself is timed untraced, as training
runs it (tracing waits for every program and counts every slice's bytes after each
instruction, which costs time). The pairs are profiled the same way between two passes of
the units, and of those two the quieter is kept per size (`quieter`: a drifting load, or a
fresh cluster's slower first steps, must not weigh on one grouping only). The first unit's
B runs no program (its input is data), so its W is its whole backward, as for any first
stage. Bytes come from shapes (mpmd.stages.costs.memory). With three or more sizes, each
unit's times are replaced by a robust line in the size (`affine_in_size`). The transfer
model is fit by least squares to the gaps between a forward on one slice and its
consumer's forward on the next, in dry runs (mpmd/lowering/dryrun.py: zero-second programs,
real transfers) of a few activation sizes.

A Profile is plain arrays: tests build one from declared costs, without any compute.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from typing import NamedTuple

import jax
import numpy as np

from mpmd.schedules import core as schedules
from mpmd.stages.pipeline import Pipeline
from mpmd.schedules.core import BACKWARD, FORWARD, WEIGHT, Schedule, Task
from mpmd.schedules.simulate import FULL_BACKWARD, step_s
from mpmd.stages.specs import spec
from mpmd.runtime.wire.format import nbytes

UPDATE = "U"
_LABEL = re.compile(r"([FBWU]) s(\d+)(?: mb(\d+))?$")  # mpmd/lowering/train_stream.py's Run labels


class Profile(NamedTuple):
    microbatch_sizes: tuple[int, ...]  # rows per microbatch, ascending
    # [size index, unit] seconds per microbatch (update_s: per step, one row per size)
    forward_s: np.ndarray
    input_grad_s: np.ndarray  # unit 0's is 0: its input is data
    weight_grad_s: np.ndarray  # unit 0's is its whole backward
    update_s: np.ndarray
    # [unit] bytes
    param_bytes: np.ndarray
    optimizer_bytes: np.ndarray
    # [size index, unit] bytes per microbatch
    residual_bytes: np.ndarray
    kept_bytes: np.ndarray
    # [size index, unit + 1]: bytes of the activation entering unit u (u = num_units: output)
    boundary_bytes: np.ndarray
    latency_s: float = 0.0  # transfer between two slices: latency_s + bytes / bytes_per_s
    bytes_per_s: float = float("inf")
    task_gap_s: float = 0.0  # per task: its program's fixed cost + the executor's walk
    step_overhead_s: float = 0.0  # per step: a fixed cost, whatever the tasks
    unit_names: tuple[str, ...] = ()
    program_s: float = 0.0  # per traced program: its fixed cost, already taken out of
    # the unit times above (a record of the fit; search reads task_gap_s)
    # Slices that share cores: ((slices, number of cores they share), ...); a slice in none
    # has its cores to itself. Unit times above are core-seconds (what a program takes alone).
    core_groups: tuple = ()

    @property
    def num_units(self) -> int:
        return self.forward_s.shape[1]

    def size_index(self, microbatch_size: int) -> int:
        if microbatch_size not in self.microbatch_sizes:
            raise ValueError(
                f"microbatch size {microbatch_size} was not profiled; profiled: {list(self.microbatch_sizes)}"
            )
        return self.microbatch_sizes.index(microbatch_size)

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


def profile_stages(num_units: int, num_slices: int, units_per_stage: int = 1) -> list[tuple[int, int]]:
    """[start, end) unit ranges of the profile's stages: the units in contiguous blocks over
    `num_slices` slices, each block cut into stages of `units_per_stage` consecutive units
    (the last of a block may hold fewer), so both groupings put every unit on the same slice."""
    if not 1 <= num_slices <= num_units:
        raise ValueError(f"profiling {num_units} units needs 1..{num_units} slices, got {num_slices}")
    bounds = np.linspace(0, num_units, num_slices + 1).round().astype(int)
    return [
        (a, min(a + units_per_stage, int(z)))
        for z0, z in zip(bounds, bounds[1:])
        for a in range(int(z0), int(z), units_per_stage)
    ]


def profile_schedule(num_units: int, num_slices: int, num_microbatches: int, units_per_stage: int = 1) -> Schedule:
    """Split-backward GPipe over the stages of `profile_stages` (one per unit by default) on
    `num_slices` slices: each slice runs all its forwards, microbatch by microbatch, then B
    and W of each microbatch (its stages last first). Microbatch-major, so the slices overlap
    as they do in a real pipeline (a slice's tasks are timed while the others compute too)."""
    stages = profile_stages(num_units, num_slices, units_per_stage)
    bounds = np.linspace(0, num_units, num_slices + 1).round().astype(int)
    placement = tuple(int(np.searchsorted(bounds, a, side="right") - 1) for a, _ in stages)
    m = num_microbatches
    slices = []
    for r in range(num_slices):
        mine = [k for k, p in enumerate(placement) if p == r]
        tasks = [Task(k, j, FORWARD) for j in range(m) for k in mine]
        tasks += [Task(k, j, kind) for j in range(m) for k in reversed(mine) for kind in (BACKWARD, WEIGHT)]
        slices.append(tuple(tasks))
    most = max(placement.count(r) for r in range(num_slices))
    return Schedule("profile", len(stages), m, most, True, tuple(slices), placement)


def task_durations(events_per_step, core_groups=()) -> dict:
    """{(kind, stage): [seconds, ...]} of every traced F/B/W/U program, from
    Trainer.step(trace=True)["events"] of one or more steps. On slices that share cores
    (`core_groups`, as Profile's), a program's seconds are its core-seconds: while n of its
    group's slices run programs on c cores, each runs at min(1, c / n) of its own speed."""
    out: dict = {}
    group_of = {r: (slices, cores) for slices, cores in core_groups for r in slices}
    for events in events_per_step:
        runs = [[e for e in slice_events if e.kind == "run"] for slice_events in events]
        for r, slice_runs in enumerate(runs):
            slices, cores = group_of.get(r, ((r,), 1))
            others = [e for q in slices if q != r and q < len(runs) for e in runs[q]]
            for e in slice_runs:
                match = _LABEL.match(e.name)
                if match:
                    out.setdefault((match[1], int(match[2])), []).append(_alone_s(e, others, cores))
    return out


def _alone_s(e, others, cores: int) -> float:
    """Seconds event `e` would have run alone: its span, each part of it counted at
    min(1, cores / programs running then), `others` being the programs of the slices that
    share its cores."""
    cuts = sorted(
        {e.start_ns, e.end_ns} | {t for o in others for t in (o.start_ns, o.end_ns) if e.start_ns < t < e.end_ns}
    )
    total = 0.0
    for a, z in zip(cuts, cuts[1:]):
        mid = (a + z) / 2
        running = 1 + sum(o.start_ns <= mid < o.end_ns for o in others)
        total += (z - a) * min(1.0, cores / running)
    return total / 1e9


def shared_step_s(schedule: Schedule, costs: list, updates, comm_s: float = 0.0, core_groups=()) -> float:
    """step_s of `schedule` with per-stage `costs` (dicts of F, B, W[, BW] core-seconds) and
    per-slice `updates`, where slices that share cores slow each other down: a timeline in
    which, while n of a group's slices run on its c cores, each runs at min(1, c / n) of its
    own speed (as the profile counts a traced program's core-seconds, `task_durations`), so
    a slice computes at full speed while its mates wait in their bubbles. Without sharing
    (no group has fewer cores than slices) it is step_s itself."""
    P = schedule.num_slices
    groups = [([q for q in slices if q < P], cores) for slices, cores in core_groups]
    groups = [(mine, cores) for mine, cores in groups if len(mine) > cores]
    if not groups:
        return step_s(schedule, costs, updates, comm_s)
    return _shared_timeline(schedule, costs, updates, comm_s, groups)


def _shared_timeline(schedule: Schedule, costs: list, updates, comm_s: float, groups) -> float:
    """The end of the last slice's update when slices in `groups` ([(slices, cores), ...])
    share their cores equally: an event-driven walk of every slice's tasks in order, a task
    starting when its slice is free and its dependencies have ended (+ comm_s from another
    slice), running at its group's share of a core until its cost is done."""

    def cost(task):
        c = costs[task.stage]
        if task.kind == BACKWARD and not schedule.split_backward:
            return c.get(FULL_BACKWARD, c[BACKWARD] + c[WEIGHT])
        return c[task.kind]

    P, S = schedule.num_slices, schedule.num_stages
    queues = [
        [(Task(*t), cost(Task(*t))) for t in tasks] + [(None, float(u))] for tasks, u in zip(schedule.slices, updates)
    ]
    group_of = {r: (mine, cores) for mine, cores in groups for r in mine}
    ended: dict = {}
    position = [0] * P
    running: dict = {}  # slice -> [task, work left]
    now = 0.0
    while True:
        ready_at = []
        for r in range(P):
            if r in running or position[r] == len(queues[r]):
                continue
            task, work = queues[r][position[r]]
            deps = () if task is None else schedules.dependencies(task, S)
            if any(d not in ended for d in deps):
                continue
            start = max([now] + [ended[d] + (comm_s if schedule.placement[d[0]] != r else 0.0) for d in deps])
            if start <= now:
                running[r] = [task, work]
            else:
                ready_at.append(start)
        if not running and not ready_at:
            if any(position[r] < len(queues[r]) for r in range(P)):
                raise ValueError(f"{schedule.name}: its tasks wait on each other (validate the schedule)")
            return now
        rate = {}
        for r in running:
            mine, cores = group_of.get(r, ((r,), 1))
            rate[r] = min(1.0, cores / sum(q in running for q in mine))
        finish = [now + left / rate[r] for r, (_, left) in running.items()]
        later = min(finish + ready_at)
        for r in list(running):
            running[r][1] -= (later - now) * rate[r]
            if running[r][1] <= 1e-12 * max(1.0, later):
                task = running.pop(r)[0]
                if task is not None:
                    ended[tuple(task)] = later
                position[r] += 1
        now = later


def core_groups_of(cluster, num_slices: int) -> tuple:
    """The slices of `cluster` whose worker processes may run on the same cores (their CPU
    affinities, read from this machine, intersect), with how many cores each such group
    has: ((slices, cores), ...). () where the workers' processes are not on this machine
    or each slice has its own cores."""
    try:
        pids = list(cluster.pids)
        if len(pids) != num_slices:
            return ()
        affinity = [set(os.sched_getaffinity(pid)) for pid in pids]
    except (AttributeError, OSError, TypeError):
        return ()
    groups: list[list[int]] = []
    for r in range(num_slices):
        joined = [g for g in groups if any(affinity[q] & affinity[r] for q in g)]
        merged = [q for g in joined for q in g] + [r]
        groups = [g for g in groups if g not in joined] + [sorted(merged)]
    return tuple((tuple(g), len(set().union(*(affinity[q] for q in g)))) for g in sorted(groups) if len(g) > 1)


class Grouping(NamedTuple):
    """One profiling pass: its stages' unit ranges, its schedule, and per microbatch size the
    traced median seconds of every program {(kind, stage): s} and the untraced step's median."""

    stages: list
    schedule: Schedule
    durations: list  # [size] {(kind, stage): seconds}
    step_s: list  # [size] seconds
    core_groups: tuple = ()  # as Profile's


def profile(
    units,
    loss_fn,
    optimizer,
    inputs,
    targets,
    cluster,
    num_slices: int,
    microbatch_sizes,
    num_microbatches: int = 4,
    steps: int = 2,
    transfer_sizes=(2**14, 2**18, 2**21),
    max_grad_norm=None,
    log=print,
) -> Profile:
    """Measure `units` (nnx.Modules in order; the pipeline's loss after the last) on
    `num_slices` slices of `cluster` (started here, left open for the caller).

    inputs/targets: a batch of real data (its rows are repeated where a size needs more).
    Each size runs `num_microbatches` per step, in each grouping (a stage per unit, then
    pairs): two warm-up steps (one traced), `steps` traced steps (task durations) and
    `steps` + 4 timed untraced steps.
    """
    from mpmd.stages.costs import memory

    units = list(units)
    sizes = tuple(sorted(set(int(s) for s in microbatch_sizes)))
    num_slices = min(num_slices, len(units))
    pipe = Pipeline(units, loss_fn)
    U = len(units)
    shape = (len(sizes), U)
    resid, kept = np.zeros(shape), np.zeros(shape)
    bound = np.zeros((len(sizes), U + 1))
    params = opt = None
    for i, size in enumerate(sizes):
        mx, my = (jax.tree.map(spec, _rows(a, size)) for a in (inputs, targets))
        per_unit = memory(pipe, optimizer, mx, my)
        params = np.array([u["params"] for u in per_unit], float)
        opt = np.array([u["optimizer"] for u in per_unit], float)
        resid[i] = [u["residuals"] for u in per_unit]
        kept[i] = [u["kept"] for u in per_unit]
        bound[i] = [nbytes(jax.tree.leaves(a)) for a in pipe.activation_specs(mx)]
    run = lambda k: _measure(
        units,
        loss_fn,
        optimizer,
        inputs,
        targets,
        cluster,
        num_slices,
        k,
        sizes,
        num_microbatches,
        steps,
        max_grad_norm,
        log,
    )
    single = run(1)
    paired = None
    if len(single.stages) > num_slices:  # some slice holds two units: pair them, then the units again
        paired = run(2)
        single = quieter(single, run(1))
    if paired:
        program = program_s(single, paired)
        task, overhead = task_and_step_s([single, paired], program)
    else:  # one unit per slice: no second grouping tells per program or per task from per step
        program, task, overhead = 0.0, 0.0, _rest_s(single, 0.0, 0.0)
    log(
        f"profile: {1e3 * program:.2f} ms per program, {1e3 * task:.2f} ms per task, "
        f"{1e3 * overhead:.2f} ms per step; slices sharing cores: {single.core_groups or 'none'}"
    )
    # Each unit's compute: its program's time less the program's fixed cost, which a stage
    # of several units pays once (charged per task as task_gap_s).
    fwd, bin_, bw, upd = (
        np.array(
            [[max(0.0, d[kind, k] - program) if (kind, k) in d else 0.0 for k in range(U)] for d in single.durations]
        )
        for kind in (FORWARD, BACKWARD, WEIGHT, UPDATE)
    )
    fwd, bin_, bw, upd = (affine_in_size(sizes, t) for t in (fwd, bin_, bw, upd))
    latency, bandwidth = (0.0, float("inf")) if num_slices < 2 else measure_transfer(cluster, transfer_sizes)
    names = tuple(type(u).__name__ for u in units)
    return Profile(
        sizes,
        fwd,
        bin_,
        bw,
        upd,
        params,
        opt,
        resid,
        kept,
        bound,
        latency,
        bandwidth,
        task,
        overhead,
        names,
        program,
        single.core_groups,
    )


def _measure(
    units,
    loss_fn,
    optimizer,
    inputs,
    targets,
    cluster,
    num_slices,
    units_per_stage,
    sizes,
    num_microbatches,
    steps,
    max_grad_norm,
    log,
) -> Grouping:
    from mpmd.stages.split import cut
    from mpmd.train.trainer import Trainer

    stages = profile_stages(len(units), num_slices, units_per_stage)
    schedule = profile_schedule(len(units), num_slices, num_microbatches, units_per_stage)
    pipe = Pipeline(units if units_per_stage == 1 else cut(units, [a for a, _ in stages[1:]]), loss_fn)
    trainer = Trainer(pipe, optimizer, schedule=schedule, cluster=cluster, max_grad_norm=max_grad_norm)
    durations, step_times = [], []
    groups = ()
    try:
        for size in sizes:
            t0 = time.perf_counter()
            x, y = _rows(inputs, size * num_microbatches), _rows(targets, size * num_microbatches)
            # Compiles this size's programs; the first traced step compiles more of its own
            # (bench_schedules warms up the same way), so neither is timed.
            trainer.step(x, y)
            groups = core_groups_of(cluster, num_slices)  # the workers are up now
            trainer.step(x, y, trace=True)
            traced = [trainer.step(x, y, trace=True)["events"] for _ in range(steps)]
            # Steps are timed untraced, as they run in training (a traced step also counts
            # the bytes a slice holds after every instruction, and waits for every program).
            untraced = []
            for _ in range(steps + 4):
                begin = time.perf_counter()
                trainer.step(x, y)
                untraced.append(time.perf_counter() - begin)
            durations.append({key: statistics.median(v) for key, v in task_durations(traced, groups).items()})
            step_times.append(statistics.median(untraced))
            log(
                f"profiled microbatch size {size}, {len(stages)} stages of <= {units_per_stage} units: "
                f"step {1e3 * step_times[-1]:.1f} ms ({time.perf_counter() - t0:.1f} s)"
            )
    finally:
        trainer.close(close_cluster=False)
    return Grouping(stages, schedule, durations, step_times, groups)


def quieter(a: Grouping, b: Grouping) -> Grouping:
    """Two passes of one grouping (before and after the other grouping's, so a load that
    drifts over the profile weighs on both groupings alike): per size, the pass whose step
    was shorter. Other work on the machine and a fresh cluster's first steps only ever add
    time, so the shorter pass is the one they disturbed less."""
    assert a.stages == b.stages
    pick = [i if a.step_s[i] <= b.step_s[i] else None for i in range(len(a.step_s))]
    return a._replace(
        durations=[a.durations[i] if p is not None else b.durations[i] for i, p in enumerate(pick)],
        step_s=[min(x, y) for x, y in zip(a.step_s, b.step_s)],
    )


def program_s(single: Grouping, paired: Grouping) -> float:
    """The fixed seconds in every traced program's duration, whatever its size (dispatch,
    argument handling, launch, the wait for its end): per stage of `paired` that fuses n > 1
    units and per size, (the units' own programs' seconds - the fused stage's programs'
    seconds) / (their programs - its programs), every kind (F, B, W, U) together; the median
    over stages and sizes, at least 0."""
    samples = []
    for d1, d2 in zip(single.durations, paired.durations):
        for k, (a, z) in enumerate(paired.stages):
            if z - a < 2:
                continue
            mine = [v for (kind, u), v in d1.items() if a <= u < z]
            fused = [v for (kind, s), v in d2.items() if s == k]
            if mine and fused and len(mine) > len(fused):
                samples.append((sum(mine) - sum(fused)) / (len(mine) - len(fused)))
    return max(0.0, statistics.median(samples)) if samples else 0.0


def _grouping_step_s(g: Grouping, i: int, program: float, task: float) -> float:
    """Size i's step of grouping `g` simulated from its own traced programs, each charged
    `task` instead of `program` (at least 0 s)."""
    d = g.durations[i]
    at = lambda kind, k: max(0.0, d[kind, k] - program + task) if (kind, k) in d else 0.0
    costs = [
        {FORWARD: at(FORWARD, k), BACKWARD: at(BACKWARD, k), WEIGHT: at(WEIGHT, k)}
        for k in range(g.schedule.num_stages)
    ]
    updates = [sum(at(UPDATE, k) for k in g.schedule.stages_on(r)) for r in range(g.schedule.num_slices)]
    return shared_step_s(g.schedule, costs, updates, 0.0, g.core_groups)


def _rest_s(g: Grouping, program: float, task: float) -> float:
    """Per step: the median over sizes of the measured step beyond the simulated one, >= 0."""
    return max(0.0, statistics.median(t - _grouping_step_s(g, i, program, task) for i, t in enumerate(g.step_s)))


def task_and_step_s(groupings, program: float, most_s: float = 0.05) -> tuple[float, float]:
    """(task_s, step_overhead_s): what one task costs an untraced step beyond its compute
    (its program's fixed cost and the executor's walk around it: sends, receives, deletes),
    and what a step costs whatever its tasks (the controller feeding the batch and taking
    the loss back). Two groupings of the same units run the same compute in different
    numbers of tasks: task_s is the charge per task at which the simulated steps differ as
    much as the measured ones (summed over sizes; bisection on [0, most_s], the difference
    grows with it), step_overhead_s what the measured steps hold beyond the simulated ones."""
    a, b = groupings
    sizes = range(len(a.step_s))
    measured = sum(a.step_s[i] - b.step_s[i] for i in sizes)
    diff = lambda task: (
        sum(_grouping_step_s(a, i, program, task) - _grouping_step_s(b, i, program, task) for i in sizes) - measured
    )
    lo, hi = 0.0, most_s
    if diff(lo) >= 0:
        task = lo
    elif diff(hi) <= 0:
        task = hi
    else:
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if diff(mid) < 0 else (lo, mid)
        task = (lo + hi) / 2
    rest = statistics.median([_rest_s(a, program, task), _rest_s(b, program, task)])
    return task, rest


def affine_in_size(sizes, seconds: np.ndarray) -> np.ndarray:
    """`seconds` [size, unit] replaced by a + b * size per unit, with the robust Theil-Sen
    line (b the median of the slopes between every two sizes, a the median intercept), when
    at least three sizes were measured. A program's time is affine in its rows (the matmuls
    grow with them; launching it and what depends on the parameters alone do not), and on a
    shared machine one size's measurement can catch a burst of other load: the line through
    the others sets it right. Negative values are clipped to 0."""
    x = np.asarray(sizes, float)
    if len(x) < 3:
        return seconds
    i, j = np.triu_indices(len(x), 1)
    slope = np.median((seconds[j] - seconds[i]) / (x[j] - x[i])[:, None], axis=0)
    intercept = np.median(seconds - x[:, None] * slope, axis=0)
    return np.maximum(0.0, intercept + x[:, None] * slope)


def _rows(batch, n: int):
    """The first n rows of `batch` (a pytree of arrays), going round again if it has fewer."""
    return jax.tree.map(lambda a: np.take(np.asarray(a), np.arange(n) % len(a), axis=0), batch)


def measure_transfer(cluster, sizes_bytes, num_microbatches: int = 4, steps: int = 3) -> tuple[float, float]:
    """(latency_s, bytes_per_s) between slices 0 and 1 of `cluster`: least squares over the
    gaps between F(s0, mb) ending and F(s1, mb) starting in dry runs whose programs take no
    time, one per activation size. A fit whose slope is not positive (transfers too fast to
    tell sizes apart) gives an unbounded bandwidth."""
    from mpmd.lowering.dryrun import dry_run

    sizes, gaps = [], []
    for num_bytes in sizes_bytes:
        result = dry_run(
            schedules.gpipe(2, num_microbatches),
            {FORWARD: 0.0, BACKWARD: 0.0, WEIGHT: 0.0},
            activation_bytes=int(num_bytes),
            cluster=cluster,
            steps=steps,
        )
        for events in result.events:
            ends = {m[3]: e.end_ns for e in events[0] if (m := _LABEL.match(e.name)) and m[1] == FORWARD}
            for e in events[1]:
                m = _LABEL.match(e.name)
                if m and m[1] == FORWARD and m[3] in ends:
                    sizes.append(float(num_bytes))
                    gaps.append(max(0.0, (e.start_ns - ends[m[3]]) / 1e9))
    slope, intercept = np.polyfit(np.asarray(sizes), np.asarray(gaps), 1)
    if slope <= 0:
        return float(np.median(gaps)), float("inf")
    return max(0.0, float(intercept)), float(1.0 / slope)
