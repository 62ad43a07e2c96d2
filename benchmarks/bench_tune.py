"""mpmd.tune against measurement: its pick against the best of a grid measured for real, its
predictions against the measured steps of the candidates it confirmed, and its pick against
the recipe's defaults.

    .venv/bin/python benchmarks/bench_tune.py [--quick] [--workers 2] [--models gpt_small,unbalanced]

Models (batch 16 of random bytes, seq 64, adamw, no clipping):
- gpt_small: configs/gpt_small.yaml's GPT (d_model 256, 4 heads, 8 blocks) with seq_len 64
  and batch 16 instead of 128 and 32: a step of the full size takes seconds on this 2-core
  machine, and the grid trains ~20 configurations. Defaults: the config's interleaved-1f1b,
  4 stages (v = 2), m = 8, FLOP-balanced cuts (mpmd.split).
- unbalanced: recipes/examples/unbalanced.py (d_model 128, hidden 512, 6 blocks): its first
  layer costs ~4 blocks, its last ~2.2 (XLA FLOPs). Defaults: recipes/config.py's pipeline
  section (1f1b, one stage per worker, m = 4), FLOP-balanced cuts.

For each, on LocalCluster(num_workers=W) (real worker processes, each pinned to a core):
mpmd.tune profiles the layers at microbatch counts 2, 4, 8, searches and confirms its 3
best; then every schedule x m in {2, 4, 8} (interleaved with v = 2), at the tuner's cut
points, and the defaults, are trained on the same workers for two warm-up and 5 timed steps
each (mpmd.tune.run_candidate, the tuner's own measurement), in two rounds of opposite
order whose mean is the figure (a load drifting linearly weighs on all alike). Printed: the
grid (predicted, measured), the pick's measured step over the grid's best (goal <= 1.05),
the mean |predicted - measured| / measured over the confirmed candidates against the
tuner's own confirm measurement and against the grid's (goal <= 0.10), and the defaults'
measured step over the pick's.

This machine has 2 cores shared with other work; the load average is printed at the start
and the end, and a profile taken under one load predicts steps measured under another.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BATCH, SEQ, COUNTS = 16, 64, (2, 4, 8)
STEPS = 5  # timed steps per candidate, after two warm-up steps (mpmd.tune's default)


def build(name: str):
    """(layers, default pipeline (schedule, num_stages per worker, v, m))."""
    from flax import nnx

    from mpmd import models

    if name == "gpt_small":
        model = models.GPT(256, 256, 4, 8, SEQ, 4, rngs=nnx.Rngs(0))
        return model.layers(), ("interleaved-1f1b", 2, 2, 8)
    from mpmd.recipes.examples.unbalanced import Unbalanced

    return Unbalanced(256, 128, 512, 6, nnx.Rngs(0)).layers(), ("1f1b", 1, 1, 4)


def main(quick: bool, num_workers: int, names: list[str]) -> None:
    import numpy as np
    import optax

    from mpmd import models
    import mpmd
    from mpmd.stages.split import balanced_boundaries
    from mpmd.stages.costs import layer_costs
    from mpmd.tuner.core import mean_abs_error, run_candidate
    from mpmd.tuner.search import Candidate, search

    start = time.perf_counter()
    print(
        f"bench_tune{' --quick' if quick else ''}: {os.cpu_count()} cores, {num_workers} workers, "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (BATCH, SEQ)).astype(np.int32)
    y = rng.integers(0, 256, (BATCH, SEQ)).astype(np.int32)
    optimizer = optax.adamw(1e-3)
    counts = (4,) if quick else COUNTS
    summary = []
    for name in names:
        layers, (default_schedule, default_v, _, default_m) = build(name)
        print(f"\n== {name}: {len(layers)} layers, batch {BATCH} x seq {SEQ}")
        cluster = mpmd.LocalCluster(num_workers=num_workers)
        try:
            t0 = time.perf_counter()
            result = mpmd.tune(
                layers,
                models.lm_loss,
                optimizer,
                x,
                y,
                cluster,
                num_workers,
                microbatch_counts=list(counts),
                confirm=3,
                confirm_steps=STEPS,
            )
            tune_s = time.perf_counter() - t0
            print(result.table())
            everything, _ = search(result.profile, num_workers, BATCH, microbatch_counts=list(counts), keep=None)
            grid = [c for c in everything if c.virtual_stages <= 2]
            S = default_v * num_workers
            flops, _ = layer_costs(layers, x[: BATCH // default_m])
            cuts = tuple(balanced_boundaries(flops, S)[1:-1])
            default = next(
                (
                    c
                    for c in everything
                    if (c.schedule, c.num_stages, c.num_microbatches, c.cuts) == (default_schedule, S, default_m, cuts)
                ),
                None,
            )
            if default is None:  # FLOP-balanced cuts the tuner did not consider: not predicted
                default = Candidate(default_schedule, S, default_v, default_m, cuts, float("nan"), ())
            # Rounds in opposite orders, averaged: a load that drifts linearly over the run
            # weighs on every candidate alike.
            order = grid + ([] if default in grid else [default])
            runs: dict = {c: [] for c in order}
            for i in range(1 if quick else 2):
                for c in order if i % 2 == 0 else order[::-1]:
                    runs[c].append(
                        run_candidate(
                            c, layers, models.lm_loss, optimizer, x, y, cluster, STEPS, log=lambda _: None
                        ).measured_step_s
                    )
            measured = {c: float(np.mean(times)) for c, times in runs.items()}
            default_s = measured[default]
        finally:
            cluster.close()
        print(f"\n{'grid candidate (mean of rounds)':<52} {'pred ms':>8} {'meas ms':>8}   rounds, ms")
        for c in sorted(grid, key=lambda c: measured[c]):
            print(
                f"{c.label:<52} {c.predicted_step_s * 1e3:>8.1f} {measured[c] * 1e3:>8.1f}   "
                + " ".join(f"{t * 1e3:.0f}" for t in runs[c])
            )
        best_grid = min(grid, key=lambda c: measured[c])
        pick = result.best
        pick_s = (
            measured[pick]
            if pick in measured
            else next(c.measured_step_s for c in result.confirmed if c.candidate == pick)
        )
        err = mean_abs_error(result.confirmed)
        err_grid = float(
            np.mean(
                [
                    abs(c.candidate.predicted_step_s - measured[c.candidate]) / measured[c.candidate]
                    for c in result.confirmed
                    if c.candidate in measured
                ]
            )
        )
        print(
            f"tuner: profile + search + confirm {tune_s:.0f} s (search {result.search_s:.2f} s); "
            f"transfer {result.profile.latency_s * 1e3:.2f} ms + {result.profile.bytes_per_s / 1e6:.0f} MB/s"
        )
        print(
            f"pick {pick.label}: {pick_s * 1e3:.1f} ms; grid best {best_grid.label}: "
            f"{measured[best_grid] * 1e3:.1f} ms; pick / best = {pick_s / measured[best_grid]:.3f} (goal <= 1.05)"
        )
        print(
            f"mean |pred - meas| / meas over confirmed: {err:.3f} against the tuner's own measurement, "
            f"{err_grid:.3f} against the grid's (goal <= 0.10)"
        )
        print(f"defaults {default.label}: {default_s * 1e3:.1f} ms; defaults / pick = {default_s / pick_s:.3f}")
        summary.append((name, pick_s / measured[best_grid], err, err_grid, default_s / pick_s))
    print(f"\n{'model':<10} {'pick/best':>10} {'err (confirm)':>14} {'err (grid)':>11} {'defaults/pick':>14}")
    for name, ratio, err, err_grid, vs in summary:
        print(f"{name:<10} {ratio:>10.3f} {err:>14.3f} {err_grid:>11.3f} {vs:>14.3f}")
    print(f"total {time.perf_counter() - start:.0f} s, load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m = 4 only, one round: a smoke run, not a measurement")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--models", default="gpt_small,unbalanced")
    args = parser.parse_args()
    main(args.quick, args.workers, args.models.split(","))
