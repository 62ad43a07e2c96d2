"""Goodput predicted against measured: gpt_tiny on 4 slices through `mpmd train`, uninterrupted and
with workers SIGKILLed at a known rate, side by side per seed; the goodput planner's simulator
(mpmd/tuner/goodput.py), fed the costs those runs measured and the faults' actual times,
predicts the faulted run's goodput.

    .venv/bin/python benchmarks/bench_goodput.py [--steps 150] [--mean-gap-s 8] [--seeds 0 1 2] [--keep DIR]

Both runs of a seed are the real CLI (a controller subprocess, 4 local worker processes, real
gRPC and Orbax): configs/gpt_tiny.yaml in 4 stages, a persistent checkpoint every --every
steps and an in-memory one every --memory-every, no eval or sample. In the faulted run one
worker (drawn from the seed) is SIGKILLed at exponential gaps of mean --mean-gap-s wall
seconds after the first step (drawn again until the first falls within the run), each once
the run has logged a step since the last (so a kill lands on a training run, not on a
recovery); the controller replaces it (on_loss=replace).

  measured goodput   = uninterrupted span / faulted span, a span being the wall from the
                       first step's record to the last one's (start-up and the end's save
                       left out, as the same in both): soak.py's goodput without its
                       start-up. The uninterrupted run goes once before the faulted one and
                       once after, and its span is the mean of the two: other work on the
                       machine moves a span by tens of percent within minutes
  predicted goodput  = the simulator's span without faults / its span with the kills, fed the
                       costs the faulted run's records measured (mpmd.report.costs.measured,
                       the reading `mpmd plan goodput plan.from_run=DIR` does: step, saves,
                       detection, spawn, restore, the first step's compile; its steps ran
                       under the same load as its recoveries), the uninterrupted run's for
                       what it did not. The kills are placed at their times after the first
                       step, or at their steps (where each struck: the step logged last and
                       the fraction of the next run by then, mpmd.tuner.goodput.trace's
                       at_step), so that a stretch where other work slowed this machine
                       moves no kill past the run's end or onto another step
  in-run goodput     = the wall the faulted run spent on the steps its final state holds (each
                       record's interval; a recovery's first step as a median step) / its
                       span: the same quotient with the uninterrupted time taken from the
                       faulted run itself, so under the same load

It prints per seed the spans measured and predicted, the goodputs, the relative errors
(predicted - measured) / measured for each placement and each measure, and the costs fed in. On a 2-core machine shared with
other work, compare the two uninterrupted spans of a seed before reading its error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support, as when run from the repository root

from mpmd.recipes.run import run_log  # noqa: E402
from mpmd.report.costs import measured  # noqa: E402
from mpmd.tuner import goodput  # noqa: E402
from tests.support.processes import children  # noqa: E402

SLICES = 4


def command(steps: int, every: int, memory_every: int, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mpmd.recipes.cli",
        "train",
        "configs/gpt_tiny.yaml",
        f"pipeline.num_stages={SLICES}",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.sample_tokens=0",
        f"checkpoint.every={every}",
        f"checkpoint.memory_every={memory_every}",
        "cluster.on_loss=replace",
        "cluster.max_restarts=1000",
        "log.progress=lines",
        "log.every=1",
        "log.trace_steps=[]",
        "log.tensorboard=false",
        f"run_dir={run_dir}",
    ]


def records(run_dir: Path) -> list[dict]:
    try:
        return run_log.read(run_dir)
    except (OSError, ValueError):  # not there yet, or a line being written
        return []


def span_s(run_dir: Path, first_time: float | None = None) -> float:
    """Wall seconds from the first step's record (or `first_time`) to the last step's."""
    metrics = {r["step"]: r for r in records(run_dir)}
    return metrics[max(metrics)]["time"] - (first_time if first_time is not None else metrics[1]["time"])


def surviving_s(run_dir: Path) -> float:
    """Wall seconds the faulted run spent on the steps its final state holds (after step 1): each
    record's interval from the one before, a recovery's first step counted as a median step
    (its interval holds the recovery). Under the same load as the run's faults."""
    metrics = records(run_dir)
    intervals = [b["time"] - a["time"] for a, b in zip(metrics, metrics[1:]) if "recovered" not in b]
    median = sorted(intervals)[len(intervals) // 2]
    return sum(intervals) + median * sum("recovered" in r for r in metrics[1:])


def run(cmd: list[str], run_dir: Path, log: Path, gaps: list[float] | None = None, rng=None) -> tuple[float, list]:
    """Run `cmd` to its end; with `gaps`, SIGKILL one of its workers at those gaps (s) after the
    first step. (wall seconds of step 1's record, [(time, the newest step logged then, its
    record's time) of each kill])."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    first, kills, next_at, killed_at = None, [], None, 0.0
    pending = list(gaps or [])
    while proc.poll() is None:
        time.sleep(0.02)
        if first is None:
            got = records(run_dir)
            if got:
                first = got[0]["time"]
                next_at = first + pending.pop(0) if pending else None
            continue
        if next_at is None or time.time() < next_at:
            continue
        # Not before a step was logged after the last kill (a rewind leaves older records last).
        latest = records(run_dir)
        workers = children(proc.pid)
        if not latest or latest[-1]["time"] <= killed_at or len(workers) < SLICES:
            continue
        victim = rng.choice(sorted(workers))
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        kills.append((killed_at, latest[-1]["step"], latest[-1]["time"]))  # when, the step logged last then
        next_at = (next_at + pending.pop(0)) if pending else None
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} exited with {proc.returncode}: see {log}")
    return first, kills


def one_seed(seed: int, args, work: Path) -> dict:
    """Both runs of a seed (or, with --keep DIR holding them from before, their records), the
    costs they measured, the simulator's spans, and the goodputs."""
    rng = random.Random(seed)
    faulted_dir = work / f"faulted_{seed}"
    kills_file = work / f"kills_{seed}.json"
    refs = [work / f"reference_{seed}", work / f"reference_{seed}_after"]
    if not kills_file.exists():
        run(command(args.steps, args.every, args.memory_every, refs[0]), refs[0], work / f"reference_{seed}.log")
        # Gaps drawn again until the first falls in the first 80 % of the uninterrupted span: a
        # run the draw left without a fault would test nothing.
        while True:
            gaps = [rng.expovariate(1.0 / args.mean_gap_s) for _ in range(1000)]
            if gaps[0] < 0.8 * span_s(refs[0]):
                break
        first, kills = run(
            command(args.steps, args.every, args.memory_every, faulted_dir),
            faulted_dir,
            work / f"faulted_{seed}.log",
            gaps,
            rng,
        )
        run(command(args.steps, args.every, args.memory_every, refs[1]), refs[1], work / f"reference_{seed}_after.log")
        kills_file.write_text(json.dumps({"first": first, "kills": kills}))
    done = json.loads(kills_file.read_text())
    first, kills = done["first"], done["kills"]
    spans = [span_s(d) for d in refs if (d / run_log.METRICS_FILE).exists()]
    measured_ref, measured_faulted = sum(spans) / len(spans), span_s(faulted_dir, first)
    # The costs as the faulted run measured them (its steps and saves ran under the same load as
    # its recoveries), the uninterrupted run's where it measured none.
    costs = goodput.Costs(**{**measured(refs[0]), **measured(faulted_dir)})
    policy = goodput.Policy(every=args.every, memory_every=args.memory_every, on_loss="replace")
    # Any one worker is one slice: the in-memory tier serves its loss whichever it is. A kill
    # placed at its time after step 1, or where it struck: the step logged last and the
    # fraction of the next one run by then.
    at_times = goodput.trace(SLICES, [(t - first, [0]) for t, _, _ in kills])
    where = [(step + min((t - logged) / costs.step_s, 0.99), [0]) for t, step, logged in kills]
    at_steps = goodput.trace(SLICES, where, at_step=True)
    sim = lambda f: float(goodput.simulate(costs, [policy], f, SLICES, steps=args.steps, start_step=1).wall_s[0, 0])
    predicted_ref = sim(goodput.trace(SLICES, []))
    got = measured_ref / measured_faulted
    in_run = surviving_s(faulted_dir) / measured_faulted
    out = {
        "seed": seed,
        "kills": sum(t < first + measured_faulted for t, _, _ in kills),  # not one during the end's save
        "spans": (spans, predicted_ref, measured_faulted),
        "measured": (got, in_run),
        "costs": costs,
    }
    for name, faults in (("at times", at_times), ("at steps", at_steps)):
        span = sim(faults)
        want = predicted_ref / span
        out[name] = (span, want, (want - got) / got, (want - in_run) / in_run)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=20, help="checkpoint.every")
    p.add_argument("--memory-every", type=int, default=5, help="checkpoint.memory_every")
    p.add_argument("--mean-gap-s", type=float, default=8.0, help="mean wall seconds between kills")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="where the runs go (default: a temporary directory); a seed whose runs are there already is "
        "read back, not run again",
    )
    args = p.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="mpmd-goodput-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"bench_goodput: {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}; gpt_tiny on "
        f"{SLICES} slices, {args.steps} steps, checkpoint.every={args.every}, memory_every={args.memory_every}, "
        f"a SIGKILL every {args.mean_gap_s:g} s on average; runs in {work}",
        flush=True,
    )
    rows = []
    for seed in args.seeds:
        rows.append(one_seed(seed, args, work))
        r = rows[-1]
        refs, predicted_ref, faulted = r["spans"]
        print(
            f"seed {seed}: {r['kills']} kills. Spans (s): uninterrupted measured "
            + "/".join(f"{x:.1f}" for x in refs)
            + f" (before/after), predicted {predicted_ref:.1f}; faulted measured {faulted:.1f}, predicted "
            f"{r['at times'][0]:.1f} (kills at their times) / {r['at steps'][0]:.1f} (at their steps)",
            flush=True,
        )
        print(
            f"  goodput measured {r['measured'][0]:.3f} (in-run {r['measured'][1]:.3f}); predicted "
            f"{r['at times'][1]:.3f} at times / {r['at steps'][1]:.3f} at steps; error at steps "
            f"{r['at steps'][2]:+.1%} (in-run {r['at steps'][3]:+.1%}), at times {r['at times'][2]:+.1%} "
            f"(in-run {r['at times'][3]:+.1%})",
            flush=True,
        )
        print(
            "  costs fed in (s): "
            + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in r["costs"]._asdict().items() if k != "promote_s"),
            flush=True,
        )
    worst = {
        f"{name}{' in-run' if k == 3 else ''}": max(abs(r[name][k]) for r in rows)
        for name in ("at steps", "at times")
        for k in (2, 3)
    }
    print(
        "worst relative error over "
        + f"{len(rows)} runs: "
        + ", ".join(f"{name} {v:.1%}" for name, v in worst.items())
        + f"; load average at end {os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
