"""Reinforcement learning across slice groups, measured side by side in one run.

    .venv/bin/python benchmarks/bench_rl.py [--rounds 7] [--d-model 256] [--layers 8]

Weight sync (mpmd/rl/sync.py): a GPT pipelined in 2 stages on a learner group of 2 worker
processes sends its parameters, stage slice by stage slice, to a sampler group of one more
worker (all on this host, over the data plane: shared memory where it can, else gRPC). Per
round, in alternating order: one sync, timed from the call until the sampler's slice holds
the copy (Groups.wait), and one memcpy of the same bytes on this process (numpy copyto into
buffers allocated beforehand): the floor of moving those bytes once on one host. Medians and
spreads over the rounds; GB/s = parameter bytes / seconds.

Sampler: the same GPT's batched sampler (mpmd/rl/sampler.py) on the sampler's slice, from the
synced weights: --prompts prompts x --samples samples x --new tokens per call (no end token:
every row runs to the end), timed until the samples are on the controller; tokens/s = rows x
new tokens / seconds.

GRPO step (mpmd/rl/loop.py): sequential (off_policy_steps=0: sync, sample, train, one after
another) against overlapped (1: the next step's sampling runs on the sampler's slice while
this step trains on the learner's), in blocks of --block steps that alternate between the two
on one GRPO, the first step of each block not counted. Medians per step and their ratio.
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


def grpo(args) -> None:
    import numpy as np
    import optax
    from flax import nnx

    import mpmd
    from mpmd import models
    from mpmd.groups.client import Groups
    from mpmd.rl.loop import GRPO, padded

    root = tempfile.mkdtemp(prefix="bench_rl_")
    groups = Groups(mpmd.LocalCluster(3, root=root), {"learner": [{}, {}], "sampler": {}}, root=root)
    seq_len = args.prompt_len + args.new
    model = models.GPT(256, args.d_model, 4, args.layers, seq_len, rngs=nnx.Rngs(0))
    rl = GRPO(
        groups,
        model,
        optax.sgd(1e-3, momentum=0.9),
        reward=lambda p, c: float(len(set(c))),
        num_stages=2,
        num_samples=args.samples,
        max_new_tokens=args.new,
        prompt_len=args.prompt_len,
        schedule="1f1b",
        num_microbatches=4,
    )
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, args.prompt_len))) for _ in range(args.prompts * 64)]
    batch = lambda s: (
        [prompts[(s * args.prompts + i) % len(prompts)] for i in range(args.prompts)],
        [(s * args.prompts + i) % len(prompts) for i in range(args.prompts)],
    )
    try:
        rl.step(*batch(0))  # compiles the sampler and the learner's programs
        rl.sync()
        tokens, lens = padded(batch(0)[0], args.prompt_len)
        sample_s = []
        for r in range(args.rounds):
            t = time.perf_counter()
            h = rl.sampler(rl.sync.copies, tokens, lens, batch(0)[1], np.zeros(2, np.uint32))
            groups.fetch(h)
            sample_s.append(time.perf_counter() - t)
            groups.delete(h)
        times: dict[str, list[float]] = {"sequential": [], "overlapped": []}
        step = 1
        for r in range(args.rounds):
            for mode in ("sequential", "overlapped") if r % 2 == 0 else ("overlapped", "sequential"):
                rl.off_policy_steps = 1 if mode == "overlapped" else 0
                for i in range(args.block):
                    t = time.perf_counter()
                    last = i == args.block - 1
                    rl.step(*batch(step), *(batch(step + 1) if not last else (None, None)))
                    if i:
                        times[mode].append(time.perf_counter() - t)
                    step += 1
    finally:
        rl.close()
        groups.close()
    rows = args.prompts * args.samples
    med = statistics.median(sample_s)
    print(
        f"sampler: {args.prompts} prompts x {args.samples} samples x {args.new} new tokens, d_model {args.d_model}, "
        f"{args.layers} layers, 1 device"
    )
    print(f"  call    {spread(sample_s)}   {rows * args.new / med:.0f} tokens/s")
    seq, ovl = statistics.median(times["sequential"]), statistics.median(times["overlapped"])
    print(f"GRPO step, {args.rounds} rounds of {args.block} steps per mode (first of each block not counted):")
    print(f"  sequential  {spread(times['sequential'])}")
    print(f"  overlapped  {spread(times['overlapped'])}")
    print(f"  overlapped / sequential: {ovl / seq:.2f}x")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--part", choices=["all", "sync", "grpo"], default="all")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.part in ("all", "sync"):
        weight_sync(args)
    if args.part in ("all", "grpo"):
        grpo(args)


if __name__ == "__main__":
    main()
