"""Shared workers (`mpmd worker --shared`), worker side: a job's start with the programs
already compiled by an earlier job against a fresh one, and two jobs time-sharing the same
workers against one alone, side by side in one run.

    .venv/bin/python benchmarks/bench_shared_worker.py [--steps N]

Two shared worker processes, pinned to cores 0 and 1 as LocalCluster pins its workers, with
JAX's compilation cache on disk switched off (so a fresh job really compiles). Each job is
configs/gpt_tiny.yaml as `mpmd train` builds it (byte GPT, d_model 64, 4 layers, 2 stages,
1F1B, 4 microbatches, adamw), its Trainer on a StaticCluster over both workers with the job's
credential; its sessions are opened as the cluster manager would (OpenSession).

a. Job start: the Trainer's first step from nothing (Setup, ship programs and plans, init
   the parameters, step 1) for a fresh job (every program a compile-cache miss), then for
   a second job with the same config (all hits), then a third. Reported: each start, the
   ratio fresh / repeated, and the workers' cache counters.
b. Time-sharing: STEPS steps of one job alone, then two jobs at once (each STEPS steps, in
   two threads); aggregate steps/s of the pair over the one alone. Also checks that every
   job's losses equal the lone job's bit for bit.
"""

from __future__ import annotations

import cpu_setup  # noqa: I001  (first: before anything imports jax)

REPO = cpu_setup.before_jax(devices=1)

import argparse  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def build(workers, job: str, run_dir: str):
    """Job `job`'s Trainer (gpt_tiny, as `mpmd train` builds it) on the shared workers, and its loader."""
    import mpmd
    from mpmd.recipes import config
    from mpmd.recipes.data import loaders as data
    from mpmd.recipes.run import build

    cfg = config.load(REPO / "configs/gpt_tiny.yaml", [f"run_dir={run_dir}", "checkpoint.every=0"])
    loader, _ = data.make_loaders(cfg)
    p = cfg.pipeline
    sample = loader.batch_at(0)[0][: cfg.train.batch_size // p.num_microbatches]
    stages, loss_fn = build.build_model(cfg, sample)
    trainer = mpmd.Trainer(
        mpmd.Pipeline(stages, loss_fn, sample_input=sample),
        build.build_optimizer(cfg),
        schedule=p.schedule,
        num_microbatches=p.num_microbatches,
        cluster=workers.job(job),
        max_grad_norm=cfg.optimizer.max_grad_norm,
    )
    return trainer, loader


def first_step_s(workers, job: str, run_dir: str) -> float:
    """Seconds from nothing to job `job`'s first step done (its Trainer closed after)."""
    t0 = time.perf_counter()
    trainer, loader = build(workers, job, run_dir)
    try:
        trainer.step(*loader.next())
        return time.perf_counter() - t0
    finally:
        trainer.close()


def losses(trainer, loader, steps: int, out: list) -> None:
    for _ in range(steps):
        out.append(trainer.step(*loader.next())["loss"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="steps per job in part b (default 30)")
    args = ap.parse_args()
    from mpmd.runtime.control.client import WorkerError
    from tests.support.processes import StandaloneWorkers

    print(f"load average at start: {os.getloadavg()}")
    with (
        tempfile.TemporaryDirectory() as tmp,
        StandaloneWorkers(Path(tmp), 2, disk_cache=False, cpus=[0, 1]) as workers,
    ):
        starts = {job: first_step_s(workers, job, tmp) for job in ("fresh", "repeat-1", "repeat-2")}
        caches = [workers.admin(i, "Sessions")["cache"] for i in range(2)]
        print("\na. job start (nothing -> first step done), gpt_tiny, 2 shared workers")
        for job, s in starts.items():
            print(f"   {job:>9}: {s:6.2f} s")
        print(
            f"   fresh / repeated: {starts['fresh'] / starts['repeat-1']:.2f}x, "
            f"{starts['fresh'] / starts['repeat-2']:.2f}x"
        )
        for i, c in enumerate(caches):
            print(
                f"   worker {i} cache: {c['programs']} programs, {c['bytes']} B; hits {c['hits']}, "
                f"misses {c['misses']}, evictions {c['evictions']}"
            )

        jobs = {job: build(workers, job, tmp) for job in ("alone", "a", "b")}
        try:
            for trainer, loader in jobs.values():  # the first steps (param init, warm-up) apart
                trainer.step(*loader.next())
            got = {job: [] for job in jobs}
            t0 = time.perf_counter()
            losses(*jobs["alone"], args.steps, got["alone"])
            alone_s = time.perf_counter() - t0
            threads = [threading.Thread(target=losses, args=(*jobs[j], args.steps, got[j])) for j in ("a", "b")]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            pair_s = time.perf_counter() - t0
        finally:
            for trainer, _ in jobs.values():
                try:
                    trainer.close()
                except WorkerError:
                    pass
        same = all(got[j] == got["alone"] and len(got[j]) == args.steps for j in ("a", "b"))
        print(
            f"\nb. {args.steps} steps per job: one alone {args.steps / alone_s:.2f} steps/s; two sharing "
            f"{2 * args.steps / pair_s:.2f} steps/s together ({args.steps / pair_s:.2f} each); aggregate "
            f"ratio {(2 * args.steps / pair_s) / (args.steps / alone_s):.2f}x"
        )
        print(f"   losses of both sharing jobs bitwise equal to the lone job's: {same}")
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
