"""Run-ahead dispatch: gpt_tiny training steps with step N+1 sent while step N runs (depth 1)
against one step at a time (depth 0), side by side in one run.

    .venv/bin/python benchmarks/bench_run_ahead.py [--quick] [--backend local|inprocess]

a. Model and data: configs/gpt_tiny.yaml as `mpmd train` builds it (byte GPT, d_model 64, 4
layers, seq 64, batch 16, 2 stages, 1F1B, 4 microbatches, adamw), on LocalCluster with 2
workers (real processes, gRPC, transfers) unless --backend inprocess. One Trainer serves
both depths: rounds of ROUND_STEPS steps alternate depth 0 and depth 1 (order swapped each
round), so load on this 2-core machine hits both alike. A round's step time = its wall
time / its steps, for the loop `mpmd train` runs: next batch from the loader, submit, and
collect the oldest step's metrics once `depth` steps are in flight beyond it. Reported:
median step time per depth over rounds, and the ratio depth 0 / depth 1 (goal >= 1.10:
depth 1 at least 10 % faster). The first round of each depth is a warm-up (compiles) and
not counted.

Where the gain comes from: at depth 0 a worker idles from the end of its step until the
controller has collected every slice's reply and sent the next Run; at depth 1 that Run is
already queued on the worker. On this 2-core machine that idle time is not free: each
worker is pinned to one core and the controller's own work (collecting replies, sending
the next step) runs on those same cores, so at depth 1 it competes with the workers'
compute instead of filling their gap. Part b separates the two:

b. The same steps as sleep programs (mpmd/lowering/dryrun.py: real plans, transfers, control plane;
   each task sleeps its duration, using no CPU): per stage, the median F and full-backward
   times measured in traced gpt_tiny steps of part a, the activation's bytes, same
   schedule; rounds alternate depth 0 and 1 the same way. This is the runtime's gap
   between steps without the competition for the cores. The load average is printed at
   the start and the end.
"""

from __future__ import annotations

import os

import cpu_setup  # noqa: E402  (first: sets the flags before anything imports jax)

REPO = cpu_setup.before_jax(devices=2)

import argparse  # noqa: E402
import collections  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


ROUND_STEPS = 20
DEPTHS = (0, 1)


def build(backend: str, run_dir: str):
    """The Trainer and training loader `mpmd train configs/gpt_tiny.yaml` would build."""
    import mpmd
    from mpmd.recipes import config
    from mpmd.recipes.data import loaders as data
    from mpmd.recipes.run import build

    cfg = config.load(
        REPO / "configs/gpt_tiny.yaml", [f"cluster.backend={backend}", f"run_dir={run_dir}", "checkpoint.every=0"]
    )
    loader, _ = data.make_loaders(cfg)
    p = cfg.pipeline
    sample = loader.batch_at(0)[0][: cfg.train.batch_size // p.num_microbatches]
    stages, loss_fn = build.build_model(cfg, sample)
    trainer = mpmd.Trainer(
        mpmd.Pipeline(stages, loss_fn, sample_input=sample),
        build.build_optimizer(cfg),
        schedule=p.schedule,
        num_microbatches=p.num_microbatches,
        cluster=build.build_cluster(cfg),
        max_grad_norm=cfg.optimizer.max_grad_norm,
        run_ahead=max(DEPTHS),
    )
    return trainer, loader


def round_step_s(trainer, loader, depth: int, steps: int) -> float:
    """Wall time per step of `steps` steps sent `depth` ahead of the oldest, all collected."""
    pending = collections.deque()
    t0 = time.perf_counter()
    for _ in range(steps):
        inputs, targets = loader.next()
        pending.append(trainer.submit(inputs, targets))
        if len(pending) > depth:
            pending.popleft().result()
    for p in pending:
        p.result()
    return (time.perf_counter() - t0) / steps


def task_costs(trainer, loader, steps: int = 5) -> list[dict]:
    """Per stage, the median seconds of its forward and full backward in traced steps."""
    import re

    durations: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
    for _ in range(steps):
        for events in trainer.step(*loader.next(), trace=True)["events"]:
            for e in events:
                match = re.fullmatch(r"([FB]) s(\d+) mb\d+", e.name)
                if e.kind == "run" and match:
                    durations[int(match[2]), match[1]].append((e.end_ns - e.start_ns) / 1e9)
    stages = sorted({k for k, _ in durations})
    return [
        {"F": statistics.median(durations[k, "F"]), "B": statistics.median(durations[k, "B"]), "W": 0.0} for k in stages
    ]


def activation_bytes(trainer, loader) -> int:
    import jax

    inputs, _ = loader.next()
    micro = jax.ShapeDtypeStruct((len(inputs) // trainer.num_microbatches,) + inputs.shape[1:], inputs.dtype)
    return max(
        sum(l.size * l.dtype.itemsize for l in jax.tree.leaves(a))
        for a in trainer.pipeline.activation_specs(micro)[1:-1]
    )


def alternate(rounds: int, measure) -> dict[int, list[float]]:
    """Per depth, `measure(depth)` of every round after a warm-up one; order swapped each round."""
    times: dict[int, list[float]] = {d: [] for d in DEPTHS}
    for r in range(rounds + 1):
        for depth in DEPTHS if r % 2 == 0 else DEPTHS[::-1]:
            s = measure(depth)
            if r:
                times[depth].append(s)
    return times


def report(title: str, times: dict[int, list[float]]) -> None:
    med = {d: statistics.median(ts) for d, ts in times.items()}
    print(f"\n{title}")
    print(f"{'run_ahead':>9}  {'median step ms':>14}  {'rounds (ms)':<40}")
    for d in DEPTHS:
        print(f"{d:>9}  {med[d] * 1e3:>14.1f}  {' '.join(f'{t * 1e3:.1f}' for t in times[d]):<40}")
    print(f"step time depth 0 / depth 1: {med[0] / med[1]:.3f} (goal >= 1.10)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds per depth instead of 7")
    ap.add_argument("--backend", choices=("local", "inprocess"), default="local")
    args = ap.parse_args()
    rounds = 3 if args.quick else 7
    print(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as run_dir:
        trainer, loader = build(args.backend, run_dir)
        try:
            times = alternate(rounds, lambda depth: round_step_s(trainer, loader, depth, ROUND_STEPS))
            costs, act_bytes = task_costs(trainer, loader), activation_bytes(trainer, loader)
            schedule = trainer.schedule
        finally:
            trainer.close()
    report(
        f"a. gpt_tiny on {args.backend} (2 slices, {schedule.name}, m={schedule.num_microbatches}), "
        f"{rounds} rounds x {ROUND_STEPS} steps per depth",
        times,
    )
    sleeps = dry_run_times(schedule, costs, act_bytes, rounds)
    report(
        f"b. the same steps as sleep programs on local workers (per stage F, B ms: "
        f"{[(round(c['F'] * 1e3, 2), round(c['B'] * 1e3, 2)) for c in costs]}; "
        f"activations {act_bytes} B), {rounds} rounds x {ROUND_STEPS} steps per depth",
        sleeps,
    )
    print(f"\nload average at end: {os.getloadavg()}")


def dry_run_times(schedule, costs, act_bytes: int, rounds: int) -> dict[int, list[float]]:
    import mpmd
    from mpmd.lowering.dryrun import dry_run

    cluster = mpmd.LocalCluster(num_workers=schedule.num_slices)
    try:
        return alternate(
            rounds,
            lambda depth: statistics.median(
                dry_run(schedule, costs, act_bytes, cluster, steps=ROUND_STEPS, trace=False, run_ahead=depth).step_s
            ),
        )
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
