"""What checkpoint digests cost: a save every step and a restore, with and without them.

    .venv/bin/python benchmarks/bench_checkpoint_digests.py [--steps N] [--rounds N]

configs/gpt_small.yaml's model (d_model 256, 8 blocks, seq_len 128, batch 32; adamw, 4
microbatches) in 2 stages, 1F1B, on 2 real worker processes (LocalCluster), with
`Checkpointing(every=1)`: asynchronous saves, each slice writing its part in its background
thread and, with digests, then hashing every leaf it wrote (CRC-32 of the host bytes);
the controller records the digests at commit. Timed per variant: the median step time over
`--steps` steps after 2 warm-up steps (a step's wall time includes waiting for the save two
steps back, so the write and the digests show), and the median of 3 restores of the newest
step (`restore_latest`: every slice reads its leaves and, with digests, hashes what it read
and compares). Variants alternate within each round, a fresh run directory each; the
ratios are digests / none, side by side in one run.

Workers' stderr goes to a log file (path printed). The load average is printed at the start
and end: on a 2-core machine other processes move every figure.
"""

from __future__ import annotations

import os

import cpu_setup  # noqa: E402  (first: sets the flags before anything imports jax)

cpu_setup.before_jax(devices=4)

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

VARIANTS = {"no digests": False, "digests": True}


def gpt_small() -> tuple[dict, int]:
    """(GPT keyword arguments, global batch) of configs/gpt_small.yaml."""
    from mpmd.recipes import config

    cfg = config.load(str(cpu_setup.REPO / "configs" / "gpt_small.yaml"), [])
    m = cfg.model
    return dict(
        vocab_size=256, d_model=m.d_model, num_heads=m.num_heads, num_layers=m.num_layers, seq_len=m.seq_len
    ), cfg.train.batch_size


def make_trainer(cluster, run_dir, gpt, digests: bool):
    from mpmd import models
    import mpmd
    import optax
    from flax import nnx

    pipe = mpmd.Pipeline(mpmd.split(models.GPT(**gpt, rngs=nnx.Rngs(0)), num_stages=2), models.lm_loss)
    return mpmd.Trainer(
        pipe,
        optax.adamw(3e-4),
        schedule="1f1b",
        num_microbatches=4,
        cluster=cluster,
        run_dir=str(run_dir),
        checkpoint=mpmd.Checkpointing(every=1, keep=2, digests=digests),
    )


def train_steps(cluster, run_dir, gpt, digests: bool, xs) -> list[float]:
    """Wall seconds of each step after the first 2 (warm-up), a checkpoint every step."""
    trainer = make_trainer(cluster, run_dir, gpt, digests)
    times = []
    try:
        for i, x in enumerate(xs):
            t0 = time.perf_counter()
            trainer.step(x, x)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        trainer.checkpoints.wait()
    finally:
        trainer.close(close_cluster=False)
    return times


def restore_times(cluster, run_dir, gpt, digests: bool, step: int) -> list[float]:
    """Wall seconds of 3 restores of `run_dir`'s newest step (`step`), verified if `digests`."""
    trainer = make_trainer(cluster, run_dir, gpt, digests)
    times = []
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            assert trainer.checkpoints.restore_latest()[0] == step
            times.append(time.perf_counter() - t0)
    finally:
        trainer.close(close_cluster=False)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import mpmd

    gpt, batch = gpt_small()
    tmp = Path(tempfile.mkdtemp(prefix="bench_digests_"))
    log_path = tmp / "workers.log"
    print(f"gpt_small {gpt} batch {batch}; load average {os.getloadavg()}; worker log {log_path}")
    steps = {name: [] for name in VARIANTS}
    restores = {name: [] for name in VARIANTS}
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, 256, (batch, gpt["seq_len"])).astype(np.int32) for _ in range(args.steps + 2)]
    with cpu_setup.stderr_to(log_path):
        cluster = mpmd.LocalCluster(num_workers=2, root=str(tmp))
        try:
            for r in range(args.rounds):
                order = list(VARIANTS)[r % 2 :] + list(VARIANTS)[: r % 2]
                for name in order:
                    steps[name] += train_steps(cluster, tmp / f"run{r}-{VARIANTS[name]}", gpt, VARIANTS[name], xs)
                for name in order:  # restores of one run directory (saved with digests), verified and not
                    restores[name] += restore_times(cluster, tmp / f"run{r}-True", gpt, VARIANTS[name], len(xs))
        finally:
            cluster.close()
    none_step, none_restore = statistics.median(steps["no digests"]), statistics.median(restores["no digests"])
    print(f"{'variant':<12} {'step ms':>9} {'x none':>7} {'restore ms':>11} {'x none':>7}")
    for name in VARIANTS:
        s, t = statistics.median(steps[name]), statistics.median(restores[name])
        print(f"{name:<12} {s * 1e3:>9.1f} {s / none_step:>7.3f} {t * 1e3:>11.1f} {t / none_restore:>7.3f}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
