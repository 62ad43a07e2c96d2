"""One walk over a schedule's task arrays that proves it complete and deadlock-free and
times every task: what `schedules.validate`, `schedules.execution_order` and
`simulate.simulate` share.

The walk goes in rounds. In each round every slice that is not finished looks at its next
task and runs it if the task's dependency on another slice has run in an earlier round;
its start is max(the slice is free, that dependency's end + comm_s). A dependency on the
task's own slice (B on its F, W on its B, F across the turn of a V) needs no look-up: the
slice runs in order, so it is met iff it sits earlier in the list, which is checked once
for all tasks up front. A round that runs nothing, with tasks left, is a deadlock.

Each round is a handful of numpy operations over the p slices, and a pipeline needs about
as many rounds as its longest task list (neighbouring slices advance in lock-step), so
p = 1,024, m = 8,192 is ~16 k (1F1B) to ~50 k (ZB-V) rounds of 1,024-wide vector work
instead of 16 M to 50 M Python steps. Start times are stored per task (float64, in task
order); a task's end is start + cost, computed the same way the per-task definition does,
so the figures are the same bit for bit.
"""

from __future__ import annotations

import numpy as np

from mpmd.schedules.core import BACKWARD, FORWARD, WEIGHT, Schedule, ScheduleError, Task, dependencies
from mpmd.schedules.task_arrays import KIND_CODES, KINDS, TaskArrays, as_arrays

_CHUNK = 1 << 20  # tasks per vectorised pass over the arrays: bounds the temporaries


class Walk:
    """The result. `end[i]` is task i's end (task order of `tasks`); `busy[r]` and `free[r]`
    slice r's summed cost and end; `rounds[i]` (if asked) the round task i ran in.
    `starts(a, b)` gives tasks a..b-1's starts (one slice's range), recomputed from the ends
    the way the walk formed them: max(the previous task's end, the dependency's end + comm_s)."""

    def __init__(self, tasks: TaskArrays, end, packed, comm_s, busy, free, rounds):
        self.tasks, self._end, self._packed, self._comm_s = tasks, end, packed, comm_s
        self.end = end[: tasks.num_tasks]
        self.busy, self.free, self.rounds = busy, free, rounds

    def starts(self, a: int, b: int) -> np.ndarray:
        previous = np.concatenate(([0.0], self._end[a : b - 1])) if b > a else np.zeros(0)
        return np.maximum(previous, self._end[self._packed[a:b] & _DEP_MASK] + self._comm_s)


def index_type(num_stages: int, num_microbatches: int):
    """int32 while every identity (< 3 S m) fits, else int64: half the memory traffic."""
    return np.int32 if 3 * num_stages * num_microbatches + 2 < 2**31 else np.int64


def identities(stage, mb, kind, num_stages: int, num_microbatches: int) -> np.ndarray:
    """(kind * S + stage) * m + mb: one integer per (stage, mb, kind), of index_type."""
    ks = kind.astype(index_type(num_stages, num_microbatches)) * num_stages + stage
    ks *= num_microbatches
    ks += mb
    return ks


# Per task, one int64 holds the index of the task on another slice it waits for (low 32
# bits) and its cost code (high bits), so a round reads both with one gather.
_DEP_BITS = 32
_DEP_MASK = (1 << _DEP_BITS) - 1


def walk(
    schedule: Schedule, cost_index=None, cost_table=None, comm_s: float = 0.0, record_rounds: bool = False
) -> Walk:
    """Validate `schedule` (ScheduleError naming the task otherwise) and time it: task i
    costs cost_table[cost_index[i]] (None: every task costs 0)."""
    tasks = as_arrays(schedule.slices)
    S, m = schedule.num_stages, schedule.num_microbatches
    _check_header(schedule, len(tasks))
    placement = np.asarray(schedule.placement, dtype=np.int64)
    N = tasks.num_tasks
    assert N + 2 < 2**_DEP_BITS
    kinds = 3 if schedule.split_backward else 2
    if N != S * m * kinds or not _structure_ok(tasks, placement, S, m, kinds):
        _raise_structure_error(schedule, tasks)  # the slow path names the first bad task
    where = _positions(tasks, S, m)  # identity -> task index
    if where is None:
        _raise_structure_error(schedule, tasks)
    if cost_table is None:
        cost_index, cost_table = np.zeros(N, dtype=np.int8), np.zeros(1)
    cost_table = np.asarray(cost_table, dtype=np.float64)
    packed = _cross_dependencies(tasks, where, placement, S, m)
    del where
    for a, b in _chunks(N):
        packed[a:b] |= cost_index[a:b].astype(np.int64) << _DEP_BITS
    # end[N] = -inf: "no dependency on another slice", met at once; end[N+1] = NaN: never.
    end = np.empty(N + 2)
    end.fill(np.nan)
    end[N] = -np.inf
    rounds = np.zeros(N, dtype=np.int32) if record_rounds else None
    p = len(tasks)
    pos, stop = tasks.offsets[:-1].copy(), tasks.offsets[1:]
    free, busy = np.zeros(p), np.zeros(p)
    active = np.flatnonzero(pos < stop)
    # Rounds until some active slice runs out, if every round ran every slice: the check
    # for finished slices is needed only then (or after a round where some waited).
    until_done = int((stop - pos)[active].min()) if active.size else 0
    step = 0
    while active.size:
        everyone = active.size == p  # then whole arrays stand in for active ones
        i = pos if everyone else pos[active]
        word = packed[i]
        ready = end[word & _DEP_MASK]
        if comm_s:
            ready += comm_s
        cost = cost_table[word >> _DEP_BITS]
        if everyone and not np.isnan(ready.sum()):  # nothing waits (ends are never +inf)
            # Every slice runs its next task: the common round, done in place.
            np.maximum(free, ready, out=free)
            free += cost
            end[i] = free
            busy += cost
            if rounds is not None:
                rounds[i] = step
            pos += 1
            until_done -= 1
        else:
            running = active
            waiting = np.isnan(ready)
            if waiting.any():
                if waiting.all():
                    raise ScheduleError(_deadlock_message(schedule, tasks, end, pos, active))
                ok = ~waiting
                running, i, ready, cost = active[ok], i[ok], ready[ok], cost[ok]
            finish = np.maximum(free[running], ready) + cost
            end[i] = finish
            free[running] = finish
            busy[running] += cost
            if rounds is not None:
                rounds[i] = step
            pos[running] += 1
            until_done = 0
        step += 1
        if until_done <= 0:
            active = np.flatnonzero(pos < stop)
            until_done = int((stop - pos)[active].min()) if active.size else 0
    return Walk(tasks, end, packed, float(comm_s), busy, free, rounds)


def _check_header(schedule: Schedule, p: int) -> None:
    S, m, v = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    if v < 1 or S < 1 or m < 1:
        raise ScheduleError(
            f"schedule {schedule.name!r} has num_stages={S}, num_microbatches={m}, virtual_stages={v}; all must be >= 1"
        )
    placement = tuple(schedule.placement)
    if len(placement) != S or not all(isinstance(r, (int, np.integer)) and 0 <= r < p for r in placement):
        raise ScheduleError(
            f"schedule {schedule.name!r} placement {placement!r} must give each of its {S} stages a slice in [0, {p})"
        )
    held = [placement.count(r) for r in range(p)]
    if min(held) == 0 or max(held) != v:
        raise ScheduleError(
            f"schedule {schedule.name!r} placement {placement!r} puts {held} stages "
            f"on its slices; every slice must hold at least one and the most any "
            f"holds must equal virtual_stages={v}"
        )


def _chunks(n: int):
    for a in range(0, n, _CHUNK):
        yield a, min(n, a + _CHUNK)


def _structure_ok(tasks: TaskArrays, placement, S: int, m: int, kinds: int) -> bool:
    """Every task of a known kind, in range and on its stage's slice (vectorised)."""
    for a, b in _chunks(tasks.num_tasks):
        stage, mb, kind = tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b]
        if ((kind < 0) | (kind >= kinds) | (stage < 0) | (stage >= S) | (mb < 0) | (mb >= m)).any():
            return False
    for r in range(len(tasks)):
        if (placement[tasks.stage[tasks.offsets[r] : tasks.offsets[r + 1]]] != r).any():
            return False
    return True


def _positions(tasks: TaskArrays, S: int, m: int):
    """identity -> task index, or None when some identity is not held by any task (the
    count being right and every identity in range, that is exactly when one appears twice)."""
    N = tasks.num_tasks
    dtype = index_type(S, m)
    where = np.full(N, -1, dtype=dtype)
    for a, b in _chunks(N):
        where[identities(tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b], S, m)] = np.arange(a, b, dtype=dtype)
    if (where < 0).any():
        return None
    return where


def _cross_dependencies(tasks: TaskArrays, where, placement, S: int, m: int) -> np.ndarray:
    """Per task (int64), the index of the task on another slice it waits for; N if none; N+1
    (never runs) if it waits for a task of its own slice that comes later in the list."""
    N = tasks.num_tasks
    out = np.empty(N, dtype=np.int64)
    # Tables over (kind, stage) = kind * S + stage: whether the task waits for the
    # neighbouring stage (F on s-1, B on s+1), how far that task's identity is, and
    # whether the neighbour sits on the same slice.
    dtype = index_type(S, m)
    stage = np.arange(S)
    has = np.concatenate((stage > 0, stage < S - 1, np.zeros(S, bool)))
    step = (np.concatenate((np.full(S, -m), np.full(S, m), np.zeros(S, np.int64))) * has).astype(dtype)
    neighbour = np.concatenate((np.maximum(stage - 1, 0), np.minimum(stage + 1, S - 1), stage))
    same = has & (placement[neighbour] == np.tile(placement, 3))
    no_cross = ~has | same
    # Own-stage dependency (B on F, W on B): S*m identities back; F has none, and its own
    # identity stands in (never later than itself).
    own_step = np.concatenate((np.zeros(S), np.full(2 * S, S * m))).astype(dtype)
    for a, b in _chunks(N):
        ks = tasks.kind[a:b].astype(dtype) * S + tasks.stage[a:b]
        ident = ks * m + tasks.microbatch[a:b]
        here = np.arange(a, b, dtype=dtype)
        dep = where[ident + step[ks]]  # the task itself where there is no neighbour
        late = same[ks] & (dep > here)
        dep[no_cross[ks]] = N
        late |= where[ident - own_step[ks]] > here
        dep[late] = N + 1
        out[a:b] = dep
    return out


def _raise_structure_error(schedule: Schedule, tasks: TaskArrays) -> None:
    """The first bad task in slice order, named as the per-task check names it."""
    S, m = schedule.num_stages, schedule.num_microbatches
    placement = tuple(schedule.placement)
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule.split_backward else (FORWARD, BACKWARD)
    seen = set()
    for r in range(len(tasks)):
        a, b = int(tasks.offsets[r]), int(tasks.offsets[r + 1])
        for i, (stage, mb, code) in enumerate(
            zip(tasks.stage[a:b].tolist(), tasks.microbatch[a:b].tolist(), tasks.kind[a:b].tolist())
        ):
            kind = KINDS[code] if code >= 0 else _original_kind(schedule, r, i)
            task = (stage, mb, kind)
            if kind in kinds and 0 <= stage < S and 0 <= mb < m and placement[stage] == r and task not in seen:
                seen.add(task)
                continue
            where = f"{Task(*task)} at slice {r}, position {i}"
            if kind not in kinds:
                why = (
                    "W tasks appear only in schedules with split_backward=True"
                    if kind == WEIGHT
                    else f"kind must be one of {', '.join(kinds)}"
                )
                raise ScheduleError(f"bad task {where}: {why}")
            if not (0 <= stage < S and 0 <= mb < m):
                raise ScheduleError(f"bad task {where}: stage must be in [0, {S}) and mb in [0, {m})")
            if placement[stage] != r:
                raise ScheduleError(f"wrong slice: {where}; stage {stage} belongs on slice {placement[stage]}")
            raise ScheduleError(f"duplicate task {where}")
    missing = [Task(s, mb, k) for k in kinds for s in range(S) for mb in range(m) if (s, mb, k) not in seen]
    shown = ", ".join(map(str, missing[:5]))
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    raise ScheduleError(f"missing tasks: {shown}{more}")


def _original_kind(schedule: Schedule, r: int, i: int) -> str:
    # A kind outside F/B/W is coded -1 in the arrays; the hand-built list still has it.
    return schedule.slices[r][i][2]


def _deadlock_message(schedule: Schedule, tasks: TaskArrays, end, pos, stuck) -> str:
    S, m = schedule.num_stages, schedule.num_microbatches
    where = _positions(tasks, S, m)
    parts = []
    for r in sorted(stuck.tolist()):
        i = int(pos[r])
        task = Task(int(tasks.stage[i]), int(tasks.microbatch[i]), KINDS[tasks.kind[i]])
        for dep in dependencies(task, S):
            j = int(
                where[int(identities(np.array([dep[0]]), np.array([dep[1]]), np.array([KIND_CODES[dep[2]]]), S, m)[0])]
            )
            if np.isnan(end[j]):
                q = schedule.placement[dep[0]]
                parts.append(
                    f"slice {r} waits at {task}, which needs {Task(*dep)} not yet run "
                    f"(slice {q}, position {j - int(tasks.offsets[q])})"
                )
                break
    return "deadlock: " + "; ".join(parts)


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the offending task unless `schedule` is complete, places
    every task on its slice and can run to the end without deadlock."""
    walk(schedule)


def execution_order(schedule: Schedule) -> list[Task]:
    """Validate `schedule` and return all its tasks in an order that respects every
    dependency and every slice's own order (a run of the schedule with unbounded speed):
    by the round of the walk each ran in, then by slice. One Task object per task, so for
    small schedules; the simulator and lowering read the arrays instead."""
    run = walk(schedule, record_rounds=True)
    tasks = run.tasks
    order = np.lexsort((tasks.slice_of_each(), run.rounds))
    return [
        Task(s, j, KINDS[k])
        for s, j, k in zip(tasks.stage[order].tolist(), tasks.microbatch[order].tolist(), tasks.kind[order].tolist())
    ]
