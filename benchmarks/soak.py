"""A soak: one long gpt_tiny run through `mpmd train` under faults injected at random steps,
against the same run uninterrupted; every step's loss must come out bitwise equal.

    .venv/bin/python benchmarks/soak.py [--steps 2000] [--seed 0] [--mean-gap 50] [--keep DIR] [--hosts]

With --hosts (root) the runs are on several hosts made of network namespaces instead, with
their own faults: partitions, zombies, and workers restarted by hand (benchmarks/soak_hosts.py
says which); the rest of this note describes the default, local bed.

Both runs are the real CLI (a controller subprocess, 2 local worker processes, real gRPC and
Orbax), gpt_tiny with a checkpoint every 10 steps, no eval or sample. The faulted run is
started again with the same command whenever its controller ends before the last step,
which it must survive bitwise. Faults, one every `--mean-gap` steps on average (exponential
gaps from `--seed`), drawn among:
  worker-kill      SIGKILL one worker (by pid): the controller recovers in place
  worker-term      SIGTERM one worker: the same, as a preempted worker host
  controller-kill  SIGKILL the controller: its workers exit on their own; rerun resumes
  controller-term  SIGTERM the controller (a preemption): it commits and exits 143; rerun
  corrupt          SIGKILL the controller, then flip one bit in the largest data file of the
                   newest committed step: the rerun finds it damaged (digest), sets it aside
                   and resumes from the one before
  full-disk        fill the run directory's filesystem (a tmpfs of its own; skipped when
                   this process may not mount one): the run stops after its last commit
                   with one error line; the space is freed and the rerun resumes
A fault is injected only once the current controller has logged two steps of its own (not
while it starts). At the end it prints the faults per kind, controller restarts, recoveries
in place, steps logged twice (replayed), goodput (the uninterrupted run's wall time over the
faulted one's, restarts and compilation included), and every step whose loss differs.
Exit status 0 when all N losses match, every controller ended as its fault says, and every
committed checkpoint verifies (tests/support/recovery_runs.py assert_commits_verify: one
generation per step, nothing newer than its manifest, every leaf's digest read back).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support, as when run from the repository root
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the checkpoint check at the end reads leaves back

from mpmd.recipes.run import run_log  # noqa: E402
from mpmd.runtime.worker.slice_store import CheckpointStore  # noqa: E402
from tests.support.processes import children, wait_gone  # noqa: E402

KINDS = ("worker-kill", "worker-term", "controller-kill", "controller-term", "corrupt", "full-disk")
EVERY = 10
# What each controller end is after a fault: the exit status it must have.
EXPECTED_RC = {"controller-kill": -signal.SIGKILL, "corrupt": -signal.SIGKILL, "controller-term": 143, "full-disk": 1}


def overrides(steps: int, run_dir: Path) -> list[str]:
    return [
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.sample_tokens=0",
        f"checkpoint.every={EVERY}",
        "log.progress=lines",
        "log.every=1",
        "log.trace_steps=[]",
        "log.tensorboard=false",
        f"run_dir={run_dir}",
    ]


def start(steps: int, run_dir: Path, log: Path, extra=(), prefix=()) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with open(log, "a") as out:
        return subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "mpmd.recipes.cli",
                "train",
                "configs/gpt_tiny.yaml",
                *overrides(steps, run_dir),
                *extra,
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


class LocalBed:
    """The controller and its two local workers on this host, as `mpmd train` starts them."""

    kinds = KINDS

    def __init__(self, disk: Disk):
        self.disk = disk
        if not disk.mounted:
            self.kinds = tuple(k for k in KINDS if k != "full-disk")

    def start(self, steps: int, run_dir: Path, log: Path) -> subprocess.Popen:
        return start(steps, run_dir, log)

    def busy(self) -> bool:
        return False

    def tick(self) -> None:
        pass

    def inject(self, kind: str, proc: subprocess.Popen, run_dir: Path, rng, problems: list) -> tuple[bool, str | None]:
        """(injected, the fault that ends this controller or None)."""
        workers = children(proc.pid)
        if kind.startswith("worker") and workers:
            os.kill(rng.choice(workers), signal.SIGKILL if kind == "worker-kill" else signal.SIGTERM)
            return True, None
        if kind == "full-disk" and self.disk.mounted:
            self.disk.fill()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                problems.append("the run went on for 60 s on a full disk")
            self.disk.free()
            return True, kind
        return controller_fault(kind, proc, run_dir, workers, problems)

    def close(self) -> None:
        self.disk.close()


def controller_fault(kind: str, proc, run_dir: Path, workers, problems: list) -> tuple[bool, str | None]:
    """The faults that end the controller, whatever the bed: (injected, ended by). A bit is
    flipped only while two steps are committed: the one before the flipped one is what the
    run resumes from (with one, a second flip in a row would leave nothing to resume)."""
    if kind == "corrupt" and len(committed(run_dir)) < 2:
        return False, None
    if kind in ("controller-kill", "corrupt"):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if workers and wait_gone(workers, 20.0):
            problems.append(f"workers {workers} outlived their SIGKILLed controller")
        if kind == "corrupt":
            print(f"  corrupt: {flip_bit(run_dir)}", flush=True)
        return True, kind
    if kind == "controller-term":
        os.kill(proc.pid, signal.SIGTERM)
        return True, kind
    return False, None


def logged_steps(run_dir: Path) -> int:
    """The newest step in metrics.jsonl (0 before the first)."""
    try:
        records = run_log.read(run_dir)
    except (OSError, ValueError):
        return 0
    return int(records[-1]["step"]) if records else 0


def losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): r["loss"] for r in run_log.read(run_dir)}


def committed(run_dir: Path) -> list[int]:
    return CheckpointStore(run_dir).committed()


def flip_bit(run_dir: Path) -> str:
    """One bit in the middle of the largest data file of the newest committed step."""
    steps = committed(run_dir)
    if not steps:
        return "nothing committed yet"
    files = [f for f in (run_dir / "checkpoints" / str(steps[-1])).glob("slice_*/**/*") if f.is_file()]
    big = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0x10
    big.write_bytes(bytes(data))
    return f"step {steps[-1]}: {big.relative_to(run_dir)}"


class Disk:
    """The faulted run's own small filesystem, so that filling it hurts nothing else."""

    def __init__(self, path: Path, size_mb: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True, text=True
        )
        self.mounted = r.returncode == 0
        self.why = r.stderr.strip()
        self.filler = path / "filler"

    def fill(self) -> None:
        with open(self.filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
            except OSError:  # ENOSPC: full
                pass

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.path)], check=False)


def plan(seed: int, steps: int, mean_gap: float, kinds: tuple[str, ...]) -> list[tuple[int, str]]:
    """(step, kind) pairs, sorted: exponential gaps, kinds in turn from a shuffled cycle so
    each appears about equally often."""
    rng = random.Random(seed)
    out, at = [], 0.0
    cycle: list[str] = []
    while True:
        at += rng.expovariate(1.0 / mean_gap)
        if at >= steps - 5:
            return out
        if not cycle:
            cycle = list(kinds)
            rng.shuffle(cycle)
        out.append((max(1, int(at)), cycle.pop()))


def faulted_run(bed, steps: int, run_dir: Path, logs: Path, faults: list[tuple[int, str]], rng) -> dict:
    pending = collections.deque(faults)
    injected: collections.Counter = collections.Counter()
    ends: list[tuple[str | None, int]] = []  # (the fault that ended a controller, its exit status)
    problems: list[str] = []
    segment = 0
    while True:
        segment += 1
        log = logs / f"controller_{segment}.log"
        first = logged_steps(run_dir)
        proc = bed.start(steps, run_dir, log)
        ended_by = None
        while proc.poll() is None:
            bed.tick()
            now = logged_steps(run_dir)
            if ended_by is None and pending and now >= pending[0][0] and now >= first + 2 and not bed.busy():
                at, kind = pending.popleft()
                done, ended_by = bed.inject(kind, proc, run_dir, rng, problems)
                if done:
                    injected[kind] += 1
                    print(f"  step {now}: {kind}", flush=True)
                else:  # not now (nothing to hit yet): at the next look
                    pending.appendleft((at, kind))
            time.sleep(0.1)
        rc = proc.wait()
        ends.append((ended_by, rc))
        if rc == 0 and ended_by is None:
            break
        want = EXPECTED_RC.get(ended_by)
        if want is None or rc != want:
            problems.append(
                f"controller {segment} ended with exit status {rc} after {ended_by or 'no fault'} (see {log})"
            )
            if ended_by is None:
                break
    texts = [p.read_text() for p in sorted(logs.glob("controller_*.log"))]
    step_lines = sum(1 for t in texts for line in t.splitlines() if line.startswith("step "))
    return {
        "injected": injected,
        "ends": ends,
        "problems": problems,
        "restarts": segment - 1,
        "recoveries": sum(t.count("recovered:") for t in texts),
        "damaged_found": sum(t.count("damaged") > 0 for t in texts),
        "logged_step_lines": step_lines,
    }


def verify_checkpoints(run_dir: Path) -> list[str]:
    """What is wrong with the committed checkpoints, as the fault tests check them
    (tests/support/recovery_runs.py assert_commits_verify): a damaged step, parts of several
    generations, a part written after its manifest, a leaf whose digest does not read back."""
    from tests.support.recovery_runs import assert_commits_verify

    try:
        assert_commits_verify(run_dir)
    except AssertionError as e:
        return [f"committed checkpoints: {e}"]
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-gap", type=float, default=50.0, help="mean steps between faults")
    p.add_argument("--disk-mb", type=int, default=96, help="size of the faulted run's tmpfs")
    p.add_argument(
        "--hosts",
        action="store_true",
        help="run on network namespaces (benchmarks/soak_hosts.py): static workers on hosts of their "
        "own, the controller on another, mutual TLS, and partition and zombie faults (needs root)",
    )
    p.add_argument(
        "--keep", type=Path, default=None, help="where both runs' records go (default: a new temporary directory)"
    )
    args = p.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="mpmd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    disk = Disk(work / "faulted", args.disk_mb)
    if args.hosts:
        from benchmarks.soak_hosts import HostBed

        bed = HostBed(work, disk)
    else:
        bed = LocalBed(disk)
    kinds = bed.kinds
    if not disk.mounted:
        print(f"full-disk faults skipped: cannot mount a tmpfs ({disk.why})")
    try:
        faults = plan(args.seed, args.steps, args.mean_gap, kinds)
        print(f"uninterrupted run: {args.steps} steps")
        t0 = time.monotonic()
        ref = bed.start(args.steps, work / "reference", work / "reference.log")
        if ref.wait() != 0:
            print(f"the uninterrupted run failed: see {work / 'reference.log'}")
            return 1
        ref_s = time.monotonic() - t0
        print(f"faulted run: {len(faults)} faults planned (seed {args.seed})", flush=True)
        logs = work / "faulted_logs"
        logs.mkdir(exist_ok=True)
        t0 = time.monotonic()
        got = faulted_run(bed, args.steps, disk.path / "run", logs, faults, random.Random(args.seed + 1))
        faulted_s = time.monotonic() - t0
        want, have = losses(work / "reference"), losses(disk.path / "run")
        mismatch = [s for s in range(1, args.steps + 1) if have.get(s) != want.get(s)]
        order_ok = sorted(have) == list(range(1, args.steps + 1))
        got["problems"] += verify_checkpoints(disk.path / "run")
    finally:
        if disk.mounted and (disk.path / "run").exists():
            # The faulted run's records (not its checkpoints) onto the real disk before the tmpfs goes.
            shutil.copytree(
                disk.path / "run",
                work / "faulted_run",
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("checkpoints"),
            )
        bed.close()
    injected = got["injected"]
    print(
        f"\nsteps {args.steps}, seed {args.seed}, faults injected {sum(injected.values())}: "
        + ", ".join(f"{k} {injected[k]}" for k in kinds)
    )
    print(
        f"controller restarts {got['restarts']}, recoveries in place {got['recoveries']}, "
        f"damaged checkpoints found on resume {got['damaged_found']}, "
        f"steps logged twice (replayed) {got['logged_step_lines'] - args.steps}"
    )
    print(f"wall: uninterrupted {ref_s:.0f} s, faulted {faulted_s:.0f} s, goodput {ref_s / faulted_s:.2f}")
    print(
        f"losses: {args.steps - len(mismatch)}/{args.steps} bitwise equal to the uninterrupted run"
        + (f"; differ at steps {mismatch[:20]}" if mismatch else "")
        + ("" if order_ok else "; metrics.jsonl does not hold each step exactly once")
    )
    for problem in got["problems"]:
        print(f"problem: {problem}")
    print(f"logs: {work}")
    return 0 if not mismatch and order_ok and not got["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
