"""`load(run_dir)`: everything a run's report shows, read from the run directory's files.

Reads only files (so it works while the run is going, and on a copied run directory):
metrics.jsonl (per step: loss, eval_loss, lr, grad_norm, tokens_per_s, step_s, time; bubble
and peak_bytes on traced steps; resumed_from, recovered, layout_changes and the cumulative
goodput where they happened), trace.json (mpmd.report.trace), config.yaml (the resolved
config), run.json (mpmd.report.record: versions, where the config came from, the dry run's
memory prediction), checkpoints/<step>/manifest.json (committed steps and their layout) and
logs/*.log. Nothing here imports JAX or the recipes.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import NamedTuple

import yaml

from mpmd.report import pipeline, record, trace
from mpmd.report.pipeline import Comparison
from mpmd.schedules import core as schedules

METRICS_FILE = "metrics.jsonl"
# goodput() keys -> the cause a page names; all but the last are time lost (their sum is
# lost_s), the last is time run on fewer slices than configured.
CAUSES = {
    "aborted_s": "detection",
    "replace_s": "replacement",
    "capacity_s": "waiting for capacity",
    "restore_s": "restore",
    "replayed_s": "replay",
    "relayout_s": "relayout",
    "reduced_width_s": "narrower layout",
}
_ELASTIC = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b}  # the layouts a shrink picks


class Mark(NamedTuple):
    """Something that happened to the run before `step` was trained: a resume from a
    checkpoint, a recovery from a lost slice, a change of layout."""

    step: int
    kind: str  # "resume" | "recovery" | "relayout"
    text: str


class StepTimes(NamedTuple):
    """Seconds per step (metrics' step_s) over the steps logged, the first (compilation,
    connections) left out when there are others."""

    median_s: float
    p10_s: float
    p90_s: float
    min_s: float
    max_s: float
    num_steps: int


class GoodputEvent(NamedTuple):
    """Seconds added to one cause of lost (or narrower) time, seen at `step`'s record."""

    step: int
    elapsed_s: float | None  # wall seconds after the first logged step (None: no times logged)
    cause: str
    seconds: float


class SliceMemory(NamedTuple):
    slice: int
    predicted: dict | None  # bytes: params, grads, optimizer, activations, total (run.json)
    measured_peak_bytes: int | None  # the most bytes of the slice's buffers in a traced step


class LogSummary(NamedTuple):
    name: str
    num_lines: int
    num_warnings: int
    num_errors: int
    last_problem: str | None


class Report(NamedTuple):
    run_dir: str
    metrics: list[dict]  # metrics.jsonl's records, in step order
    total_steps: int | None  # train.steps of the config
    finished: bool  # every step logged and the last one committed
    marks: list[Mark]
    step_time: StepTimes
    traced_steps: list[int]
    pipeline: Comparison | None  # the traced step shown, measured vs simulated
    pipeline_note: str | None  # why pipeline is None
    goodput: dict | None  # the last cumulative goodput record (None: nothing lost)
    goodput_events: list[GoodputEvent]
    wall_s: float | None  # first logged step's start to the last one's end
    memory: list[SliceMemory]
    config: dict  # config.yaml, nested
    config_sources: dict  # dotted key -> "default" | "file" | "command line"
    config_file: str | None
    overrides: list[str]
    layout: dict | None  # the newest committed checkpoint's layout
    versions: dict
    checkpoints: list[int]  # committed steps
    logs: list[LogSummary]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the steps that have it (loss, eval_loss, lr, ...)."""
        pairs = [(r["step"], r[key]) for r in self.metrics if isinstance(r.get(key), (int, float))]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def elapsed_s(self) -> list[float | None]:
        """Per record, wall seconds after the first record (None where no time was logged)."""
        return _elapsed(self.metrics)


def _elapsed(metrics: list[dict]) -> list[float | None]:
    times = [r.get("time") for r in metrics]
    t0 = next((t for t in times if t is not None), None)
    return [None if t is None or t0 is None else t - t0 for t in times]


def _read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    if not path.exists():
        raise ValueError(
            f"{run_dir} holds no {METRICS_FILE}: not an mpmd run directory, or its run has not finished a step yet"
        )
    records, lines = [], path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):  # a line being appended right now
                    break
                raise ValueError(f"{path}:{number} is not a JSON object: {line[:80]!r}") from None
    if not records:
        raise ValueError(f"{path} holds no step yet: the run has not finished its first step")
    return sorted(records, key=lambda r: r["step"])


def _marks(metrics: list[dict]) -> list[Mark]:
    out = []
    for r in metrics:
        if "resumed_from" in r:
            out.append(Mark(r["step"], "resume", f"resumed from the checkpoint of step {r['resumed_from']}"))
        if "recovered" in r:
            out.append(Mark(r["step"], "recovery", f"recovered: {r['recovered']}"))
        for change in r.get("layout_changes", []):
            out.append(
                Mark(
                    r["step"],
                    "relayout",
                    f"{change['schedule']} on {change['num_slices']} slice(s), "
                    f"placement {change['placement']}: {change['why']}",
                )
            )
    return out


def _step_times(metrics: list[dict]) -> StepTimes:
    values = [r["step_s"] for r in metrics if "step_s" in r]
    if len(values) > 1:
        values = values[1:]
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else ordered * 9
    return StepTimes(statistics.median(ordered), q[0], q[-1], ordered[0], ordered[-1], len(ordered))


def _goodput(metrics: list[dict], elapsed: list) -> tuple[dict | None, list[GoodputEvent]]:
    """(the run's goodput totals, what each record added per cause). A record's goodput is
    cumulative over its controller's life; a resume starts a new life from zero, so the totals
    add up the last record of each life."""
    lives, current, events = [], None, []
    before = dict.fromkeys(CAUSES, 0.0)
    for r, t in zip(metrics, elapsed):
        if "resumed_from" in r:
            lives.append(current)
            current, before = None, dict.fromkeys(CAUSES, 0.0)
        g = r.get("goodput")
        if g is None:
            continue
        for key, cause in CAUSES.items():
            added = g.get(key, 0.0) - before[key]
            if added > 0:
                events.append(GoodputEvent(r["step"], t, cause, added))
            before[key] = g.get(key, 0.0)
        current = g
    lives = [g for g in lives + [current] if g is not None]
    if not lives:
        return None, events
    return {key: sum(g.get(key, 0) for g in lives) for key in lives[-1]}, events


def _wall_s(metrics: list[dict]) -> float | None:
    times = [(r["time"], r) for r in metrics if "time" in r]
    if not times:
        return None
    return times[-1][0] - times[0][0] + times[0][1].get("step_s", 0.0)


def flatten(values: dict, prefix: str = "") -> dict:
    """A nested config dict -> {dotted key: value}."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _config_sources(config: dict, info: dict) -> dict:
    file_keys = set(flatten(info.get("file_values") or {}))
    overridden = [o.split("=", 1)[0] for o in info.get("overrides", [])]
    out = {}
    for key in flatten(config):
        if any(key == o or key.startswith(o + ".") for o in overridden):
            out[key] = "command line"
        elif key in file_keys or any(key.startswith(f + ".") for f in file_keys):
            out[key] = "file"
        else:
            out[key] = "default"
    return out


def schedule_at(config: dict, metrics: list[dict], step: int) -> schedules.Schedule:
    """The schedule step `step` ran: the config's, or the layout the last change before it
    moved to (a shrink keeps the stages and microbatches: GPipe or 1F1B over blocks)."""
    p = config["pipeline"]
    changes = [c for r in metrics for c in r.get("layout_changes", []) if c["step"] < step]
    if changes and changes[-1]["placement"] != list(
        schedules.make(p["schedule"], p["num_stages"], p["num_microbatches"], p["virtual_stages"]).placement
    ):
        c = changes[-1]
        if c["schedule"] not in _ELASTIC:
            raise ValueError(f"step {step} ran layout {c['schedule']!r}, which the report cannot rebuild")
        return _ELASTIC[c["schedule"]](p["num_stages"], p["num_microbatches"], placement=tuple(c["placement"]))
    return schedules.make(p["schedule"], p["num_stages"], p["num_microbatches"], p["virtual_stages"])


def _checkpoints(run_dir: Path) -> tuple[list[int], dict | None]:
    root = run_dir / "checkpoints"
    steps = (
        sorted(int(d.name) for d in root.iterdir() if d.name.isdigit() and (d / "manifest.json").exists())
        if root.is_dir()
        else []
    )
    layout = None
    if steps:
        try:
            layout = json.loads((root / str(steps[-1]) / "manifest.json").read_text()).get("layout")
        except (OSError, json.JSONDecodeError):
            layout = None  # being replaced right now; the next report reads it
    return steps, layout


def _logs(run_dir: Path) -> list[LogSummary]:
    out = []
    for path in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        lines = path.read_text(errors="replace").splitlines()
        warnings = [l for l in lines if " WARNING " in l]
        errors = [l for l in lines if " ERROR " in l or " CRITICAL " in l or l.startswith("Traceback")]
        problems = [l for l in lines if l in set(warnings) | set(errors)]
        out.append(LogSummary(path.name, len(lines), len(warnings), len(errors), problems[-1] if problems else None))
    return out


def _memory(info: dict, metrics: list[dict]) -> list[SliceMemory]:
    predicted = (info.get("memory") or {}).get("slices") or []
    measured = [r["peak_bytes"] for r in metrics if isinstance(r.get("peak_bytes"), list)]
    num = max([len(predicted)] + [len(m) for m in measured])
    peaks = [max((m[r] for m in measured if len(m) == num), default=None) for r in range(num)]
    return [SliceMemory(r, predicted[r] if r < len(predicted) else None, peaks[r]) for r in range(num)]


def load(run_dir: str | Path, step: int | None = None) -> Report:
    """The report of the run in `run_dir` (see the module doc); `step`: the traced step whose
    measured pipeline is compared with the simulator's (default: the most recent traced step).
    ValueError when run_dir does not exist, holds no metrics, or `step` was not traced."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    metrics = _read_metrics(run_dir)
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.exists() else {}
    info = record.read_run_info(run_dir)
    traces = trace.read(run_dir)
    logged = {r["step"] for r in metrics}
    traced = [s for s in traces if s in logged]  # a trace of a step since rewound is not shown
    if step is not None and step not in traced:
        raise ValueError(
            f"step {step} was not traced in {run_dir}: traced steps are {traced or 'none'} (log.trace_steps)"
        )
    comparison, note = None, None
    if not traced:
        note = "no traced step yet (log.trace_steps names the steps traced)"
    elif "pipeline" not in config:
        note = "config.yaml is missing: the schedule of the traced step is not known"
    else:
        shown = step if step is not None else traced[-1]
        try:
            comparison = pipeline.compare(shown, traces[shown], schedule_at(config, metrics, shown))
        except ValueError as e:  # a trace the schedule does not explain: say why, show the rest
            note = f"step {shown} not compared with the simulator: {e}"
    goodput, events = _goodput(metrics, _elapsed(metrics))
    checkpoints, layout = _checkpoints(run_dir)
    total = config.get("train", {}).get("steps")
    last = metrics[-1]["step"]
    return Report(
        str(run_dir),
        metrics,
        total,
        total is not None and last == total and bool(checkpoints) and checkpoints[-1] == total,
        _marks(metrics),
        _step_times(metrics),
        traced,
        comparison,
        note,
        goodput,
        events,
        _wall_s(metrics),
        _memory(info, metrics),
        config,
        _config_sources(config, info),
        info.get("config_file"),
        info.get("overrides", []),
        layout,
        info.get("versions", {}),
        checkpoints,
        _logs(run_dir),
    )
