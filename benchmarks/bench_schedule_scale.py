"""Schedules at scale: generation, validation, simulation and lowering to instruction streams.

    .venv/bin/python benchmarks/bench_schedule_scale.py [--quick]

For 1F1B, interleaved 1F1B (v = 2), ZB-H1 and ZB-V at p = 1,024 slices and m = 8,192
microbatches (--quick: p = 64, m = 512), each case in its own subprocess so that its peak
memory (resource.getrusage ru_maxrss, the process's resident high-water mark, Python and
numpy included) is its own. Per case it prints the seconds of

  make      schedules.make: the task arrays
  validate  schedules.validate: placement, completeness, deadlock freedom
  simulate  simulate.simulate with F = B = W = 1 (validates again: it walks the schedule)
  lower     the controller's lowering of the training plan for EVERY slice, one after the
            other: lowering.train_stream (encoded rows, runtime/worker/streams.py), finished with
            Deletes and the receive window left to the worker (PackedStream.finishing), and
            to_bytes, the payload InstallPlan ships; only one slice's arrays live at a time
  finish    what each worker then does for its own slice before expanding: from_bytes
            (checks) and the Deletes + receive marks (PackedStream.final), for every slice,
            one after the other (on a cluster each worker does only its own, in parallel);
            shown as the total, and the mean and largest per slice

(wall clock, and in parentheses this process's CPU seconds: on a shared machine the wall
clock also counts time the process waited for a core) and the peak memory after each, then
the largest payload, the longest finished stream, and the seconds one worker takes to
expand that stream into instruction records (runtime/worker/executor.py installs those).
Goal (issue 16): each of make, validate, simulate and lower under 10 s and 2 GB per case.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
CASES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def run_case(name: str, num_slices: int, num_microbatches: int, virtual_stages: int) -> dict:
    """One case, in this process; returns its figures."""
    from mpmd.schedules import core as schedules
    from mpmd.schedules import timeline
    from mpmd.schedules.simulate import simulate

    num_stages = num_slices * virtual_stages
    out = {"name": name, "p": num_slices, "m": num_microbatches}
    marks = [_clocks()]

    def phase(label: str) -> None:
        marks.append(_clocks())
        (w0, c0), (w1, c1) = marks[-2:]
        out[f"{label}_s"], out[f"{label}_cpu_s"], out[f"{label}_mb"] = w1 - w0, c1 - c0, _peak_mb()

    schedule = schedules.make(name, num_stages, num_microbatches, virtual_stages)
    phase("make")
    timeline.validate(schedule)
    phase("validate")
    sim = simulate(schedule)
    phase("simulate")
    out["tasks"] = schedule.slices.num_tasks
    out["bubble"] = sim.bubble_fraction
    windows = [max(1, n) for n in sim.peak_live_activations]  # lowering.recv_windows' default
    del sim

    # The training plan as Trainer lowers it (clipping on), every slice: rows, then bytes.
    # Imported only now: mpmd.lowering.core imports JAX (~150 MB resident), which the phases
    # above do not need.
    from mpmd.lowering import core as lowering
    from mpmd.stages import names
    from mpmd.runtime.worker import streams
    from mpmd.runtime.worker.instructions import Spec

    plain = lowering.Transfers.plain([(Spec((4,), "float32"),)] * (num_stages + 1))
    last = schedule.placement[-1]
    kept = {names.params("{k}"), names.opt_state("{k}")}
    # One slice at a time (a payload is ~24 bytes a row; all of them at once would not fit):
    # the controller's part and the worker's part timed apart.
    lower, finish = [0.0, 0.0], [0.0, 0.0]
    sizes, per_slice, longest, longest_at = [], [], 0, 0
    for r in range(num_slices):
        t0 = _clocks()
        keep = kept | ({names.loss("{j}")} if r == last else set()) | ({names.sqnorm("{k}")} if r == 0 else set())
        payload = lowering.train_stream(schedule, r, plain, clip=True).finishing(keep, windows[r]).to_bytes()
        t1 = _clocks()
        n = len(streams.from_bytes(payload).final().op)
        t2 = _clocks()
        for acc, (a, b) in ((lower, (t0, t1)), (finish, (t1, t2))):
            acc[0] += b[0] - a[0]
            acc[1] += b[1] - a[1]
        sizes.append(len(payload))
        per_slice.append(t2[1] - t1[1])
        longest, longest_at = max((longest, longest_at), (n, r))
        del payload
    for label, (wall, cpu) in (("lower", lower), ("finish", finish)):
        out[f"{label}_s"], out[f"{label}_cpu_s"], out[f"{label}_mb"] = wall, cpu, _peak_mb()
    out["payload_mb"], out["largest_payload_mb"] = sum(sizes) / 2**20, max(sizes) / 2**20
    out["finish_mean_s"], out["finish_max_s"] = sum(per_slice) / len(per_slice), max(per_slice)
    out["longest_stream"] = longest
    start = time.perf_counter()
    keep = (
        kept
        | ({names.loss("{j}")} if longest_at == last else set())
        | ({names.sqnorm("{k}")} if longest_at == 0 else set())
    )
    lowering.train_stream(schedule, longest_at, plain, clip=True).finishing(keep, windows[longest_at]).expand()
    out["expand_s"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p = 64, m = 512")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # name,p,m,v: run one case here
    args = parser.parse_args()
    if args.case:
        name, p, m, v = args.case.split(",")
        print(json.dumps(run_case(name, int(p), int(m), int(v))))
        return
    p, m = (64, 512) if args.quick else (1024, 8192)
    print(
        f"p = {p} slices, m = {m} microbatches; per phase: wall seconds (CPU seconds) and the "
        f"process's peak resident MB after it (a subprocess per case)"
    )
    phases = ("make", "validate", "simulate", "lower", "finish")
    print(
        f"{'schedule':>17} {'tasks':>10} "
        + " ".join(f"{x:>20}" for x in phases)
        + f" {'finish/slice':>13} {'payload MB':>11} {'longest':>8} {'expand':>7} {'bubble':>7}"
    )
    for name, v in CASES:
        done = subprocess.run(
            [sys.executable, __file__, "--case", f"{name},{p},{m},{v}"], capture_output=True, text=True, cwd=REPO
        )
        if done.returncode:
            print(f"{name:>17} failed:\n{done.stderr[-2000:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        cell = lambda x: f"{r[x + '_s']:6.2f} ({r[x + '_cpu_s']:5.2f}) {r[x + '_mb']:5.0f}"
        print(
            f"{name:>17} {r['tasks']:>10} "
            + " ".join(f"{cell(x):>20}" for x in phases)
            + f" {r['finish_mean_s'] * 1e3:5.1f}/{r['finish_max_s'] * 1e3:5.1f}ms"
            f" {r['payload_mb']:6.0f}/{r['largest_payload_mb']:4.1f} {r['longest_stream']:>8} "
            f"{r['expand_s']:6.2f}s {r['bubble']:7.4f}"
        )
    print(
        "finish/slice: mean/largest CPU ms per slice; payload MB: all slices / the largest; longest: "
        "instructions of the longest finished stream; expand: seconds to turn it into records"
    )


if __name__ == "__main__":
    main()
