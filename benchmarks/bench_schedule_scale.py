"""Schedules at scale: generation, validation, simulation and lowering to instruction streams.

    .venv/bin/python benchmarks/bench_schedule_scale.py [--quick] [--all-slices]

For 1F1B, interleaved 1F1B (v = 2), ZB-H1 and ZB-V at p = 1,024 slices and m = 8,192
microbatches (--quick: p = 64, m = 512), each case in its own subprocess so that its peak
memory (resource.getrusage ru_maxrss, the process's resident high-water mark, Python and
numpy included) is its own. Per case it prints the seconds of

  make      schedules.make: the task arrays
  validate  schedules.validate: placement, completeness, deadlock freedom
  simulate  simulate.simulate with F = B = W = 1 (validates again: it walks the schedule)

(wall clock, and in parentheses this process's CPU seconds: on a shared machine the wall
clock also counts time the process waited for a core) and the peak memory after them, then
lowering: lowering.train_stream builds one slice's
instruction stream at a time (the streams are Python objects; never all slices at once).
By default it lowers 8 slices spread over the pipeline and prints the mean seconds per
slice, the largest stream, the peak memory after lowering (JAX is imported for it, which
alone adds ~100-200 MB) and "all p" = mean x p: a projection for lowering every slice one
after the other, marked as such. --all-slices lowers every slice instead (minutes at full
size). Goal (issue 16): make + validate + simulate + lowering under 10 s and 2 GB per case.
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
LOWERED_SLICES = 8


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def run_case(name: str, num_slices: int, num_microbatches: int, virtual_stages: int,
             all_slices: bool) -> dict:
    """One case, in this process; returns its figures."""
    from mpmd import schedules
    from mpmd.simulate import simulate
    num_stages = num_slices * virtual_stages
    out = {"name": name, "p": num_slices, "m": num_microbatches}
    clocks = lambda: (time.perf_counter(), time.process_time())
    start = clocks()
    schedule = schedules.make(name, num_stages, num_microbatches, virtual_stages)
    made = clocks()
    schedules.validate(schedule)
    validated = clocks()
    sim = simulate(schedule)
    simulated = clocks()
    for phase, (a, b) in (("make", (start, made)), ("validate", (made, validated)), ("simulate", (validated, simulated))):
        out[f"{phase}_s"], out[f"{phase}_cpu_s"] = b[0] - a[0], b[1] - a[1]
    out["tasks"] = schedule.slices.num_tasks
    out["bubble"] = sim.bubble_fraction
    out["peak_mb"] = _peak_mb()
    del sim

    from mpmd import lowering
    from runtime.instructions import Spec
    plain = lowering.Transfers.plain([(Spec((4,), "float32"),)] * (num_stages + 1))
    if all_slices or num_slices <= LOWERED_SLICES:
        chosen = range(num_slices)
    else:
        chosen = sorted({round(i * (num_slices - 1) / (LOWERED_SLICES - 1)) for i in range(LOWERED_SLICES)})
    longest, seconds = 0, 0.0
    for r in chosen:
        start = time.perf_counter()
        stream = lowering.train_stream(schedule, r, plain, clip=True)
        seconds += time.perf_counter() - start
        longest = max(longest, len(stream))
        del stream
    out["lowered"] = len(chosen)
    out["lower_per_slice_s"] = seconds / len(chosen)
    out["lower_measured_s"] = seconds
    out["longest_stream"] = longest
    out["peak_after_lowering_mb"] = _peak_mb()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p = 64, m = 512")
    parser.add_argument("--all-slices", action="store_true", help="lower every slice (slow at full size)")
    parser.add_argument("--case", help=argparse.SUPPRESS)   # name,p,m,v: run one case here
    args = parser.parse_args()
    if args.case:
        name, p, m, v = args.case.split(",")
        print(json.dumps(run_case(name, int(p), int(m), int(v), args.all_slices)))
        return
    p, m = (64, 512) if args.quick else (1024, 8192)
    print(f"p = {p} slices, m = {m} microbatches; seconds and peak resident memory per case "
          f"(a subprocess each)")
    print(f"{'schedule':>17} {'tasks':>10} {'make':>13} {'validate':>13} {'simulate':>13} {'sum':>13} {'peak MB':>8} "
          f"| {'lowered':>7} {'s/slice':>7} {'longest':>8} {'all p':>8} {'peak MB':>8} {'bubble':>7}")
    for name, v in CASES:
        cmd = [sys.executable, __file__, "--case", f"{name},{p},{m},{v}"] + (["--all-slices"] if args.all_slices else [])
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            print(f"{name:>17} failed:\n{done.stderr[-2000:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        total = r["make_s"] + r["validate_s"] + r["simulate_s"]
        total_cpu = r["make_cpu_s"] + r["validate_cpu_s"] + r["simulate_cpu_s"]
        both = lambda wall, cpu: f"{wall:6.2f} ({cpu:5.2f})"
        measured_all = r["lowered"] == r["p"]
        all_p = r["lower_measured_s"] if measured_all else r["lower_per_slice_s"] * r["p"]
        print(f"{name:>17} {r['tasks']:>10} {both(r['make_s'], r['make_cpu_s'])} "
              f"{both(r['validate_s'], r['validate_cpu_s'])} {both(r['simulate_s'], r['simulate_cpu_s'])} "
              f"{both(total, total_cpu)} {r['peak_mb']:8.0f} | {r['lowered']:>7} {r['lower_per_slice_s']:7.3f} "
              f"{r['longest_stream']:>8} {all_p:7.1f}{' ' if measured_all else '*'} "
              f"{r['peak_after_lowering_mb']:8.0f} {r['bubble']:7.4f}")
    print("* projected: mean seconds per lowered slice x p (run with --all-slices to measure it)")


if __name__ == "__main__":
    main()
