"""The straightforward per-task definitions of validity and of the simulated timeline: one
Python object per task, an event-driven walk, one pass of start times. mpmd.schedules.timeline's
vectorised walk must give the same answers (tests/schedules/test_schedules.py compares them)."""

from mpmd.schedules.core import ScheduleError, Task, dependencies


def execution_order(schedule) -> list:
    """All tasks in an order that respects every dependency and slice order; ScheduleError
    on a deadlock. Each slice runs until its next task lacks a dependency, then parks on it."""
    S = schedule.num_stages
    slices = [tuple(Task(*t) for t in tasks) for tasks in schedule.slices]
    done, parked, order = set(), {}, []
    position = [0] * len(slices)
    runnable = list(range(len(slices)))
    while runnable:
        r = runnable.pop()
        tasks, i = slices[r], position[r]
        while i < len(tasks):
            missing = [dep for dep in dependencies(tasks[i], S) if dep not in done]
            if missing:
                parked.setdefault(missing[0], []).append(r)
                break
            done.add(tasks[i])
            order.append(tasks[i])
            runnable.extend(parked.pop(tasks[i], ()))
            i += 1
        position[r] = i
    if len(order) != sum(map(len, slices)):
        raise ScheduleError("deadlock")
    return order


def simulate(schedule, cost, comm_s=0.0):
    """(makespan, busy per slice, ((task, start, end), ...) per slice, peak live per slice)
    with cost(task) -> seconds for each task as the schedule runs it."""
    placement = schedule.placement
    end, free_at = {}, [0.0] * schedule.num_slices
    busy = [0.0] * schedule.num_slices
    spans = [[] for _ in range(schedule.num_slices)]
    for task in execution_order(schedule):
        r = placement[task.stage]
        start = free_at[r]
        for dep in dependencies(task, schedule.num_stages):
            start = max(start, end[dep] + (comm_s if placement[dep[0]] != r else 0.0))
        end[task] = free_at[r] = start + cost(task)
        busy[r] += cost(task)
        spans[r].append((task, start, end[task]))
    last = "W" if schedule.split_backward else "B"
    peaks = []
    for tasks in schedule.slices:
        live = peak = 0
        for task in tasks:
            live += (task[2] == "F") - (task[2] == last)
            peak = max(peak, live)
        peaks.append(peak)
    return max(free_at), busy, tuple(map(tuple, spans)), tuple(peaks)
