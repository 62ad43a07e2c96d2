"""Expert parallelism: what moe_tiny's tokens/s costs against a dense Llama of the same active
parameters on the same slices, and how much of its step the expert-parallel all-to-all takes.

    .venv/bin/python benchmarks/bench_moe.py [--rounds N] [--block N] [--traced-steps N]

Every ratio is measured in this one run on this machine.

1. Tokens/s. configs/moe_tiny.yaml (2 of 4 blocks MoE, 4 experts, top-2, capacity 1.25) and
   configs/llama_tiny.yaml (the same dense blocks: as many active parameters, ~0.44 M), each
   1F1B on 2 slices of LocalCluster(num_workers=2, devices_per_worker=2), mesh expert=2 for
   both: the MoE's experts split over the two devices of a slice (model.moe.groups=2: each
   device's half of the microbatch routed on its own, sent to the experts' devices and back by
   all-to-all); for the dense model the expert axis is one more batch axis (data parallel),
   so both split every dense layer alike. Random byte tokens (train.batch_size x
   model.seq_len per step), the recipes' adamw. The two trainers run alternating blocks of
   steps, so load drift hits both alike; a step's time is the interval between consecutive
   returns of trainer.step within a block (the first of each block dropped).
2. All-to-all share. moe_tiny on the same mesh, InProcessCluster (its slices' 4 devices in
   this process), `--traced-steps` steps under jax.profiler: the summed duration of every
   XLA all-to-all op over the 4 devices / (4 x the steps' wall time). On XLA:CPU a collective's
   time includes waiting for its peer device to reach it, so this is an upper bound on what
   moving the tokens costs. Other collectives (all-gather, all-reduce, ...) are shown beside.

Workers are pinned one to a core with XLA's intra-op threads off; the load average is printed
at the start and the end: other processes on a 2-core machine inflate every figure here.
"""

from __future__ import annotations

import cpu_setup  # noqa: I001  (first: sets the flags before anything imports jax)

REPO = cpu_setup.before_jax(devices=4)

import argparse  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import timing  # noqa: E402

MESH = {"expert": 2}
RECIPES = {"llama_tiny": [], "moe_tiny": ["model.moe.groups=2"]}


def make_trainer(name: str, cluster):
    """(trainer, tokens per step, batches) of configs/<name>.yaml on `cluster` with MESH."""
    import numpy as np

    import mpmd
    from mpmd.recipes import config
    from mpmd.recipes.registry import get_model_spec
    from mpmd.recipes.run.build import build_optimizer

    cfg = config.load(
        str(REPO / "configs" / f"{name}.yaml"),
        RECIPES[name] + ["cluster.devices_per_worker=2", f"mesh.expert={MESH['expert']}"],
    )
    m, batch, seq = cfg.pipeline.num_microbatches, cfg.train.batch_size, cfg.model.seq_len
    model = get_model_spec(cfg.model.kind).build(cfg, False)
    pipe = mpmd.Pipeline(mpmd.split(model, 2, model.sample_input(batch // m)), mpmd.models.lm_loss)
    trainer = mpmd.Trainer(pipe, build_optimizer(cfg), schedule="1f1b", num_microbatches=m, mesh=MESH, cluster=cluster)
    rng = np.random.default_rng(0)
    batches = [
        (rng.integers(0, 256, (batch, seq)).astype(np.int32), rng.integers(0, 256, (batch, seq)).astype(np.int32))
        for _ in range(4)
    ]
    return trainer, batch * seq, batches


def alternate(runs: dict, num_rounds: int, block: int) -> dict:
    """Per run: step times (s) from alternating blocks of `block` steps, after 2 warm-up steps."""
    for trainer, _, batches in runs.values():
        for i in range(2):
            trainer.step(*batches[i])
    return timing.alternating_blocks(
        {
            name: (lambda i, t=trainer, b=batches: t.step(*b[i % len(b)]))
            for name, (trainer, _, batches) in runs.items()
        },
        num_rounds,
        block,
    )


def tokens_per_s(num_rounds: int, block: int) -> None:
    import mpmd

    # One cluster per trainer (a Trainer starts its cluster's slices afresh), both alive, so
    # that their blocks of steps alternate.
    clusters = {name: mpmd.LocalCluster(num_workers=2, devices_per_worker=2) for name in RECIPES}
    runs = {}
    try:
        t0 = time.perf_counter()
        runs = {name: make_trainer(name, cluster) for name, cluster in clusters.items()}
        times = alternate(runs, num_rounds, block)
        wall = time.perf_counter() - t0
    finally:
        for trainer, _, _ in runs.values():
            trainer.close(close_cluster=False)
        for cluster in clusters.values():
            cluster.close()
    print(
        f"\n1. tokens/s: 1f1b, 2 slices x 2 devices (mesh {MESH}), LocalCluster; {num_rounds} alternating "
        f"blocks of {block} steps (median over {num_rounds * (block - 1)} step intervals); {wall:.0f} s wall"
    )
    print(f"{'recipe':>11} {'ms/step':>9} {'p25..p75 ms':>15} {'tokens/s':>9} {'x llama_tiny':>13}")
    base = None
    for name, (_, tokens, _) in runs.items():
        med, q = statistics.median(times[name]), statistics.quantiles(times[name], n=4)
        rate = tokens / med
        base = base or rate
        print(
            f"{name:>11} {med * 1e3:>9.1f} {f'{q[0] * 1e3:.0f}..{q[2] * 1e3:.0f}':>15} {rate:>9,.0f} "
            f"{rate / base:>13.3f}"
        )


def collective_share(num_steps: int) -> None:
    import jax

    import mpmd

    trainer, _, batches = make_trainer("moe_tiny", mpmd.InProcessCluster())
    try:
        for i in range(2):
            trainer.step(*batches[i])
        out = tempfile.mkdtemp(prefix="bench_moe_trace_")
        with jax.profiler.trace(out, create_perfetto_trace=True):
            start = time.perf_counter()
            for i in range(num_steps):
                trainer.step(*batches[i % len(batches)])
            wall = time.perf_counter() - start
    finally:
        trainer.close()
    (path,) = glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"), recursive=True)
    trace = json.load(gzip.open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kinds = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
    us = {k: 0.0 for k in kinds}
    counts = {k: 0 for k in kinds}
    for e in events:
        if e.get("ph") != "X":
            continue
        kind = re.match(r"([a-z-]+?)(-start|-done)?(\.\d+)?$", e.get("name", ""))
        if kind and kind.group(1) in us:
            us[kind.group(1)] += e.get("dur", 0.0)
            counts[kind.group(1)] += 1
    device_s = 4 * wall
    print(
        f"\n2. collectives in moe_tiny's step: InProcessCluster, 2 slices x 2 devices (mesh {MESH}), "
        f"{num_steps} profiled steps, {wall / num_steps * 1e3:.0f} ms/step (profiler on)"
    )
    print(f"{'op':>19} {'ops':>6} {'ms (4 devices)':>15} {'share of device time':>21}")
    for k in kinds:
        print(f"{k:>19} {counts[k]:>6} {us[k] / 1e3:>15.1f} {us[k] / 1e6 / device_s:>20.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=6)
    parser.add_argument("--traced-steps", type=int, default=5)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    tokens_per_s(args.rounds, args.block)
    collective_share(args.traced_steps)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
