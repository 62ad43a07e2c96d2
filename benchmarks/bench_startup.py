"""A process's start: `import ml_dtypes` and a worker's spawn until it is ready to serve, with
the installed ml_dtypes beside another version of it, in interleaved rounds of one run.

    .venv/bin/pip install -q --no-deps --target /tmp/ml_dtypes_0.7.0 ml_dtypes==0.7.0
    .venv/bin/python benchmarks/bench_startup.py --other /tmp/ml_dtypes_0.7.0 [--rounds 7]
    .venv/bin/python benchmarks/bench_startup.py --cluster 4 [--rounds 7]

Every JAX process imports ml_dtypes (jax's dtypes are numpy dtypes it registers): the
controller, each worker, each gang process, and each replacement worker a recovery spawns,
whose start lies on the recovery's critical path (bench_recovery.py's "spawn"). `--other DIR`
puts DIR first on the child processes' PYTHONPATH, so they import the ml_dtypes found there
instead of the installed one; everything else is the same environment. Per round, in
alternating order: a fresh interpreter's `import ml_dtypes` (seconds, timed inside it), and
a worker (LocalCluster's command line and environment, runtime/launchers/workers.py,
JAX on the CPU) from Popen until it prints its ready line. Medians over the rounds, and other / installed.

`--cluster N` times a LocalLauncher's start of N workers instead: its processes started side by
side, then their READY lines awaited (LocalLauncher.start), against one after another, each
awaited before the next is started (as start did until 2026-12-07), in alternating rounds.

Why pyproject.toml bounds ml_dtypes below 0.7: 0.7.0's import took ~0.5 s on this machine
(numpy 2.4), 0.5.4's and 0.6.0's ~0.06 s (docs/benchmarks.md, Start-up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-startup-0123456789abcdef0123"
IMPORT = "import time; t = time.perf_counter(); import ml_dtypes; print(time.perf_counter() - t, ml_dtypes.__version__)"


def env_with(first: str | None) -> dict:
    """A worker's environment as LocalCluster builds it (no compilation cache), JAX on the CPU,
    with `first` ahead of everything on PYTHONPATH."""
    from mpmd.runtime.launchers.workers import worker_env

    env = dict(worker_env(""), JAX_PLATFORMS="cpu")
    if first:
        env["PYTHONPATH"] = first + os.pathsep + env["PYTHONPATH"]
    return env


def import_s(env: dict) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", IMPORT], env=env, capture_output=True, text=True, check=True)
    seconds, version = out.stdout.split()
    return float(seconds), version


def worker_ready_s(env: dict) -> float:
    from mpmd.runtime.launchers.workers import worker_command
    from mpmd.runtime.worker.main import READY

    start = time.perf_counter()
    proc = subprocess.Popen(
        worker_command("127.0.0.1:0", str(REPO), 1, token_stdin=True),
        env=env,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        proc.stdin.write(TOKEN + "\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith(READY):
                return time.perf_counter() - start
        raise RuntimeError(f"the worker exited ({proc.wait()}) before it was ready")
    finally:
        proc.stdin.close()  # end of file: the worker exits
        proc.wait(timeout=30)


def cluster_start_s(n: int, side_by_side: bool) -> float:
    """Seconds for a LocalLauncher (no compilation cache, JAX on the CPU) to have n workers ready."""
    from mpmd.runtime.launchers.local import LocalLauncher

    launcher = LocalLauncher(TOKEN, num_workers=n, log_dir=None)
    start = time.perf_counter()
    try:
        if side_by_side:
            launcher.start(n, str(REPO))
        else:  # the launcher's start, each slot awaited before the next
            launcher._running_root = str(REPO)
            launcher.addresses = [launcher._spawn(i) for i in range(n)]
        return time.perf_counter() - start
    finally:
        launcher.stop()


def main_cluster(n: int, rounds: int) -> None:
    print(
        f"bench_startup --cluster {n}: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, {rounds} rounds"
    )
    times: dict = {"one after another": [], "side by side": []}
    for i in range(rounds):
        for name in list(times) if i % 2 == 0 else list(times)[::-1]:
            times[name].append(cluster_start_s(n, name == "side by side"))
    for name, ts in times.items():
        print(f"{name:<18} median {statistics.median(ts):.2f} s (min {min(ts):.2f}, max {max(ts):.2f})")
    ratio = statistics.median(times["side by side"]) / statistics.median(times["one after another"])
    print(f"side by side / one after another: {ratio:.2f}x; load average at end {os.getloadavg()[0]:.2f}")


def main(other: str | None, rounds: int) -> None:
    print(f"bench_startup: {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}, {rounds} rounds")
    variants = {"installed": env_with(None)}
    if other:
        variants["other"] = env_with(other)
    versions = {name: import_s(env)[1] for name, env in variants.items()}
    if other and versions["other"] == versions["installed"]:
        raise SystemExit(f"--other {other} holds the same ml_dtypes as the installed one ({versions['other']})")
    imports: dict = {name: [] for name in variants}
    ready: dict = {name: [] for name in variants}
    names = list(variants)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            imports[name].append(import_s(variants[name])[0])
            ready[name].append(worker_ready_s(variants[name]))
    print(f"{'variant':<10} {'ml_dtypes':>10} {'import ms':>10} {'worker ready ms':>16}")
    for name in names:
        print(
            f"{name:<10} {versions[name]:>10} {1e3 * statistics.median(imports[name]):>10.1f} "
            f"{1e3 * statistics.median(ready[name]):>16.1f}"
        )
    if other:
        med = lambda d, n: statistics.median(d[n])
        print(
            f"other / installed: import {med(imports, 'other') / med(imports, 'installed'):.2f}x, "
            f"worker ready {med(ready, 'other') / med(ready, 'installed'):.2f}x"
        )
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--other",
        default=None,
        help="a directory holding another ml_dtypes (pip install --no-deps --target DIR ml_dtypes==X)",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cluster", type=int, default=None, help="time a start of this many workers instead")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.other is not None and not (Path(args.other) / "ml_dtypes").is_dir():
        parser.error(
            f"--other {args.other}: no ml_dtypes package in it (pip install --no-deps --target DIR ml_dtypes==X)"
        )
    if args.cluster is not None and args.cluster < 1:
        parser.error(f"--cluster must be at least 1 worker, got {args.cluster}")
    sys.path.insert(0, str(REPO))
    if args.cluster is not None:
        main_cluster(args.cluster, args.rounds)
    else:
        main(args.other, args.rounds)
