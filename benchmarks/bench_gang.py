"""A slice as a gang of processes (runtime/worker/gang.py): what it costs per step, and how long a
lost gang takes to replace.

    .venv/bin/python benchmarks/bench_gang.py [--steps 6] [--rounds 2] [--only step|replace|gather]

Model: a GPT (vocab 64, d_model 64, 2 heads, 4 layers, seq 32, batch 16) in 2 stages, 1F1B,
4 microbatches, SGD with momentum; each slice's mesh is data=2.

a. Per-step time, the same mesh two ways, side by side in one run (rounds alternate):
   "gang"    2 slices x a gang of 2 processes x 1 device (LocalCluster(processes_per_slice=2))
   "1 proc"  2 slices x 1 process x 2 devices (LocalCluster(devices_per_worker=2))
   Median wall time of trainer.step after 2 warm-up steps, and gang / 1 proc. The gang adds
   per step: a Run RPC per process (4 instead of 2), the gang's agreement at the run's start
   and at each receive (a key-value write and read per process), pieces moved one transfer
   each, and the data-parallel gradient reduction across processes over gloo (TCP on
   loopback) instead of inside one process.
b. Replacing a lost gang: checkpoint_every=2, process 1 of slice 1 SIGKILLed just before a
   step; the parts, from the kill to the end of the first step after:
     detect   kill -> the loss known (the step's Rewound caught, less the parts below)
     spawn    the old gang's processes killed and reaped, 2 new ones started, the JAX
              distributed group formed, both ready (LocalLauncher.replace, timed here)
     setup    connect, Setup on both processes, every slice reconnected, programs re-sent
     restore  every slice restored from the last commit
     first    the replayed step, the new gang compiling its programs (or loading them
              from JAX's persistent cache) on its first Run
c. FSDP weights gathered per microbatch against once a step (mesh.fsdp_gather), side by side
   in one run as in a.: 2 slices x a gang of 2 processes, mesh fsdp=2, both per_microbatch
   and per_step; with per_microbatch every forward and backward program gathers its weights
   over gloo, with per_step gather{k} does it once, one buffer per dtype.
On this 2-core machine 8 processes share 2 cores: figures are upper bounds, and the load
average is printed at the start and end.
"""

from __future__ import annotations

import cpu_setup  # noqa: I001  (first: sets the flags before anything imports jax)

cpu_setup.before_jax(devices=2)

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from mpmd import models  # noqa: E402
import mpmd  # noqa: E402


def batches(n: int):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 64, (16, 32)).astype(np.int32) for _ in range(n)]


def make_trainer(cluster, run_dir=None, checkpoint_every=0, mesh=None, **kw):
    pipe = mpmd.Pipeline(mpmd.split(models.GPT(64, 64, 2, 4, 32, rngs=nnx.Rngs(0)), num_stages=2), models.lm_loss)
    if run_dir:
        kw.update(run_dir=run_dir, checkpoint=mpmd.Checkpointing(every=checkpoint_every))
    return mpmd.Trainer(
        pipe,
        optax.sgd(0.1, momentum=0.9),
        schedule="1f1b",
        num_microbatches=4,
        mesh=mesh or {"data": 2},
        cluster=cluster,
        **kw,
    )


def alternate(trainers: dict, steps: int, rounds: int) -> tuple[dict, dict]:
    """Median seconds a step of each trainer, rounds of `steps` steps alternating between them
    after 2 warm-up steps each, and each trainer's losses (closes the trainers)."""
    data = batches(steps)
    times = {name: [] for name in trainers}
    losses = {name: [] for name in trainers}
    try:
        for t in trainers.values():  # warm up: compile, first transfers
            for x in data[:2]:
                t.step(x, x)
        for _ in range(rounds):
            for name, t in trainers.items():
                for x in data:
                    t0 = time.perf_counter()
                    losses[name].append(t.step(x, x)["loss"])
                    times[name].append(time.perf_counter() - t0)
    finally:
        for t in trainers.values():
            t.close()
    return {name: statistics.median(v) for name, v in times.items()}, losses


def per_step(steps: int, rounds: int) -> None:
    med, losses = alternate(
        {
            "gang": make_trainer(mpmd.LocalCluster(num_workers=2, processes_per_slice=2)),
            "1 proc": make_trainer(mpmd.LocalCluster(num_workers=2, devices_per_worker=2)),
        },
        steps,
        rounds,
    )
    print(f"\na. per-step time, 2 slices, mesh data=2 each ({rounds} rounds x {steps} steps, medians)")
    print(f"{'layout':>8} {'step ms':>8}")
    for name, m in med.items():
        print(f"{name:>8} {1e3 * m:>8.1f}")
    print(
        f"gang / 1 proc = {med['gang'] / med['1 proc']:.2f}; losses equal bitwise: {losses['gang'] == losses['1 proc']}"
    )


def gather(steps: int, rounds: int) -> None:
    trainers = {
        mode: make_trainer(
            mpmd.LocalCluster(num_workers=2, processes_per_slice=2), mesh=mpmd.Mesh({"fsdp": 2}, fsdp_gather=mode)
        )
        for mode in ("per_microbatch", "per_step")
    }
    med, losses = alternate(trainers, steps, rounds)
    print(
        f"\nc. FSDP weights gathered per microbatch or once a step, 2 slices x a gang of 2 "
        f"processes, mesh fsdp=2 ({rounds} rounds x {steps} steps, medians)"
    )
    print(f"{'fsdp_gather':>15} {'step ms':>8}")
    for name, m in med.items():
        print(f"{name:>15} {1e3 * m:>8.1f}")
    print(
        f"per_step / per_microbatch = {med['per_step'] / med['per_microbatch']:.2f}; losses equal "
        f"bitwise: {losses['per_step'] == losses['per_microbatch']}"
    )


def replace_gang() -> None:
    data = batches(8)
    with tempfile.TemporaryDirectory() as run_dir:
        cluster = mpmd.LocalCluster(num_workers=2, processes_per_slice=2, root=run_dir)
        spawn = []
        replace = cluster.launcher.replace

        def timed_replace(slot, **kw):
            t0 = time.perf_counter()
            try:
                return replace(slot, **kw)
            finally:
                spawn.append(time.perf_counter() - t0)

        cluster.launcher.replace = timed_replace
        trainer = make_trainer(cluster, run_dir, checkpoint_every=2)
        try:
            for x in data[:4]:
                trainer.step(x, x)
            steady = []
            for x in data[4:6]:
                t0 = time.perf_counter()
                trainer.step(x, x)
                steady.append(time.perf_counter() - t0)
            victim = cluster.gang_pids(1)[1]
            t0 = time.perf_counter()
            os.kill(victim, signal.SIGKILL)
            try:
                trainer.step(data[6], data[6])
                raise SystemExit("the step after the kill did not fail: nothing was replaced")
            except mpmd.Rewound:
                t_caught = time.perf_counter()
            rec = trainer.recovery_s
            t1 = time.perf_counter()
            trainer.step(data[6], data[6])
            first = time.perf_counter() - t1
        finally:
            trainer.close()
    detect = (t_caught - t0) - rec["replace_s"] - rec["restore_s"]
    parts = {
        "detect": detect,
        "spawn": spawn[0],
        "setup": rec["replace_s"] - spawn[0],
        "restore": rec["restore_s"],
        "first": first,
    }
    print("\nb. replacing a lost gang (process 1 of slice 1 SIGKILLed), seconds")
    print(" ".join(f"{k:>8}" for k in parts) + f" {'total':>8} {'steady step':>12}")
    print(
        " ".join(f"{v:>8.2f}" for v in parts.values()) + f" {sum(parts.values()):>8.2f} "
        f"{statistics.median(steady):>12.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", choices=("step", "replace", "gather"), help="run one part only")
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    if args.only in (None, "step"):
        per_step(args.steps, args.rounds)
    if args.only in (None, "replace"):
        replace_gang()
    if args.only in (None, "gather"):
        gather(args.steps, args.rounds)
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
