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

from mpmd.schedules import BACKWARD, FORWARD, WEIGHT, Schedule, ScheduleError, Task, dependencies
from mpmd.task_arrays import KIND_CODES, KINDS, TaskArrays, as_arrays

_CHUNK = 1 << 20   # tasks per vectorised pass over the arrays: bounds the temporaries


class Walk:
    """The result: `start[i]` is task i's start (task order of `tasks`), `busy[r]` and
    `free[r]` slice r's summed cost and end, `rounds[i]` (if asked) the round task i ran in."""

    def __init__(self, tasks: TaskArrays, start, busy, free, rounds):
        self.tasks, self.start, self.busy, self.free, self.rounds = tasks, start, busy, free, rounds


def identities(stage, mb, kind, num_stages: int, num_microbatches: int) -> np.ndarray:
    """(kind * S + stage) * m + mb as int64: one integer per (stage, mb, kind)."""
    return (kind.astype(np.int64) * num_stages + stage) * num_microbatches + mb


def walk(schedule: Schedule, cost_index=None, cost_table=None, comm_s: float = 0.0,
         record_rounds: bool = False) -> Walk:
    """Validate `schedule` (ScheduleError naming the task otherwise) and time it: task i
    costs cost_table[cost_index[i]] (None: every task costs 0)."""
    tasks = as_arrays(schedule.slices)
    S, m = schedule.num_stages, schedule.num_microbatches
    _check_header(schedule, len(tasks))
    placement = np.asarray(schedule.placement, dtype=np.int64)
    N = tasks.num_tasks
    kinds = 3 if schedule.split_backward else 2
    if N != S * m * kinds or not _structure_ok(tasks, placement, S, m, kinds):
        _raise_structure_error(schedule, tasks)   # the slow path names the first bad task
    where = _positions(tasks, S, m)               # identity -> task index
    if where is None:
        _raise_structure_error(schedule, tasks)
    cross = _cross_dependencies(tasks, where, placement, S, m)
    del where
    if cost_table is None:
        cost_index, cost_table = np.zeros(N, dtype=np.int8), np.zeros(1)
    cost_table = np.asarray(cost_table, dtype=np.float64)
    start = np.full(N + 2, np.nan)
    start[N] = -np.inf            # "no dependency on another slice": met at time -inf
    rounds = np.zeros(N, dtype=np.int32) if record_rounds else None
    p = len(tasks)
    pos, stop = tasks.offsets[:-1].copy(), tasks.offsets[1:]
    free, busy = np.zeros(p), np.zeros(p)
    active = np.flatnonzero(pos < stop)
    last = N - 1
    step = 0
    while active.size:
        everyone = active.size == p      # then whole arrays stand in for active ones
        i = pos if everyone else pos[active]
        dep = cross[i]
        dep_start = start[dep]
        # A sentinel dependency (N, N+1) starts at -inf or never: its cost is moot.
        ready = dep_start + cost_table[cost_index[np.minimum(dep, last)]]
        if comm_s:
            ready += comm_s
        cost = cost_table[cost_index[i]]
        waiting = np.isnan(dep_start)
        if everyone and not waiting.any():
            # Every slice runs its next task: the common round, done in place.
            np.maximum(free, ready, out=ready)
            start[i] = ready
            np.add(ready, cost, out=free)
            busy += cost
            if rounds is not None:
                rounds[i] = step
            pos += 1
        else:
            running = active
            if waiting.any():
                if waiting.all():
                    raise ScheduleError(_deadlock_message(schedule, tasks, start, pos, active))
                ok = ~waiting
                running, i, ready, cost = active[ok], i[ok], ready[ok], cost[ok]
            begin = np.maximum(free[running], ready)
            start[i] = begin
            free[running] = begin + cost
            busy[running] += cost
            if rounds is not None:
                rounds[i] = step
            pos[running] += 1
        step += 1
        if (pos[active] == stop[active]).any():
            active = np.flatnonzero(pos < stop)
    return Walk(tasks, start[:N], busy, free, rounds)


def _check_header(schedule: Schedule, p: int) -> None:
    S, m, v = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    if v < 1 or S < 1 or m < 1:
        raise ScheduleError(f"schedule {schedule.name!r} has num_stages={S}, "
                            f"num_microbatches={m}, virtual_stages={v}; all must be >= 1")
    placement = tuple(schedule.placement)
    if len(placement) != S or not all(isinstance(r, (int, np.integer)) and 0 <= r < p for r in placement):
        raise ScheduleError(f"schedule {schedule.name!r} placement {placement!r} must give each of "
                            f"its {S} stages a slice in [0, {p})")
    held = [placement.count(r) for r in range(p)]
    if min(held) == 0 or max(held) != v:
        raise ScheduleError(f"schedule {schedule.name!r} placement {placement!r} puts {held} stages "
                            f"on its slices; every slice must hold at least one and the most any "
                            f"holds must equal virtual_stages={v}")


def _chunks(n: int):
    for a in range(0, n, _CHUNK):
        yield a, min(n, a + _CHUNK)


def _structure_ok(tasks: TaskArrays, placement, S: int, m: int, kinds: int) -> bool:
    """Every task of a known kind, in range and on its stage's slice (vectorised)."""
    for a, b in _chunks(tasks.num_tasks):
        stage, mb, kind = tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b]
        if ((kind < 0) | (kind >= kinds) | (stage < 0) | (stage >= S) | (mb < 0) | (mb >= m)).any():
            return False
        slice_of = np.searchsorted(tasks.offsets, np.arange(a, b), side="right") - 1
        if (placement[stage] != slice_of).any():
            return False
    return True


def _positions(tasks: TaskArrays, S: int, m: int):
    """identity -> task index, or None when some task appears twice (then, the count being
    right, another is missing)."""
    N = tasks.num_tasks
    where = np.full(N, -1, dtype=np.int64 if N >= 2**31 else np.int32)
    for a, b in _chunks(N):
        where[identities(tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b], S, m)] = np.arange(a, b)
    for a, b in _chunks(N):
        ident = identities(tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b], S, m)
        if (where[ident] != np.arange(a, b)).any():
            return None
    return where


def _cross_dependencies(tasks: TaskArrays, where, placement, S: int, m: int) -> np.ndarray:
    """Per task, the index of the task on another slice it waits for; N if none; N+1 (never
    runs) if it waits for a task of its own slice that comes later in the list."""
    N = tasks.num_tasks
    out = np.empty(N, dtype=where.dtype)
    never = N + 1
    for a, b in _chunks(N):
        stage, kind = tasks.stage[a:b].astype(np.int64), tasks.kind[a:b]
        ident = identities(stage, tasks.microbatch[a:b], kind, S, m)
        here = np.arange(a, b)
        f, bwd = kind == KIND_CODES[FORWARD], kind == KIND_CODES[BACKWARD]
        # The dependency on the neighbouring stage: F(s-1) for F, B(s+1) for B.
        has = (f & (stage > 0)) | (bwd & (stage < S - 1))
        neighbour = np.where(f, stage - 1, stage + 1)
        dep = np.where(has, where[np.where(has, ident + np.where(f, -m, m), 0)], N)
        same = has & (placement[np.clip(neighbour, 0, S - 1)] == placement[stage])
        late = same & (dep > here)
        dep = np.where(same, N, dep)
        # The dependency on the own stage (B on F, W on B): always on this slice.
        own = ~f
        late |= own & (where[np.where(own, ident - S * m, 0)] > here)
        out[a:b] = np.where(late, never, dep)
    return out


def _raise_structure_error(schedule: Schedule, tasks: TaskArrays) -> None:
    """The first bad task in slice order, named as the per-task check names it."""
    S, m = schedule.num_stages, schedule.num_microbatches
    placement = tuple(schedule.placement)
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule.split_backward else (FORWARD, BACKWARD)
    seen = set()
    for r in range(len(tasks)):
        a, b = int(tasks.offsets[r]), int(tasks.offsets[r + 1])
        for i, (stage, mb, code) in enumerate(zip(tasks.stage[a:b].tolist(), tasks.microbatch[a:b].tolist(),
                                                 tasks.kind[a:b].tolist())):
            kind = KINDS[code] if code >= 0 else _original_kind(schedule, r, i)
            task = (stage, mb, kind)
            if kind in kinds and 0 <= stage < S and 0 <= mb < m and placement[stage] == r and task not in seen:
                seen.add(task)
                continue
            where = f"{Task(*task)} at slice {r}, position {i}"
            if kind not in kinds:
                why = ("W tasks appear only in schedules with split_backward=True"
                       if kind == WEIGHT else f"kind must be one of {', '.join(kinds)}")
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


def _deadlock_message(schedule: Schedule, tasks: TaskArrays, start, pos, stuck) -> str:
    S, m = schedule.num_stages, schedule.num_microbatches
    where = _positions(tasks, S, m)
    parts = []
    for r in sorted(stuck.tolist()):
        i = int(pos[r])
        task = Task(int(tasks.stage[i]), int(tasks.microbatch[i]), KINDS[tasks.kind[i]])
        for dep in dependencies(task, S):
            j = int(where[int(identities(np.array([dep[0]]), np.array([dep[1]]),
                                         np.array([KIND_CODES[dep[2]]]), S, m)[0])])
            if np.isnan(start[j]):
                q = schedule.placement[dep[0]]
                parts.append(f"slice {r} waits at {task}, which needs {Task(*dep)} not yet run "
                             f"(slice {q}, position {j - int(tasks.offsets[q])})")
                break
    return "deadlock: " + "; ".join(parts)
