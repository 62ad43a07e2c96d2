"""Reinforcement learning across slice groups, measured side by side in one run.

    .venv/bin/python benchmarks/bench_rl.py [--rounds 7] [--d-model 256] [--layers 8]

Weight sync (mpmd/rl/sync.py): a GPT pipelined in 2 stages on a learner group of 2 worker
processes sends its parameters, stage slice by stage slice, to a sampler group of one more
worker (all on this host, over the data plane: shared memory where it can, else gRPC). Per
round, in alternating order: one sync, timed from the call until the sampler's slice holds
the copy (Groups.wait), and one memcpy of the same bytes on this process (numpy copyto into
buffers allocated beforehand): the floor of moving those bytes once on one host. Medians and
spreads over the rounds; GB/s = parameter bytes / seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spread(xs) -> str:
    return f"{statistics.median(xs):.4f} s (min {min(xs):.4f}, max {max(xs):.4f})"


def weight_sync(args) -> None:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import mpmd
    from mpmd import models
    from mpmd.groups.client import Groups
    from mpmd.rl.sync import WeightSync

    root = tempfile.mkdtemp(prefix="bench_rl_")
    groups = Groups(mpmd.LocalCluster(3, root=root), {"learner": [{}, {}], "sampler": {}}, root=root)
    try:
        model = models.GPT(256, args.d_model, 4, args.layers, 64, rngs=nnx.Rngs(0))
        pipe = mpmd.Pipeline(mpmd.split(model, num_stages=2), models.lm_loss)
        trainer = mpmd.Trainer(
            pipe, optax.sgd(0.1), schedule="1f1b", num_microbatches=2, cluster=groups.cluster_for("learner")
        )
        x = np.zeros((4, 64), np.int32)
        trainer.step(x, x)
        sync = WeightSync(trainer, groups, "learner", "sampler")
        sync()
        groups.wait()  # the first sync sets up the transfers between the slices
        sources = [np.asarray(leaf) for tree in trainer.params() for leaf in jax.tree.leaves(tree)]
        targets = [np.empty_like(a) for a in sources]
        num_bytes = sync.num_bytes
        assert num_bytes == sum(a.nbytes for a in sources)
        times: dict[str, list[float]] = {"sync": [], "memcpy": []}
        for r in range(args.rounds):
            for case in ("sync", "memcpy") if r % 2 == 0 else ("memcpy", "sync"):
                t = time.perf_counter()
                if case == "sync":
                    sync()
                    groups.wait()
                else:
                    for src, dst in zip(sources, targets):
                        np.copyto(dst, src)
                times[case].append(time.perf_counter() - t)
        trainer.close(close_cluster=False)
    finally:
        groups.close()
    s, m = statistics.median(times["sync"]), statistics.median(times["memcpy"])
    print(
        f"weight sync: {num_bytes / 1e6:.1f} MB of parameters, 2 learner slices -> 1 sampler slice, {args.rounds} rounds"
    )
    print(f"  sync    {spread(times['sync'])}   {num_bytes / s / 1e9:.2f} GB/s")
    print(f"  memcpy  {spread(times['memcpy'])}   {num_bytes / m / 1e9:.2f} GB/s")
    print(f"  sync / memcpy: {s / m:.1f}x")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    weight_sync(args)


if __name__ == "__main__":
    main()
