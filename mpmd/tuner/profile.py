"""What the tuner (mpmd/tuner/core.py) knows about a model on a cluster: a `Profile`, measured by a
short pass on the cluster's own workers.

    prof = profile(layers, loss_fn, optimizer, inputs, targets, cluster, microbatch_sizes=(2, 4))

Per *unit* (a layer of `model.layers()`, or a user's stage: the smallest pieces a stage is
cut from) and per microbatch size: the measured seconds of its forward (F), input gradient
(B) and weight gradient (W) and of its optimizer update (U), and the bytes of its
parameters, optimizer state, residuals (what F saves for the backward), kept bytes (what B
keeps for W) and of the activation entering it. Plus the transfer model between two slices,
seconds = latency_s + bytes / bytes_per_s, and what a slice spends around each program
that the simulator does not charge (the executor's own walk: sends, receives, deletes,
dispatch): the gap between consecutive programs, plus the rest of the measured profiling
step beyond the simulated one spread over its tasks (so a candidate of fewer, larger
stages pays less of it).

How. The units become the stages of one pipeline, placed in contiguous blocks over the
cluster's slices, run by a split-backward GPipe order (all forwards, then the B and W of
each microbatch; microbatch-major, so the slices overlap as in a real pipeline and each
task is timed while the others compute) for a few traced steps per microbatch size: every
task's duration is read from the trace (median over microbatches and steps), after a traced
warm-up step (the first traced step compiles; a median of two steps, one of them compiling,
once priced a block three times too high). The step itself is timed untraced, as training
runs it (tracing counts every slice's bytes after each instruction, which costs time).
The first unit's B runs no program (its input is data), so its W is its whole backward, as
for any first stage. Bytes come from shapes (mpmd.stages.costs.memory). With three or more
sizes, each unit's times are replaced by a robust line in the size (`affine_in_size`). The
transfer model is fit by least squares to the gaps between a forward on one slice and its
consumer's forward on the next, in dry runs (mpmd/lowering/dryrun.py: zero-second programs, real
transfers) of a few activation sizes.

A Profile is plain arrays: tests build one from declared costs, without any compute.
"""
from __future__ import annotations

import re
import statistics
import time
from typing import NamedTuple

import jax
import numpy as np

from mpmd.schedules import core as schedules
from mpmd.stages.pipeline import Pipeline
from mpmd.schedules.core import BACKWARD, FORWARD, WEIGHT, Schedule, Task
from mpmd.schedules.simulate import step_s
from mpmd.stages.specs import spec
from mpmd.runtime.wire.format import nbytes

UPDATE = "U"
_LABEL = re.compile(r"([FBWU]) s(\d+)(?: mb(\d+))?$")      # mpmd/lowering/train_stream.py's Run labels


class Profile(NamedTuple):
    microbatch_sizes: tuple[int, ...]     # rows per microbatch, ascending
    # [size index, unit] seconds per microbatch (update_s: per step, one row per size)
    forward_s: np.ndarray
    input_grad_s: np.ndarray              # unit 0's is 0: its input is data
    weight_grad_s: np.ndarray             # unit 0's is its whole backward
    update_s: np.ndarray
    # [unit] bytes
    param_bytes: np.ndarray
    optimizer_bytes: np.ndarray
    # [size index, unit] bytes per microbatch
    residual_bytes: np.ndarray
    kept_bytes: np.ndarray
    # [size index, unit + 1]: bytes of the activation entering unit u (u = num_units: output)
    boundary_bytes: np.ndarray
    latency_s: float = 0.0                # transfer between two slices: latency_s + bytes / bytes_per_s
    bytes_per_s: float = float("inf")
    task_gap_s: float = 0.0               # per task: what a slice spends around a program's run
    step_overhead_s: float = 0.0          # per step: a fixed cost (a declared profile's; measured: 0)
    unit_names: tuple[str, ...] = ()

    @property
    def num_units(self) -> int:
        return self.forward_s.shape[1]

    def size_index(self, microbatch_size: int) -> int:
        if microbatch_size not in self.microbatch_sizes:
            raise ValueError(f"microbatch size {microbatch_size} was not profiled; profiled: "
                             f"{list(self.microbatch_sizes)}")
        return self.microbatch_sizes.index(microbatch_size)

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


def profile_schedule(num_units: int, num_slices: int, num_microbatches: int) -> Schedule:
    """Split-backward GPipe over `num_units` stages in contiguous blocks on `num_slices`
    slices: each slice runs all its forwards, microbatch by microbatch, then B and W of each
    microbatch (its stages last first). Microbatch-major, so the slices overlap as they do
    in a real pipeline (a slice's tasks are timed while the others compute too)."""
    if not 1 <= num_slices <= num_units:
        raise ValueError(f"profiling {num_units} units needs 1..{num_units} slices, got {num_slices}")
    bounds = np.linspace(0, num_units, num_slices + 1).round().astype(int)
    placement = tuple(int(r) for r in np.repeat(np.arange(num_slices), np.diff(bounds)))
    m = num_microbatches
    slices = []
    for r in range(num_slices):
        mine = range(bounds[r], bounds[r + 1])
        tasks = [Task(k, j, FORWARD) for j in range(m) for k in mine]
        tasks += [Task(k, j, kind) for j in range(m) for k in reversed(mine) for kind in (BACKWARD, WEIGHT)]
        slices.append(tuple(tasks))
    return Schedule("profile", num_units, m, max(np.diff(bounds)).item(), True, tuple(slices), placement)


def task_durations(events_per_step) -> dict:
    """{(kind, stage): [seconds, ...]} of every traced F/B/W/U program, from
    Trainer.step(trace=True)["events"] of one or more steps."""
    out: dict = {}
    for events in events_per_step:
        for slice_events in events:
            for e in slice_events:
                match = _LABEL.match(e.name)
                if e.kind == "run" and match:
                    out.setdefault((match[1], int(match[2])), []).append((e.end_ns - e.start_ns) / 1e9)
    return out


def task_gaps(events_per_step) -> list[float]:
    """Seconds between one program's end and the next program's start on the same slice,
    where no receive was walked in between (so the gap is the executor's own work)."""
    gaps = []
    for events in events_per_step:
        for slice_events in events:
            ordered = sorted(slice_events, key=lambda e: e.start_ns)
            last_end = None
            for e in ordered:
                if e.kind == "recv":
                    last_end = None
                elif e.kind == "run":
                    if last_end is not None and e.start_ns >= last_end:
                        gaps.append((e.start_ns - last_end) / 1e9)
                    last_end = e.end_ns
    return gaps


def profile(units, loss_fn, optimizer, inputs, targets, cluster, num_slices: int, microbatch_sizes,
            num_microbatches: int = 4, steps: int = 2, transfer_sizes=(2**14, 2**18, 2**21),
            max_grad_norm=None, log=print) -> Profile:
    """Measure `units` (nnx.Modules in order; the pipeline's loss after the last) on
    `num_slices` slices of `cluster` (started here, left open for the caller).

    inputs/targets: a batch of real data (its rows are repeated where a size needs more).
    Each size runs `num_microbatches` per step: two warm-up steps (one traced), `steps`
    traced steps (task durations and gaps) and `steps` + 1 timed untraced steps.
    """
    from mpmd.stages.costs import memory
    from mpmd.train.trainer import Trainer

    units = list(units)
    sizes = tuple(sorted(set(int(s) for s in microbatch_sizes)))
    num_slices = min(num_slices, len(units))
    pipe = Pipeline(units, loss_fn)
    schedule = profile_schedule(len(units), num_slices, num_microbatches)
    U = len(units)
    shape = (len(sizes), U)
    fwd, bin_, bw, upd = (np.zeros(shape) for _ in range(4))
    resid, kept = np.zeros(shape), np.zeros(shape)
    bound = np.zeros((len(sizes), U + 1))
    params = opt = None
    gaps = []
    trainer = Trainer(pipe, optimizer, schedule=schedule, cluster=cluster, max_grad_norm=max_grad_norm)
    try:
        for i, size in enumerate(sizes):
            t0 = time.perf_counter()
            x, y = _rows(inputs, size * num_microbatches), _rows(targets, size * num_microbatches)
            mx, my = jax.tree.map(spec, x[:size]), jax.tree.map(spec, y[:size])
            per_unit = memory(pipe, optimizer, mx, my)
            params = np.array([u["params"] for u in per_unit], float)
            opt = np.array([u["optimizer"] for u in per_unit], float)
            resid[i] = [u["residuals"] for u in per_unit]
            kept[i] = [u["kept"] for u in per_unit]
            bound[i] = [nbytes(jax.tree.leaves(a)) for a in pipe.activation_specs(mx)]
            # Compiles this size's programs; the first traced step compiles more of its own
            # (bench_schedules warms up the same way), so neither is timed.
            trainer.step(x, y)
            trainer.step(x, y, trace=True)
            traced = [trainer.step(x, y, trace=True)["events"] for _ in range(steps)]
            # Steps are timed untraced, as they run in training (a traced step also counts
            # the bytes a slice holds after every instruction, which costs time).
            untraced = []
            for _ in range(steps + 1):
                begin = time.perf_counter()
                trainer.step(x, y)
                untraced.append(time.perf_counter() - begin)
            durations = task_durations(traced)
            med = lambda kind, k: statistics.median(durations[kind, k]) if (kind, k) in durations else 0.0
            for k in range(U):
                fwd[i, k], bin_[i, k], bw[i, k], upd[i, k] = (med(kind, k) for kind in (FORWARD, BACKWARD, WEIGHT, UPDATE))
            gap = statistics.median(task_gaps(traced) or [0.0])
            # What the simulator with these costs and gaps leaves out of the measured step
            # (sends, receives, deletes, dispatch) grows with the tasks a slice walks: charged
            # per task, spread over the busiest slice's tasks.
            predicted = _profile_step_s(schedule, fwd[i], bin_[i], bw[i], upd[i], gap)
            rest = max(0.0, statistics.median(untraced) - predicted)
            gaps.append(gap + rest / max(len(tasks) for tasks in schedule.slices))
            log(f"profiled microbatch size {size}: F+B+W {1e3 * (fwd[i] + bin_[i] + bw[i]).sum():.1f} ms "
                f"over {U} units ({time.perf_counter() - t0:.1f} s)")
    finally:
        trainer.close(close_cluster=False)
    fwd, bin_, bw, upd = (affine_in_size(sizes, t) for t in (fwd, bin_, bw, upd))
    latency, bandwidth = (0.0, float("inf")) if num_slices < 2 else measure_transfer(cluster, transfer_sizes)
    names = tuple(type(u).__name__ for u in units)
    return Profile(sizes, fwd, bin_, bw, upd, params, opt, resid, kept, bound, latency, bandwidth,
                   statistics.median(gaps), 0.0, names)


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


def _profile_step_s(schedule: Schedule, f, b, w, u, gap: float) -> float:
    costs = [{FORWARD: f[k] + gap, BACKWARD: (b[k] + gap) if k else 0.0, WEIGHT: w[k] + gap}
             for k in range(schedule.num_stages)]
    return step_s(schedule, costs, [sum(u[k] for k in schedule.stages_on(r)) for r in range(schedule.num_slices)])


def measure_transfer(cluster, sizes_bytes, num_microbatches: int = 4, steps: int = 3) -> tuple[float, float]:
    """(latency_s, bytes_per_s) between slices 0 and 1 of `cluster`: least squares over the
    gaps between F(s0, mb) ending and F(s1, mb) starting in dry runs whose programs take no
    time, one per activation size. A fit whose slope is not positive (transfers too fast to
    tell sizes apart) gives an unbounded bandwidth."""
    from mpmd.lowering.dryrun import dry_run
    sizes, gaps = [], []
    for num_bytes in sizes_bytes:
        result = dry_run(schedules.gpipe(2, num_microbatches), {FORWARD: 0.0, BACKWARD: 0.0, WEIGHT: 0.0},
                         activation_bytes=int(num_bytes), cluster=cluster, steps=steps)
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
