"""Restoring a checkpoint onto another layout against restoring it onto the layout that saved it.

    .venv/bin/python benchmarks/bench_layout_restore.py [--model tiny|small] [--rounds N]

A GPT (gpt_tiny's or gpt_small's shape, adamw, 4 microbatches) is trained one step on 2
stages, 1F1B, and checkpointed (leaves keyed by parameter path, each slice writing its own
directory). Then, on one LocalCluster of 4 real worker processes, a Trainer of each layout
below restores that step: the same layout, 4 stages on 4 slices, ZB-H1, and 4 stages
interleaved on 2 slices (v=2). Timed: `trainer.checkpoints.restore_latest()` (every slice
stages the leaves its stages need from whichever directories hold them, then all switch),
3 times per Trainer; layouts rotate order each round; medians over rounds. The ratio is to
the same-layout restore, measured side by side in this run.

Workers' stderr (Orbax's INFO lines) goes to a log file (path printed). The load average is
printed at the start and end: on a 2-core machine other processes inflate every figure.
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

MODELS = {  # gpt_tiny's and gpt_small's shapes (configs/)
    "tiny": (dict(vocab_size=256, d_model=64, num_heads=2, num_layers=4, seq_len=64), 16),
    "small": (dict(vocab_size=256, d_model=256, num_heads=4, num_layers=8, seq_len=128), 32),
}
LAYOUTS = {
    "same (2 stages, 1f1b)": (2, "1f1b", 1),
    "4 stages on 4 slices": (4, "1f1b", 1),
    "2 stages, zb-h1": (2, "zb-h1", 1),
    "4 stages interleaved, v=2": (4, "interleaved-1f1b", 2),
}


def make_trainer(cluster, run_dir, gpt, layout):
    from mpmd import models
    import mpmd
    import optax
    from flax import nnx

    num_stages, schedule, virtual = layout
    pipe = mpmd.Pipeline(mpmd.split(models.GPT(**gpt, rngs=nnx.Rngs(0)), num_stages=num_stages), models.lm_loss)
    return mpmd.Trainer(
        pipe,
        optax.adamw(3e-4),
        schedule=schedule,
        num_microbatches=4,
        virtual_stages=virtual,
        cluster=cluster,
        run_dir=str(run_dir),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import mpmd

    gpt, batch = MODELS[args.model]
    tmp = Path(tempfile.mkdtemp(prefix="bench_layout_"))
    log_path = tmp / "workers.log"
    print(f"model {args.model} {gpt} batch {batch}; load average {os.getloadavg()}; worker log {log_path}")
    run_dir = tmp / "run"
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with cpu_setup.stderr_to(log_path):
        cluster = mpmd.LocalCluster(num_workers=4, root=str(tmp))
        try:
            x = np.random.default_rng(0).integers(0, gpt["vocab_size"], (batch, gpt["seq_len"])).astype(np.int32)
            trainer = make_trainer(cluster, run_dir, gpt, LAYOUTS["same (2 stages, 1f1b)"])
            trainer.step(x, x)
            trainer.save(wait=True)
            trainer.close(close_cluster=False)
            names = list(LAYOUTS)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    trainer = make_trainer(cluster, run_dir, gpt, LAYOUTS[name])
                    try:
                        assert trainer.resumed is not None and trainer.resumed[0] == 1
                        for _ in range(3):
                            t0 = time.perf_counter()
                            assert trainer.checkpoints.restore_latest()[0] == 1
                            times[name].append(time.perf_counter() - t0)
                    finally:
                        trainer.close(close_cluster=False)
        finally:
            cluster.close()
    same = statistics.median(times["same (2 stages, 1f1b)"])
    print(f"{'restore onto':<28} {'median s':>9} {'vs same layout':>15}")
    for name, ts in times.items():
        print(f"{name:<28} {statistics.median(ts):>9.3f} {statistics.median(ts) / same:>14.2f}x")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
