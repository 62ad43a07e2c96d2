"""A shared cluster (`mpmd cluster up`) against a job that starts its own workers, side by side
in one run.

    .venv/bin/python benchmarks/bench_shared.py [--rounds 3] [--steps 60]

Everything goes through the real command line, as a user would run it: `mpmd train
configs/gpt_tiny.yaml` (byte GPT, d_model 64, 4 layers, 2 stages, 1F1B, 4 microbatches) as a
subprocess, its stdout's progress lines time-stamped as they arrive.

a. Job start: from launching `mpmd train` to its first step's line, for the same config
   with cluster.backend=local (starts 2 worker processes, compiles) and with
   cluster.backend=shared on a warm 2-worker cluster (workers up, programs in their cache
   from an earlier job). Rounds alternate the two (order swapped each round) so load on the
   machine hits both alike; medians are reported, and their ratio. Both include the
   controller's own start (Python, JAX, building and lowering the model): that part is the
   same for both. Without it: own workers from their spawn (the mtime of <run_dir>/logs,
   made as they start) to the first step's line, shared from the Submit (the manager's
   record) to the first step's line. Both include exporting the programs, loading them on
   the workers and the first step. Note: `mpmd train`'s own workers keep JAX's persistent
   compilation cache on disk (~/.cache/mpmd/jax), so after the first run they do not
   compile either: they read from disk what the shared workers hold in memory.
b. Throughput: steps per second of one sharing job alone on the cluster, and of two sharing
   jobs at once (cluster.share=true: both on the same two workers, steps interleaved),
   counted over the window in which both were training. Ratio = two together / one alone
   (1.0: sharing costs nothing and gains nothing in aggregate; on this 2-core machine the
   two jobs compete for the same cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = [
    "configs/gpt_tiny.yaml",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "checkpoint.every=0",
    "log.progress=lines",
    "log.every=1",
    "log.trace_steps=[]",
    "log.tensorboard=false",
]


def mpmd(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpmd.recipes.cli", *map(str, args)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Job:
    """`mpmd train` in the background; `steps[k]` = monotonic time step k's line arrived."""

    def __init__(self, run_dir: Path, *overrides):
        self.t0 = time.monotonic()
        self.stderr = run_dir.parent / f"{run_dir.name}.stderr"
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mpmd.recipes.cli", "train", *CONFIG, *overrides, f"run_dir={run_dir}"],
                cwd=REPO,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.steps: dict[int, float] = {}
        self.wall: dict[int, float] = {}  # the same, wall-clock (to set against the manager's times)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            m = re.match(r"step (\d+)/", line)
            if m:
                self.steps.setdefault(int(m.group(1)), time.monotonic())
                self.wall.setdefault(int(m.group(1)), time.time())

    def wait(self) -> "Job":
        self.proc.wait(timeout=600)
        self._reader.join()
        if self.proc.returncode != 0:
            raise RuntimeError(f"mpmd train failed ({self.proc.returncode}):\n{self.stderr.read_text()[-3000:]}")
        return self

    @property
    def start_s(self) -> float:
        return self.steps[1] - self.t0


def overlap_rate(jobs: list[Job]) -> float:
    """Steps per second all `jobs` together made in the window where every one was training."""
    lo = max(min(j.steps.values()) for j in jobs)
    hi = min(max(j.steps.values()) for j in jobs)
    done = sum(sum(1 for t in j.steps.values() if lo < t <= hi) for j in jobs)
    return done / (hi - lo)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="steps of each throughput job")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_shared_"))
    cluster_file = tmp / "cluster.json"
    up = mpmd("cluster", "up", "--workers", 2, "--dir", tmp / "cl", "--file", cluster_file, "--root", tmp)
    if up.returncode:
        raise SystemExit(up.stderr)
    shared = ["cluster.backend=shared", f"cluster.file={cluster_file}", "cluster.share=true"]
    try:
        print(f"load average at start: {os.getloadavg()}")
        cold = Job(tmp / "cold", "train.steps=3", *shared).wait()  # fills the workers' program cache
        print(f"shared cluster, first job (programs compiled): start {cold.start_s:.2f} s")
        starts = {"local": [], "shared": []}
        submitted = []  # shared: Submit -> first step, from the manager's record
        spawned = []  # own workers: workers spawned -> first step
        for r in range(args.rounds):
            order = ("local", "shared") if r % 2 == 0 else ("shared", "local")
            for kind in order:
                extra = shared if kind == "shared" else ["cluster.backend=local"]
                job = Job(tmp / f"start_{kind}_{r}", "train.steps=3", *extra).wait()
                starts[kind].append(job.start_s)
                if kind == "shared":
                    jobs = json.loads(mpmd("cluster", "status", "--file", cluster_file, "--json").stdout)["jobs"]
                    sub = [j["submitted"] for j in jobs if j["name"] == f"start_shared_{r}"][0]
                    submitted.append(job.wall[1] - sub)
                else:  # LocalLauncher makes <run_dir>/logs as it spawns the workers (mtime: the last one)
                    spawned.append(job.wall[1] - (tmp / f"start_local_{r}" / "logs").stat().st_mtime)
        med = {k: statistics.median(v) for k, v in starts.items()}
        print(
            f"a. job start (launch -> first step), median of {args.rounds}: own workers {med['local']:.2f} s "
            f"{[round(x, 2) for x in starts['local']]}, warm shared cluster {med['shared']:.2f} s "
            f"{[round(x, 2) for x in starts['shared']]}; ratio own / shared = {med['local'] / med['shared']:.2f}; "
            f"without the controller's own start: own workers, spawned -> first step "
            f"{statistics.median(spawned):.2f} s, shared cluster, Submit -> first step "
            f"{statistics.median(submitted):.2f} s (medians); ratio {statistics.median(spawned) / statistics.median(submitted):.2f}"
        )
        alone = Job(tmp / "alone", f"train.steps={args.steps}", *shared).wait()
        one = overlap_rate([alone])
        pair = [Job(tmp / f"pair_{i}", f"train.steps={args.steps}", f"seed={i}", *shared) for i in range(2)]
        for j in pair:
            j.wait()
        two = overlap_rate(pair)
        print(
            f"b. throughput: one sharing job alone {one:.1f} steps/s; two sharing jobs at once "
            f"{two:.1f} steps/s together; ratio two / one = {two / one:.2f}"
        )
        status = mpmd("cluster", "status", "--file", cluster_file, "--json")
        caches = [w["cache"] for w in json.loads(status.stdout)["workers"]]
        print("workers' program cache at the end:", caches)
        print(f"load average at end: {os.getloadavg()}")
    finally:
        mpmd("cluster", "down", "--file", cluster_file)


if __name__ == "__main__":
    main()
