"""Hung or busy: how late busy workers answer, and whether one is ever declared lost.

    .venv/bin/python benchmarks/bench_heartbeat.py [--hogs 4] [--steps 20] [--model small|tiny]

A Trainer (bench_recovery's GPT, 2 stages, 1f1b, m=4; LocalCluster(num_workers=2),
failure_timeout_s=60 so that only the probes could declare a loss) starts, compiles and runs
`--steps` steps with a persistent save and an in-memory snapshot every step, beside `--hogs`
processes spinning on the CPU (the other engineers of a shared machine). Meanwhile a thread
of this process sends each worker a Heartbeat every 20 ms on a client of its own and times
the answers, per phase (start: programs shipped and loaded; compile: the first 2 steps;
steps: the rest with their saves). It prints, per phase, the round trips' median, p99 and
max; the control plane's probes (runtime/control/heartbeat.py) started, found busy and found
hung (each a false loss: every worker here is alive), the recoveries (Rewound), the probes'
timeout at the end and the slowest of the timed connections it follows. Goal: no worker
found hung.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import cpu_setup  # noqa: E402  (first: sets the flags before anything imports jax)

cpu_setup.before_jax(devices=2)

import bench_recovery  # noqa: E402


def pinger(cluster, phase: list, rtts: dict, stop: threading.Event) -> None:
    """Heartbeat each worker every 20 ms on a client of its own; {phase: [round trip s]}."""
    from mpmd.runtime.control.rpc import WorkerClient, send
    from mpmd.runtime.wire import verbs

    clients = [
        WorkerClient(a, cluster.launcher._token, collections.Counter(), tls=cluster.tls) for a in cluster.addresses
    ]
    for c in clients:
        c.generation = 2**31  # Heartbeat moves no generation; an old one would be refused
    while not stop.wait(0.02):
        for c in clients:
            t0 = time.monotonic()
            try:
                send(c, verbs.Empty(), timeout_s=30.0, verb="Heartbeat").result()
            except Exception:  # noqa: BLE001 (a worker being replaced: nothing to time)
                continue
            rtts[phase[0]].append(time.monotonic() - t0)
    for c in clients:
        c.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=4, help="CPU-spinning processes beside the run")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", choices=sorted(bench_recovery.MODELS), default="small")
    args = parser.parse_args()
    import mpmd
    from mpmd.runtime.control import heartbeat

    bench_recovery.GPT, bench_recovery.BATCH = bench_recovery.MODELS[args.model]
    hung = []
    probed = heartbeat.Heartbeats._probed

    def counted(self, c, beat, *rest):  # benchmark only: count the verdicts as they are made
        probed(self, c, beat, *rest)
        if beat.hung is not None:
            hung.append(beat.hung)

    heartbeat.Heartbeats._probed = counted
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    phase, rtts, stop = ["start"], collections.defaultdict(list), threading.Event()
    rewinds, start = 0, time.monotonic()
    print(f"bench_heartbeat: {os.cpu_count()} cores, {args.hogs} hog(s), load average {os.getloadavg()[0]:.1f}")
    try:
        with tempfile.TemporaryDirectory(prefix="bench_heartbeat_") as tmp:
            bench_recovery.workers_log_to(tmp, "bench_heartbeat")
            cluster = mpmd.LocalCluster(num_workers=2, root=tmp, failure_timeout_s=60.0)
            cluster.start(2, root=tmp)  # the Trainer starts the same workers afresh
            thread = threading.Thread(target=pinger, args=(cluster, phase, rtts, stop), daemon=True)
            thread.start()
            trainer = bench_recovery.make_trainer(
                cluster, run_dir=tmp, checkpoint=mpmd.Checkpointing(every=1, memory_every=1)
            )
            data, i = bench_recovery.batches(), 0
            while i < args.steps:
                phase[0] = "compile" if i < 2 else "steps"
                try:
                    trainer.step(data[i % len(data)], data[i % len(data)])
                    i += 1
                except mpmd.Rewound:
                    rewinds += 1
            trainer.checkpoints.wait()
            stop.set()
            thread.join()
            beats = cluster.heartbeats
            trainer.close()
    finally:
        for h in hogs:
            h.kill()
    print(
        f"{args.model}, {args.steps} steps in {time.monotonic() - start:.0f} s, load average at end {os.getloadavg()[0]:.1f}"
    )
    print(f"{'phase':>8} {'heartbeats':>10} {'median ms':>10} {'p99 ms':>8} {'max ms':>8}")
    for name, xs in rtts.items():
        xs = sorted(xs)
        print(
            f"{name:>8} {len(xs):>10} {statistics.median(xs) * 1e3:>10.1f} {xs[int(0.99 * (len(xs) - 1))] * 1e3:>8.1f} "
            f"{xs[-1] * 1e3:>8.1f}"
        )
    print(
        f"probes {beats.probes}, found busy {beats.busy}, found hung {len(hung)} (goal 0), recoveries {rewinds}; "
        f"probes' timeout at the end {beats.timeout_s():.2f} s (the slowest of {len(beats.connects_s)} timed "
        f"connections {max(beats.connects_s, default=0.0) * 1e3:.0f} ms)"
    )
    for why in hung[:3]:
        print("  ", why)


if __name__ == "__main__":
    main()
