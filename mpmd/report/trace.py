"""A run's trace.json read back: per traced step, each slice's timed tasks and receives.

trace.json (written by mpmd.recipes.run.run_log.write_trace) is Chrome-trace JSON: one process
per slice, one "X" event per traced interval with its step in args, times in microseconds
after the run's earliest traced event. Here each step's events become seconds after that
step's own first event, so two steps (or a measured and a simulated timeline) share an axis
that starts at 0.

Event names are the executor's: a Run's label ("F s1 mb3", "B s0 mb2", "W s0 mb2",
"norm s0", "U s0", or a program name where the lowering gave no label) and "recv <key>" for
a receive (the key parsed by mpmd.stages.names: act{k}/{j} enters stage k from stage k-1's
forward, grad{k}/{j} enters stage k from stage k+1's backward). Sends are not traced: a send
does not block its slice, so its cost shows only as the receiver's wait.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

from mpmd.schedules.core import BACKWARD, FORWARD, WEIGHT, Task
from mpmd.stages import names

TRACE_FILE = "trace.json"
_TASK = re.compile(r"^([FBW]) s(\d+) mb(\d+)$")  # the lowering's labels of F, B and W runs
_RECV = "recv "


class Span(NamedTuple):
    """One traced interval of a slice, in seconds after its step's first event."""

    name: str
    kind: str  # "run" | "recv"
    start_s: float
    end_s: float

    @property
    def task(self) -> Task | None:
        """The schedule task this run is (F/B/W of a stage and microbatch), else None."""
        m = _TASK.match(self.name) if self.kind == "run" else None
        return Task(int(m.group(2)), int(m.group(3)), m.group(1)) if m else None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def read(run_dir: str | Path) -> dict[int, list[list[Span]]]:
    """{step: [slice 0's spans, slice 1's, ...]} of every step in <run_dir>/trace.json, each
    slice's spans in start order; {} when the run has traced no step yet. ValueError when the
    file is not a trace."""
    path = Path(run_dir) / TRACE_FILE
    if not path.exists():
        return {}
    try:
        events = json.loads(path.read_text())["traceEvents"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a trace written by mpmd ({type(e).__name__}: {e})") from None
    raw: dict[int, dict[int, list]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        start_us = float(e["ts"])
        raw.setdefault(int(e["args"]["step"]), {}).setdefault(int(e["pid"]), []).append(
            (e["name"], e["cat"], start_us, start_us + float(e["dur"]))
        )
    out = {}
    for step, by_slice in sorted(raw.items()):
        origin_us = min(ev[2] for evs in by_slice.values() for ev in evs)
        num_slices = max(by_slice) + 1
        out[step] = [
            sorted(
                (Span(n, k, (a - origin_us) / 1e6, (b - origin_us) / 1e6) for n, k, a, b in by_slice.get(r, ())),
                key=lambda s: s.start_s,
            )
            for r in range(num_slices)
        ]
    return out


def measured_bubble(events_per_slice: Sequence[Iterable], kinds: Sequence[str] = ("run",)) -> float:
    """1 - busy / (num_slices * span), over events whose kind is in kinds.

    Events are (name, kind, start, end) tuples in any one time unit (the executor's ns, a
    Span's seconds). busy sums, per slice, the union of its intervals (so overlapping events
    are not counted twice); span = latest end - earliest start over all slices. A slice with
    no such events counts as idle for the whole span.
    """
    intervals = [sorted((e[2], e[3]) for e in events if e[1] in kinds) for events in events_per_slice]
    flat = [iv for slice_ivs in intervals for iv in slice_ivs]
    if not flat:
        raise ValueError(f"no events of kinds {tuple(kinds)} to measure a bubble from")
    span = max(end for _, end in flat) - min(start for start, _ in flat)
    if span <= 0:
        return 0.0
    busy = 0
    for slice_ivs in intervals:
        covered_to = None
        for start, end in slice_ivs:
            if covered_to is not None and start < covered_to:
                start = covered_to  # skip the part already counted
            if end > start:
                busy += end - start
            covered_to = end if covered_to is None else max(covered_to, end)
    return 1 - busy / (len(intervals) * span)


def producer(recv: Span) -> Task | None:
    """The task whose output a receive of an activation or a cotangent waits for (None for
    other receives: a clipping norm, a shared gradient)."""
    key = names.parse_key(recv.name[len(_RECV) :]) if recv.name.startswith(_RECV) else None
    if key is None or key.kind not in ("act", "grad"):
        return None
    if key.kind == "act":  # enters stage k: stage k-1's forward made it
        return Task(key.stage - 1, key.microbatch, FORWARD)
    return Task(key.stage + 1, key.microbatch, BACKWARD)  # a cotangent: stage k+1's input gradient


def latency_s(slices: Sequence[Sequence[Span]]) -> float:
    """The transfer latency a step's trace shows: the median, over receives posted before
    their producer finished (so the receiver really waited for the data), of receive end -
    producer end; 0 when no receive waited. Clocks are wall clocks, comparable on one host."""
    ends = {span.task: span.end_s for spans in slices for span in spans if span.task is not None}
    samples = sorted(
        recv.end_s - ends[task]
        for spans in slices
        for recv in spans
        if recv.kind == "recv" and (task := producer(recv)) in ends and recv.start_s < ends[task] <= recv.end_s
    )
    if not samples:
        return 0.0
    mid = len(samples) // 2
    return samples[mid] if len(samples) % 2 else (samples[mid - 1] + samples[mid]) / 2


def stage_costs(slices: Sequence[Sequence[Span]], num_stages: int, split_backward: bool) -> list[dict]:
    """Per stage, the mean measured seconds of its F, B and W runs in one step, as
    mpmd.schedules.simulate takes them. A kind the runtime runs no program for costs 0: W
    without split backward (B is the whole backward), B of the first stage with it (its input
    is data)."""
    durations: dict[tuple[int, str], list[float]] = {}
    for spans in slices:
        for span in spans:
            if span.task is not None:
                durations.setdefault((span.task.stage, span.task.kind), []).append(span.duration_s)
    costs = []
    for k in range(num_stages):
        entry = {}
        for kind in (FORWARD, BACKWARD, WEIGHT):
            got = durations.get((k, kind), [])
            entry[kind] = sum(got) / len(got) if got else 0.0
        if not durations.get((k, FORWARD)):
            raise ValueError(f"the trace has no forward of stage {k}: it is not a training step of {num_stages} stages")
        if split_backward and k > 0 and not durations.get((k, BACKWARD)):
            raise ValueError(f"the trace has no input-gradient run of stage {k}, but the schedule splits the backward")
        costs.append(entry)
    return costs
