"""What a run leaves behind for people: metrics.jsonl, TensorBoard scalars, progress, traces.

Named run_log (not logging) so it never shadows the standard library's `logging`.

metrics.jsonl holds one JSON object per step, exactly once: a run that resumes from a
checkpoint first drops the lines past that checkpoint (`truncate_after`), and a step written
twice replaces its line, so the file always describes the updates that landed in the state.
A write that fails (a full disk) leaves the file as it was and raises: an append is cut
back to the old length, a rewrite goes to a temporary file that is removed.
"""

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence, TextIO

# The events this module draws and measures are the executor's (name, kind, start_ns, end_ns);
# any 4-tuple in that order works.
from mpmd.runtime.worker.executor import Event  # noqa: F401  (re-exported for callers that build events)

# One definition of a measured bubble: the report computes it from trace.json the same way.
from mpmd.report.trace import measured_bubble  # noqa: F401
from mpmd.recipes.run.console import PROGRESS

METRICS_FILE = "metrics.jsonl"
# The progress lines and messages also go to this logger at info: <run_dir>/logs/controller.log
# then tells the run's story with timestamps (the console shows them once, from here).
_log = logging.getLogger(PROGRESS)


def _plain(value):
    """numpy / jax scalars -> Python numbers, so json can write them."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not a number")


def _parse_lines(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # torn final append from a crash: that step never counted
                break
            raise ValueError(f"{path}:{number} is not a JSON object: {line[:80]!r}") from None
    return records


def read(run_dir: str | Path) -> list[dict]:
    """Every step's metrics in file order, each a dict with at least 'step'."""
    return _parse_lines(Path(run_dir) / METRICS_FILE)


class MetricsLog:
    """Appends {"step": k, **metrics} per step to <run_dir>/metrics.jsonl, one line per step."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._records = {r["step"]: r for r in _parse_lines(self.path)}
        self._rewrite()  # drops a torn last line, if a crash left one

    def write(self, step: int, metrics: Mapping[str, object]) -> None:
        record = {"step": int(step), **metrics}
        replaces = record["step"] in self._records
        self._records[record["step"]] = record
        if replaces:
            self._rewrite()
        else:
            size = self.path.stat().st_size if self.path.exists() else 0
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(record, default=_plain) + "\n")
            except OSError:
                del self._records[record["step"]]
                with contextlib.suppress(OSError):
                    os.truncate(self.path, size)  # freeing space needs none
                raise

    def truncate_after(self, step: int) -> None:
        """Forgets every step > step (a resume from the checkpoint at `step` redoes them)."""
        self._records = {k: r for k, r in self._records.items() if k <= step}
        self._rewrite()

    def records(self) -> list[dict]:
        return list(self._records.values())

    def _rewrite(self) -> None:
        # Temp file + os.replace: a crash mid-rewrite leaves the old file or the new, never half.
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with tmp.open("w") as f:
                f.writelines(json.dumps(r, default=_plain) + "\n" for r in self._records.values())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def _summary_writer():
    """tensorboardX's SummaryWriter, imported here (only runs that want it pay). Where torch is
    installed and not yet imported, tensorboardX would import it at its own import (only to
    accept torch tensors as values), which took 0.8-1.4 s of every run's start on this
    machine; the metrics written here are Python numbers, so tensorboardX is imported with
    torch hidden from it, and torch stays importable afterwards."""
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoard:
    """Numeric metrics as TensorBoard scalars under <run_dir>/tb (tensorboardX)."""

    def __init__(self, run_dir: str | Path):
        self._writer = _summary_writer()(str(Path(run_dir) / "tb"))

    def write(self, step: int, metrics: Mapping[str, object]) -> None:
        for name, value in scalars(metrics).items():
            self._writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """Numeric metrics to a Weights & Biases run (log.wandb), its files under <run_dir>/wandb.

    Every record carries its step as the metric `step`, W&B's x axis for all the others
    (define_metric), rather than W&B's own step counter: that counter only moves forward, and
    a recovered run logs the steps after its checkpoint again. WANDB_MODE=offline (W&B's
    own variable) writes the run there without a network; `wandb sync <run_dir>/wandb/offline-run-*`
    uploads it later. A resumed run is a new W&B run of the same name."""

    def __init__(self, run_dir: str | Path, project: str, config: Mapping[str, object]):
        import wandb  # imported here: only runs that want it pay (the config checked it is installed)
        from mpmd.recipes.config import ConfigError

        try:
            self._run = wandb.init(
                project=project,
                name=Path(run_dir).name,
                dir=str(run_dir),
                config=dict(config),
                settings=wandb.Settings(silent=True, console="off"),
            )
        except wandb.errors.Error as e:  # no API key, a project it may not write to, ...
            raise ConfigError(
                f"log.wandb=true: W&B could not start a run: {e} (`wandb login`, or "
                f"WANDB_MODE=offline to log without an account)"
            ) from None
        self._run.define_metric("*", step_metric="step")

    def write(self, step: int, metrics: Mapping[str, object]) -> None:
        self._run.log({"step": int(step), **scalars(metrics)})

    def flush(self) -> None:
        pass  # W&B's own process writes as records arrive

    def close(self) -> None:
        self._run.finish()


def scalars(metrics: Mapping[str, object]) -> dict[str, float]:
    """The metrics that are numbers (numpy / jax scalars included), as floats; bools, strings
    and nested records left out."""
    out = {}
    for name, value in metrics.items():
        if hasattr(value, "item"):  # numpy / jax scalar
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _fmt(value) -> str:
    value = float(value)
    if value != value or math.isinf(value):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.2f}"


def _duration(seconds: float) -> str:
    """45s, 3m05s, 2h07m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# What the progress shows of a step's metrics, those it has (the last eval's stand until the next).
SHOWN = ("loss", "eval_loss", "reward", "exact_match", "tok/s")


class Progress:
    """A tqdm bar (loss, tok/s, ETA) on a terminal, else one line every `every` steps (loss,
    tok/s, ETA too: a log file or a pipe should say when the run ends as well).

    `update(step, metrics)` takes the step just completed (1-based) and that step's metrics;
    tok/s is measured here from tokens_per_step and the wall time between updates. The ETA of
    the lines is the steps left at the mean rate since the first update: the first step
    (compiling every program) is left out, as it would make the rest look slower.
    """

    def __init__(
        self,
        total_steps: int,
        tokens_per_step: int,
        mode: str = "auto",
        every: int = 10,
        start_step: int = 0,
        stream: TextIO | None = None,
    ):
        if mode not in ("auto", "bar", "lines"):
            raise ValueError(f"progress mode must be 'auto', 'bar' or 'lines', got {mode!r}")
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode, self.total, self.every = mode, total_steps, every
        self.tokens_per_step = tokens_per_step
        self._last_step, self._last_time = start_step, time.perf_counter()
        self._latest: dict[str, float] = {}  # last seen value of each metric (eval is rarer)
        self._first: tuple[int, float] | None = None  # (step, time) of the first update, for the ETA
        self._eta_s: float | None = None
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, file=self.stream, unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: Mapping[str, object]) -> None:
        now = time.perf_counter()
        elapsed, done = now - self._last_time, step - self._last_step
        # eval_loss stands until the next eval; a bubble is a measurement of one traced step,
        # shown with that step only.
        self._latest.pop("bubble", None)
        self._latest.update({k: v for k, v in metrics.items() if k != "step"})
        if elapsed > 0 and done > 0:
            self._latest["tok/s"] = self.tokens_per_step * done / elapsed
        if self._first is None:
            self._first = step, now
        elif step > self._first[0] and now > self._first[1]:
            self._eta_s = (self.total - step) * (now - self._first[1]) / (step - self._first[0])
        logged = step % self.every == 0 or step == self.total
        if self._bar is not None:
            shown = {k: _fmt(self._latest[k]) for k in SHOWN if k in self._latest}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(done)
        elif logged:
            self.stream.write(self.line(step) + "\n")
            self.stream.flush()
        else:
            return  # lines mode between log steps: keep measuring over the whole interval
        if logged:
            _log.info("%s", self.line(step))
        self._last_step, self._last_time = step, now

    def line(self, step: int) -> str:
        """'step 10/200 loss 3.21 eval_loss 3.30 tok/s 1234 eta 2m05s bubble 0.21' (no ETA
        before two updates, nor on the last step; an rl run's reward and exact match after
        its loss)."""
        parts = [f"step {step}/{self.total}"]
        for key in SHOWN:
            if key in self._latest:
                parts.append(f"{key} {_fmt(self._latest[key])}")
        if step < self.total and self._eta_s is not None:
            parts.append(f"eta {_duration(self._eta_s)}")
        if "bubble" in self._latest:
            parts.append(f"bubble {_fmt(self._latest['bubble'])}")
        return " ".join(parts)

    def message(self, text: str) -> None:
        """Prints text without breaking the bar (and logs it)."""
        _log.info("%s", text)
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def write_trace(path: str | Path, events_per_step: Mapping[int, Sequence[Iterable]]) -> Path:
    """Chrome-trace / Perfetto JSON: one process per slice, one thread per event kind.

    events_per_step: {step: [slice 0's events, slice 1's events, ..]}, each event a
    (name, kind, start_ns, end_ns) tuple. Times become microseconds after the earliest event.
    Kinds get their own threads because a posted receive overlaps the compute it hides behind,
    and overlapping events on one thread draw as a broken stack.
    """
    starts = [e[2] for slices in events_per_step.values() for events in slices for e in events]
    origin_ns = min(starts, default=0)
    num_slices = max((len(slices) for slices in events_per_step.values()), default=0)
    kinds: dict[str, int] = {}
    trace = []
    for step, slices in sorted(events_per_step.items()):
        for pid, events in enumerate(slices):
            for name, kind, start_ns, end_ns in events:
                tid = kinds.setdefault(kind, len(kinds))
                trace.append(
                    {
                        "name": name,
                        "cat": kind,
                        "ph": "X",
                        "pid": pid,
                        "tid": tid,
                        "ts": (start_ns - origin_ns) / 1e3,
                        "dur": max(0, end_ns - start_ns) / 1e3,
                        "args": {"step": int(step)},
                    }
                )
    metadata = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"slice {pid}"}} for pid in range(num_slices)
    ]
    metadata += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": kind}}
        for pid in range(num_slices)
        for kind, tid in kinds.items()
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Temp file + os.replace: a report read while the run goes on sees the old trace or the new.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": metadata + trace, "displayTimeUnit": "ms"}))
    os.replace(tmp, path)
    return path
