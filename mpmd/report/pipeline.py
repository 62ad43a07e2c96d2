"""One traced step measured against the simulator: the same schedule, priced with that step's
own costs.

    comparison = compare(step, trace.read(run_dir)[step], schedule)
    comparison.makespan_ratio, comparison.measured_bubble, comparison.simulated_bubble

The simulator (mpmd.schedules.simulate) is given, per stage, the mean measured seconds of the
step's F, B and W runs (trace.stage_costs) and the transfer latency the step's receives show
(trace.latency_s). What runs after a slice's last backward task (the clipping norm, the
optimizer update, shared-gradient exchanges) is not a schedule task: it is chained after
the slice's last task at its measured duration, and an update waits for every slice's norm
(plus the latency) when the step clipped, as the norm exchange makes it. Both timelines
start at 0 = the step's first run, and both bubbles are trace.measured_bubble over runs, so
the measured bubble is the `bubble` metrics.jsonl records for the step.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from mpmd.report import trace
from mpmd.report.trace import Span
from mpmd.schedules.core import Schedule
from mpmd.schedules.simulate import simulate

NUM_DEPARTURES = 8  # tasks listed that add the most delay over the simulated timeline
_UPDATE, _NORM = "U ", "norm "


class Departure(NamedTuple):
    slice: int
    name: str
    measured_start_s: float
    measured_s: float
    simulated_start_s: float
    simulated_s: float
    # How much further this run's measured end is from its simulated end than the slice's
    # previous run's: the delay (or gain) the run itself adds, by running longer than its
    # stage's mean or by waiting longer for its inputs than the simulated latency.
    added_s: float

    @property
    def end_gap_s(self) -> float:
        """Measured end - simulated end: > 0 when the task finished later than simulated."""
        return (self.measured_start_s + self.measured_s) - (self.simulated_start_s + self.simulated_s)


class Comparison(NamedTuple):
    step: int
    schedule: Schedule
    measured: list[list[Span]]  # per slice, the trace's runs and receives
    simulated: list[list[Span]]  # per slice, the simulated runs (same names as measured)
    costs: list[dict]  # per stage {"F", "B", "W"} seconds, as simulated
    comm_s: float  # transfer latency simulated per cross-slice dependency
    measured_makespan_s: float  # first run's start to last run's end
    simulated_makespan_s: float
    measured_bubble: float
    simulated_bubble: float
    departures: list[Departure]  # the NUM_DEPARTURES largest |added_s|, largest first

    @property
    def makespan_ratio(self) -> float:
        """Measured over simulated makespan (1: the runtime does what the simulator promised)."""
        return self.measured_makespan_s / self.simulated_makespan_s if self.simulated_makespan_s > 0 else float("nan")


def _runs(spans: Sequence[Span]) -> list[Span]:
    return [s for s in spans if s.kind == "run"]


def _makespan(slices: Sequence[Sequence[Span]]) -> float:
    runs = [s for spans in slices for s in _runs(spans)]
    return max(s.end_s for s in runs) - min(s.start_s for s in runs) if runs else 0.0


def _rebase(slices: Sequence[Sequence[Span]]) -> list[list[Span]]:
    """Times after the first run's start (a receive posted before it starts below 0)."""
    origin = min((s.start_s for spans in slices for s in _runs(spans)), default=0.0)
    return [[s._replace(start_s=s.start_s - origin, end_s=s.end_s - origin) for s in spans] for spans in slices]


def simulated_spans(
    schedule: Schedule, costs: list[dict], comm_s: float, tails: Sequence[Sequence[Span]]
) -> list[list[Span]]:
    """Per slice, the schedule's tasks as the simulator places them (tasks the runtime runs no
    program for, priced 0, left out), then the slice's `tails` (its measured runs after the
    last task, at their measured durations; an update after every slice's norm + comm_s)."""
    sim = simulate(schedule, costs, comm_s)
    out = []
    for r, spans in enumerate(sim.spans):
        out.append(
            [
                Span(f"{task.kind} s{task.stage} mb{task.microbatch}", "run", start, end)
                for task, start, end in spans
                if end > start
            ]
        )
    clipped = any(s.name.startswith(_NORM) for t in tails for s in t)
    before_update = []
    for r, tail in enumerate(tails):  # the runs before the update: norm, shared gradients
        t = out[r][-1].end_s if out[r] else 0.0
        for s in tail:
            if s.name.startswith(_UPDATE):
                break
            out[r].append(Span(s.name, "run", t, t + s.duration_s))
            t += s.duration_s
        before_update.append(t)
    all_norms = max(before_update, default=0.0) + comm_s
    for r, tail in enumerate(tails):
        t = max(before_update[r], all_norms) if clipped else before_update[r]
        seen_update = False
        for s in tail:
            seen_update = seen_update or s.name.startswith(_UPDATE)
            if seen_update:
                out[r].append(Span(s.name, "run", t, t + s.duration_s))
                t += s.duration_s
    return out


def compare(step: int, slices: Sequence[Sequence[Span]], schedule: Schedule) -> Comparison:
    """The measured step `slices` (trace.read's spans of one step) next to `schedule`
    simulated with the costs measured in it. ValueError when the trace is not a step of that
    schedule (another slice count, a stage missing)."""
    if len(slices) != schedule.num_slices:
        raise ValueError(
            f"step {step} was traced on {len(slices)} slices, but its schedule "
            f"{schedule.name} has {schedule.num_slices}"
        )
    measured = _rebase(slices)
    costs = trace.stage_costs(measured, schedule.num_stages, schedule.split_backward)
    comm_s = trace.latency_s(measured)
    tails = []
    for spans in measured:
        runs = _runs(spans)
        last_task = max((i for i, s in enumerate(runs) if s.task is not None), default=-1)
        tails.append(runs[last_task + 1 :])
    simulated = simulated_spans(schedule, costs, comm_s, tails)
    return Comparison(
        step,
        schedule,
        measured,
        simulated,
        costs,
        comm_s,
        _makespan(measured),
        _makespan(simulated),
        trace.measured_bubble(measured),
        trace.measured_bubble(simulated),
        _departures(measured, simulated),
    )


def _departures(measured, simulated) -> list[Departure]:
    out = []
    for r, (got, want) in enumerate(zip(measured, simulated)):
        planned = {s.name: s for s in want}
        gap = 0.0
        for s in _runs(got):
            if s.name in planned:
                p = planned[s.name]
                d = Departure(r, s.name, s.start_s, s.duration_s, p.start_s, p.duration_s, 0.0)
                out.append(d._replace(added_s=d.end_gap_s - gap))
                gap = d.end_gap_s
    return sorted(out, key=lambda d: -abs(d.added_s))[:NUM_DEPARTURES]
