"""Pipeline schedules as data.

A schedule is one ordered task list per slice; a task is (stage, microbatch, kind) with kind
F (forward), B (backward) or W (weight gradient). Every schedule here is produced by one
generator, `_slice_tasks`: warm-up forwards, then forward/backward pairs, then the remaining
backwards, with weight-gradient tasks optionally held back by a fixed lag. The schedules only
differ in which forwards a slice owns, in what order, how many it runs before its first
backward, and how long W may lag. Nothing here imports jax: schedules can be printed,
validated, simulated (mpmd.simulate) and drawn (mpmd.render) without a device.

Placement (which slice holds which stage) is part of the schedule: `Schedule.placement[k]`
is stage k's slice, produced by the generator and read by everything downstream (lowering,
simulator, dry run, trainer, checkpoints). One stage per slice is the identity; interleaved
uses a loop (slice r holds r, r+p, ...); a V (`v_placement`) or a shrunk cluster only
changes this table.

Dependencies (what validity means): F(s, mb) needs F(s-1, mb); B(s, mb) needs F(s, mb) and
B(s+1, mb) unless s is the last stage; W(s, mb) needs B(s, mb). Each slice runs its list
strictly in order, one task at a time.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


class Task(NamedTuple):
    stage: int  # global stage index 0..num_stages-1
    microbatch: int
    # "F" forward, "B" backward, "W" weight gradient. In a schedule with split_backward=False
    # "B" is the full backward (input and weight gradients) and there are no "W" tasks; with
    # split_backward=True "B" is the input gradient only and "W" the weight gradient.
    kind: str

    def __str__(self) -> str:
        return f"{self.kind}(stage={self.stage}, mb={self.microbatch})"


class Schedule(NamedTuple):
    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int  # stages per slice (the most any slice holds)
    split_backward: bool
    slices: tuple[tuple[Task, ...], ...]  # one ordered task list per slice
    placement: tuple[int, ...]  # placement[k]: the slice that holds stage k

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    def stages_on(self, slice_index: int) -> tuple[int, ...]:
        """The stages slice `slice_index` holds, ascending."""
        return tuple(k for k, r in enumerate(self.placement) if r == slice_index)


class ScheduleError(ValueError):
    """A schedule that breaks placement, completeness or a dependency."""


def loop_placement(num_stages: int, num_slices: int) -> tuple[int, ...]:
    """Slice r holds stages r, r+p, r+2p, ...: consecutive stages sit on consecutive slices,
    so an interleaved schedule loops over the slices v times (one stage per slice when
    num_stages == num_slices)."""
    return tuple(k % num_slices for k in range(num_stages))


def v_placement(num_stages: int, num_slices: int) -> tuple[int, ...]:
    """Stages go down the slices and back up (0..p-1, p-1..0, 0..p-1, ...): slice 0 holds
    the first and the last stage, as in ZB-V and DualPipeV, so the pipeline's two ends meet
    on one slice and the turn at slice p-1 needs no transfer."""
    p = num_slices
    return tuple(k % p if (k // p) % 2 == 0 else p - 1 - k % p for k in range(num_stages))


def dependencies(task: Task, num_stages: int) -> tuple[tuple, ...]:
    """The tasks `task` must wait for (plain tuples; they compare and hash equal to Tasks)."""
    stage, mb, kind = task
    if kind == FORWARD:
        return ((stage - 1, mb, FORWARD),) if stage > 0 else ()
    if kind == BACKWARD:
        if stage == num_stages - 1:
            return ((stage, mb, FORWARD),)
        return ((stage, mb, FORWARD), (stage + 1, mb, BACKWARD))
    return ((stage, mb, BACKWARD),)


# ---------------------------------------------------------------------------------------
# Generators


def _slice_tasks(forwards, backwards, num_warmup, w_lag):
    """One slice's task list.

    forwards / backwards: the slice's (stage, mb) pairs in the order their F / B run.
    num_warmup: forwards run before the first backward; after them F and B alternate until
    the forwards run out, then the remaining backwards run.
    w_lag: None for a non-split backward (no W tasks). Otherwise the number of W tasks that
    may wait after their B; W runs oldest first and the rest are flushed at the end. A lag
    of 0 is B immediately followed by its W.
    """
    assert len(forwards) == len(backwards) and 0 <= num_warmup <= len(forwards)
    tasks = [Task(s, mb, FORWARD) for s, mb in forwards[:num_warmup]]
    pending_w = deque()

    def backward(stage, mb):
        tasks.append(Task(stage, mb, BACKWARD))
        if w_lag is not None:
            pending_w.append((stage, mb))
            if len(pending_w) > w_lag:
                tasks.append(Task(*pending_w.popleft(), WEIGHT))

    num_steady = len(forwards) - num_warmup
    for (fs, fmb), (bs, bmb) in zip(forwards[num_warmup:], backwards[:num_steady]):
        tasks.append(Task(fs, fmb, FORWARD))
        backward(bs, bmb)
    for bs, bmb in backwards[num_steady:]:
        backward(bs, bmb)
    tasks.extend(Task(s, mb, WEIGHT) for s, mb in pending_w)
    return tuple(tasks)


def _check_counts(name, num_stages, num_microbatches, virtual_stages, needs_full_pipeline):
    for field, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                         ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"schedule '{name}' needs {field} to be an integer >= 1, "
                             f"got {value!r}")
    if num_stages % virtual_stages:
        raise ValueError(f"schedule '{name}' needs num_stages divisible by virtual_stages "
                         f"({virtual_stages}), got num_stages={num_stages}")
    p = num_stages // virtual_stages
    # Schedules that run at most ~p microbatches in flight fill the pipeline only when there
    # are at least p of them; below that 1F1B's memory bound is moot and GPipe is the answer.
    if needs_full_pipeline and num_microbatches < p:
        raise ValueError(f"schedule '{name}' needs num_microbatches >= number of pipeline "
                         f"slices ({p}), got {num_microbatches}")
    return p


def _per_rank(name, num_stages, num_microbatches, warmup, w_lag=None):
    """A one-stage-per-slice schedule; warmup(r, p) and w_lag(r, p) are per-slice knobs."""
    p, m = num_stages, num_microbatches
    slices = []
    for r in range(p):
        pairs = [(r, mb) for mb in range(m)]
        lag = None if w_lag is None else w_lag(r, p)
        slices.append(_slice_tasks(pairs, pairs, warmup(r, p), lag))
    return Schedule(name, p, m, 1, w_lag is not None, tuple(slices), loop_placement(p, p))


def gpipe(num_stages: int, num_microbatches: int, placement=None) -> Schedule:
    """GPipe: every forward, then every backward. Keeps all m microbatches alive.

    `placement` (stage -> slice; default one stage per slice) may put several stages on a
    slice, e.g. `v_placement(4, 2)`: a slice then runs its stages' forwards in ascending
    stage order and their backwards in descending order, which cannot deadlock for any
    placement (every wait points to a lower stage in the forward phase, a higher one in
    the backward phase).
    """
    _check_counts("gpipe", num_stages, num_microbatches, 1, needs_full_pipeline=False)
    if placement is None:
        return _per_rank("gpipe", num_stages, num_microbatches, lambda r, p: num_microbatches)
    placement = _check_placement("gpipe", num_stages, placement)
    slices = []
    for r in range(max(placement) + 1):
        mine = [k for k in range(num_stages) if placement[k] == r]
        forwards = [(k, mb) for k in mine for mb in range(num_microbatches)]
        backwards = [(k, mb) for k in reversed(mine) for mb in range(num_microbatches)]
        slices.append(_slice_tasks(forwards, backwards, len(forwards), None))
    most = max(placement.count(r) for r in range(len(slices)))
    return Schedule("gpipe", num_stages, num_microbatches, most, False, tuple(slices), placement)


def _check_placement(name: str, num_stages: int, placement) -> tuple[int, ...]:
    """placement as a tuple, or ValueError unless it maps every stage onto slices 0..p-1
    with each slice holding at least one stage."""
    placement = tuple(placement)
    if (len(placement) != num_stages
            or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in placement)):
        raise ValueError(f"schedule '{name}' needs placement to give a slice index >= 0 for each "
                         f"of the {num_stages} stages, got {placement!r}")
    empty = sorted(set(range(max(placement) + 1)) - set(placement))
    if empty:
        raise ValueError(f"schedule '{name}' placement {placement!r} leaves slice(s) {empty} "
                         f"without a stage; number the slices 0..p-1")
    return placement


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-flush).

    Slice r runs p-1-r warm-up forwards, then alternates F and B, then drains the remaining
    backwards. At most p-r microbatches are alive on slice r (p on slice 0), and the bubble
    is the same as GPipe's: (p-1)/(m+p-1).
    """
    _check_counts("1f1b", num_stages, num_microbatches, 1, needs_full_pipeline=True)
    return _per_rank("1f1b", num_stages, num_microbatches, lambda r, p: p - 1 - r)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero Bubble H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

    1F1B with the backward split into B (input gradient, on the critical path) and W (weight
    gradient, needed by nobody downstream). Slice r keeps r W tasks waiting: its first r
    backwards run without their W, every later B is followed by the oldest waiting W, and the
    last r W fill the cool-down bubble. Peak live microbatches stay at p (counting a
    microbatch alive until its W), as in 1F1B; with F=B=W the bubble drops from 1F1B's
    3(p-1) time units per slice to about (p-1).
    """
    _check_counts("zb-h1", num_stages, num_microbatches, 1, needs_full_pipeline=True)
    return _per_rank("zb-h1", num_stages, num_microbatches, lambda r, p: p - 1 - r,
                     w_lag=lambda r, p: r)


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int,
                            virtual_stages: int) -> Schedule:
    """Megatron-style interleaved 1F1B: v = virtual_stages stages per slice, p = S / v slices.

    Slice r holds stages r, r+p, ..., r+(v-1)p. Microbatches go in groups of p: for each group
    the slice runs the forwards of its first stage for every microbatch of the group, then of
    its second stage, and so on; backwards follow the same order with the stages reversed.
    Warm-up is 2(p-1-r) + (v-1)p forwards (Megatron's count: the (v-1)p forwards of one group
    on the other stages, plus two per downstream slice for the forward/backward round trip).

    Needs m to be a multiple of p, as Megatron does: with a shorter (or longer) last group the
    fixed warm-up count no longer matches the order and validate() finds deadlocks, e.g. for
    p=4, v=3, m=5 or p=8, v=2, m=10. With m = k*p the bubble is (p-1)/(v*m+p-1).
    """
    name, v = "interleaved-1f1b", virtual_stages
    if v == 1:
        raise ValueError(f"schedule '{name}' needs virtual_stages >= 2 (stages per slice), "
                         f"got 1; use '1f1b' for one stage per slice")
    p = _check_counts(name, num_stages, num_microbatches, v, needs_full_pipeline=True)
    m = num_microbatches
    if m % p:
        raise ValueError(f"schedule '{name}' needs num_microbatches to be a multiple of the "
                         f"number of pipeline slices ({p}), got {m}")
    slices = []
    for r in range(p):
        forwards, backwards = [], []
        for first in range(0, m, p):
            group = range(first, first + p)
            for chunk in range(v):
                forwards.extend((chunk * p + r, mb) for mb in group)
                backwards.extend(((v - 1 - chunk) * p + r, mb) for mb in group)
        num_warmup = min(2 * (p - 1 - r) + (v - 1) * p, m * v)
        slices.append(_slice_tasks(forwards, backwards, num_warmup, None))
    return Schedule(name, num_stages, m, v, False, tuple(slices), loop_placement(num_stages, p))


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_one_f_one_b,
    "zb-h1": zb_h1,
}


def make(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build schedule `name`; ValueError (naming what is allowed) for impossible arguments."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known schedules: "
                         f"{', '.join(sorted(SCHEDULES))}")
    generator = SCHEDULES[name]
    if generator is interleaved_one_f_one_b:
        return generator(num_stages, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"schedule '{name}' supports only virtual_stages=1, got "
                         f"{virtual_stages!r}; only 'interleaved-1f1b' takes virtual stages")
    return generator(num_stages, num_microbatches)


# ---------------------------------------------------------------------------------------
# Validation


def _check_structure(schedule: Schedule) -> None:
    """Placement and completeness: each (stage, mb, kind) exactly once, on its slice."""
    S, m, v = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    if v < 1 or S < 1 or m < 1:
        raise ScheduleError(f"schedule {schedule.name!r} has num_stages={S}, "
                            f"num_microbatches={m}, virtual_stages={v}; all must be >= 1")
    p, placement = len(schedule.slices), tuple(schedule.placement)
    if len(placement) != S or not all(isinstance(r, int) and 0 <= r < p for r in placement):
        raise ScheduleError(f"schedule {schedule.name!r} placement {placement!r} must give each of "
                            f"its {S} stages a slice in [0, {p})")
    held = [placement.count(r) for r in range(p)]
    if min(held) == 0 or max(held) != v:
        raise ScheduleError(f"schedule {schedule.name!r} placement {placement!r} puts {held} stages "
                            f"on its slices; every slice must hold at least one and the most any "
                            f"holds must equal virtual_stages={v}")
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule.split_backward else (FORWARD, BACKWARD)
    seen = set()
    for r, tasks in enumerate(schedule.slices):
        for i, task in enumerate(tasks):
            stage, mb, kind = task
            if (kind in kinds and 0 <= stage < S and 0 <= mb < m and placement[stage] == r
                    and task not in seen):
                seen.add(task)
                continue
            where = f"{Task(*task)} at slice {r}, position {i}"
            if kind not in kinds:
                why = ("W tasks appear only in schedules with split_backward=True"
                       if kind == WEIGHT else f"kind must be one of {', '.join(kinds)}")
                raise ScheduleError(f"bad task {where}: {why}")
            if not (0 <= stage < S and 0 <= mb < m):
                raise ScheduleError(f"bad task {where}: stage must be in [0, {S}) and mb in "
                                    f"[0, {m})")
            if placement[stage] != r:
                raise ScheduleError(f"wrong slice: {where}; stage {stage} belongs on slice "
                                    f"{placement[stage]}")
            raise ScheduleError(f"duplicate task {where}")
    if len(seen) != S * m * len(kinds):
        missing = [Task(s, mb, k) for k in kinds for s in range(S) for mb in range(m)
                   if (s, mb, k) not in seen]
        shown = ", ".join(map(str, missing[:5]))
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ScheduleError(f"missing tasks: {shown}{more}")


def execution_order(schedule: Schedule) -> list[Task]:
    """Validate `schedule` and return all its tasks in an order that respects every
    dependency and every slice's own order (a run of the schedule with unbounded speed).

    Event-driven walk, O(total tasks): each slice runs until its next task lacks a
    dependency, then parks on that one task; finishing a task wakes the slices parked on it.
    Whatever is still parked when nothing can run is a deadlock.
    """
    _check_structure(schedule)
    S = schedule.num_stages
    slices = schedule.slices
    done = set()
    parked = {}  # missing dependency -> slices waiting for it
    position = [0] * len(slices)
    runnable = list(range(len(slices)))
    order = []
    while runnable:
        r = runnable.pop()
        tasks = slices[r]
        i = position[r]
        while i < len(tasks):
            task = tasks[i]
            missing = [dep for dep in dependencies(task, S) if dep not in done]
            if missing:
                parked.setdefault(missing[0], []).append(r)
                break
            done.add(task)
            order.append(task)
            runnable.extend(parked.pop(task, ()))
            i += 1
        position[r] = i
    if len(order) != sum(map(len, slices)):
        raise ScheduleError(_deadlock_message(schedule, position, done))
    return order


def _deadlock_message(schedule, position, done) -> str:
    S = schedule.num_stages
    where = {task: i for tasks in schedule.slices for i, task in enumerate(tasks)}
    parts = []
    for r, tasks in enumerate(schedule.slices):
        if position[r] == len(tasks):
            continue
        task = tasks[position[r]]
        blocker = next(d for d in dependencies(task, S) if d not in done)
        parts.append(f"slice {r} waits at {Task(*task)}, which needs {Task(*blocker)} not yet "
                     f"run (slice {schedule.placement[blocker[0]]}, position {where[blocker]})")
    return "deadlock: " + "; ".join(parts)


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the offending task unless `schedule` is complete, places
    every task on its slice and can run to the end without deadlock."""
    execution_order(schedule)
