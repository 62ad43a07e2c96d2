"""Goodput under repeated worker loss: replace, shrink (with capacity coming back) and shrink
without capacity, against a fault-free run, measured side by side in one run.

    .venv/bin/python benchmarks/bench_elastic.py [--steps 60] [--kill-every 20] [--model tiny|small]

Model: gpt_tiny's shape (vocab 256, d_model 64, 2 heads, 4 layers, seq 64, batch 16; --model
small: gpt_small's) in 4 stages on LocalCluster(num_workers=4) (real processes, gRPC, Orbax),
1F1B, 4 microbatches, adamw, a persistent checkpoint every 5 steps. A worker other than
slice 0's is SIGKILLed (by pid) just before every `--kill-every`-th step. Policies:
  fault-free   no kill
  replace      on_loss=replace: a new worker each time (the same 4-slice layout restores)
  shrink       on_loss=shrink, unlimited workers: on at once on 3 slices, back to 4 at the
               next checkpoint boundary
  no-capacity  on_loss=auto, replace_timeout_s=0, max_workers=4: no worker ever comes, so
               each loss leaves one slice fewer until the end
Goodput = steps / wall time, relative to the fault-free run's. The lost time comes from
trainer.goodput() (aborted: the failed attempts until the loss was declared; replace;
relayout, with the first step after a grow back; restore; replayed steps) plus the time run
on fewer slices. "restore" per
recovery, same layout (replace) against a layout change (shrink), is printed too. Each
policy runs `--rounds` times in rotation; medians. On a 2-core machine other processes
inflate every figure, and 4 workers on 2 cores make a narrower layout look cheaper than on
real parallel hardware (the simulator's predicted slowdown is printed for comparison).

    .venv/bin/python benchmarks/bench_elastic.py --backend ray [--steps 240] [--kill-every 80]

--backend ray: gpt_tiny's shape in 3 stages on a RayCluster of 3 slices, one worker actor per
1-CPU Ray node, on a multi-node Ray cluster of this machine's own for each policy (a 0-CPU
head and `ray start --block` nodes, tests/support/ray_nodes.py). Just before every
`--kill-every`-th step the node of a slice other than 0's (its whole process group: raylet
and actor) is SIGKILLed, as a machine is lost. Policies:
  fault-free   3 nodes, no kill
  with-spare   on_loss=replace, one spare node per kill: each loss is replaced on a spare
  no-spare     on_loss=auto, replace_timeout_s=3, 3 nodes: no node to replace it on, so the
               run shrinks; once it runs narrower a node joins (started in the background
               while training goes on), and the run grows back onto it at a checkpoint
               boundary once Ray has placed and started the replacement asked for
"""

from __future__ import annotations

import os

import cpu_setup  # noqa: E402  (first: sets the flags before anything imports jax)

cpu_setup.before_jax()

import argparse  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.bench_recovery import MODELS, workers_log_to  # noqa: E402  (gpt_tiny's and gpt_small's shapes)
from mpmd.runtime.launchers.workers import process_alive  # noqa: E402
from mpmd.train.relayout import LOST_CAUSES as LOST  # noqa: E402  (the causes of goodput()["lost_s"])

STAGES, M, EVERY = 4, 4, 5
POLICIES = {  # name -> (mpmd.Recovery arguments, LocalCluster arguments, kills?)
    "fault-free": ({}, {}, False),
    "replace": ({"on_loss": "replace"}, {}, True),
    "shrink": ({"on_loss": "shrink"}, {}, True),
    "no-capacity": ({"on_loss": "auto", "replace_timeout_s": 0}, {"max_workers": STAGES}, True),
}


RAY_SLICES = 3
RAY_POLICIES = {  # name -> (mpmd.Recovery arguments, spare nodes per kill, a node joins after each loss?)
    "fault-free": ({}, 0, False),
    "with-spare": ({"on_loss": "replace", "replace_timeout_s": 60}, 1, False),
    "no-spare": ({"on_loss": "auto", "replace_timeout_s": 3}, 0, True),
}


def make_trainer(cluster, run_dir: Path, gpt: dict, num_stages: int, steps: int, kill_every: int, recovery_kw: dict):
    from mpmd import models
    import mpmd
    import optax
    from flax import nnx

    pipe = mpmd.Pipeline(mpmd.split(models.GPT(**gpt, rngs=nnx.Rngs(0)), num_stages=num_stages), models.lm_loss)
    return mpmd.Trainer(
        pipe,
        optax.adamw(3e-4),
        schedule="1f1b",
        num_microbatches=M,
        cluster=cluster,
        run_dir=run_dir,
        checkpoint=mpmd.Checkpointing(every=EVERY),
        recovery=mpmd.Recovery(max_restarts=steps // kill_every + 1, **recovery_kw),
    )


def train(trainer, gpt: dict, batch: int, steps: int, kill_every: int, kill=None, after_step=None) -> dict:
    """Steps 1..steps-1 timed (step 0 compiles first, as a warm run); `kill(i, trainer)` just
    before every kill_every-th step i, once each, the checkpoint in flight committed;
    `after_step(i, trainer)` after each step done. The goodput record of the run."""
    import mpmd

    rng = np.random.default_rng(0)
    data = [rng.integers(0, gpt["vocab_size"], (batch, gpt["seq_len"])).astype(np.int32) for _ in range(steps)]
    restores, slowdowns, killed = [], [], set()
    trainer.step(data[0], data[0])
    i, t0 = 1, time.perf_counter()
    while i < steps:
        if kill is not None and i > 0 and i % kill_every == 0 and i not in killed:
            killed.add(i)
            trainer.checkpoints.wait()
            kill(i, trainer)
        try:
            trainer.step(data[i], data[i], data_state={"i": i + 1})
            if after_step is not None:
                after_step(i, trainer)
            i += 1
        except mpmd.Rewound as e:
            restores.append(trainer.recovery_s["restore_s"])
            if trainer.recovery_s["layout"] is not None:
                slowdowns.append(trainer.recovery_s["layout"]["predicted_slowdown"])
            i = e.data_state["i"] if e.data_state else 0
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "steps": steps - 1,
        **trainer.goodput(),
        "restores": restores,
        "slowdowns": slowdowns,
        "final_slices": trainer.num_slices,
    }


def run(policy: str, run_dir: Path, gpt: dict, batch: int, steps: int, kill_every: int) -> dict:
    import mpmd

    recovery_kw, cluster_kw, kills = POLICIES[policy]
    cluster = mpmd.LocalCluster(num_workers=STAGES, **cluster_kw)
    trainer = make_trainer(cluster, run_dir, gpt, STAGES, steps, kill_every, recovery_kw)

    def kill(i, trainer):
        alive = [p for p in cluster.pids[1:] if process_alive(p)]
        if alive and trainer.num_slices > 1:
            os.kill(alive[0], signal.SIGKILL)

    try:
        return train(trainer, gpt, batch, steps, kill_every, kill if kills else None)
    finally:
        trainer.close()


def run_ray(policy: str, run_dir: Path, gpt: dict, batch: int, steps: int, kill_every: int) -> dict:
    """One policy on a Ray cluster of its own (RayNodes: closed, every node's process group
    killed, at the end)."""
    import mpmd
    from tests.support.ray_nodes import RayNodes
    from tests.support.processes import wait_gone

    recovery_kw, spares_per_kill, rejoin = RAY_POLICIES[policy]
    num_kills = len(range(kill_every, steps, kill_every)) if policy != "fault-free" else 0
    run_dir.mkdir(parents=True)
    nodes = RayNodes(RAY_SLICES + spares_per_kill * num_kills)
    losses, joins = [], []  # the nodes killed; the threads adding one node each

    def kill(i, trainer):
        on = [(p, n) for p, n in ((p, nodes.node_of(p)) for p in trainer.cluster.pids[1:]) if n is not None]
        if on and trainer.num_slices > 1:
            worker, node = on[0]
            nodes.kill(node)
            # The actor (a session of its own) exits once it sees its raylet gone, a moment
            # later: gone before the next step, as a lost machine's processes are.
            if wait_gone([worker]):
                raise RuntimeError(f"the worker {worker} outlived its node {node}")
            losses.append(node)

    def after_step(i, trainer):
        # A node joins once the run went on narrower, one per node lost (ray start takes
        # seconds: in the background, as a machine coming back while the run goes on).
        if rejoin and trainer.num_slices < RAY_SLICES and len(joins) < len(losses):
            joins.append(threading.Thread(target=nodes.add, args=(1,), daemon=True))
            joins[-1].start()

    try:
        cluster = mpmd.RayCluster(
            num_workers=RAY_SLICES,
            address=nodes.address,
            failure_timeout_s=2.0,
            root=str(run_dir),
            log_dir=str(run_dir / "logs"),
        )
        trainer = make_trainer(cluster, run_dir, gpt, RAY_SLICES, steps, kill_every, recovery_kw)
        try:
            result = train(trainer, gpt, batch, steps, kill_every, kill if policy != "fault-free" else None, after_step)
        finally:
            trainer.close()
        return {**result, "nodes_at_end": len(nodes.alive()) - 1}
    finally:
        for t in joins:  # a node still joining asks Ray through this process's connection
            t.join()
        nodes.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="LocalCluster workers, or worker actors on Ray nodes of this machine",
    )
    parser.add_argument("--steps", type=int, help="default 60 (local), 240 (ray)")
    parser.add_argument("--kill-every", type=int, help="default 20 (local), 80 (ray)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    args = parser.parse_args()
    ray_backend = args.backend == "ray"
    args.steps = args.steps if args.steps is not None else (240 if ray_backend else 60)
    args.kill_every = args.kill_every if args.kill_every is not None else (80 if ray_backend else 20)
    policies, runner, stages = (RAY_POLICIES, run_ray, RAY_SLICES) if ray_backend else (POLICIES, run, STAGES)
    if args.steps < 2 or args.kill_every < 1 or args.rounds < 1:
        parser.error("--steps must be >= 2, --kill-every and --rounds >= 1")
    gpt, batch = MODELS[args.model]
    results: dict[str, list[dict]] = {p: [] for p in policies}
    with tempfile.TemporaryDirectory(prefix="bench_elastic_") as tmp:
        print(
            f"bench_elastic: {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}; "
            f"{args.backend}; model {args.model} {gpt}, batch {batch}, {stages} stages, {args.steps} steps, a kill every "
            f"{args.kill_every}, checkpoint every {EVERY}; worker logs: {workers_log_to(tmp, 'bench_elastic')}",
            flush=True,
        )
        names = list(policies)
        for r in range(args.rounds):
            for policy in names[r % len(names) :] + names[: r % len(names)]:
                results[policy].append(
                    runner(policy, Path(tmp) / f"{policy}_{r}", gpt, batch, args.steps, args.kill_every)
                )
    med = lambda policy, key: statistics.median(x[key] for x in results[policy])
    base = med("fault-free", "steps") / med("fault-free", "wall_s")
    print(
        f"\n{'policy':<12} {'wall s':>7} {'goodput':>8} {'lost s':>7} "
        + " ".join(f"{k[:-2]:>9}" for k in LOST)
        + f" {'narrow s':>8} {'failures':>8} {'layouts':>7} {'slices at end':>13}"
    )
    for policy in policies:
        goodput = med(policy, "steps") / med(policy, "wall_s") / base
        print(
            f"{policy:<12} {med(policy, 'wall_s'):7.1f} {goodput:8.2f} {med(policy, 'lost_s'):7.2f} "
            + " ".join(f"{med(policy, k):9.2f}" for k in LOST)
            + f" {med(policy, 'reduced_width_s'):8.1f} {med(policy, 'failures'):8.0f}"
            f" {med(policy, 'layout_changes'):7.0f} {med(policy, 'final_slices'):13.0f}"
        )
    for policy in list(policies)[1:]:
        restores = [s for x in results[policy] for s in x["restores"]]
        slowdowns = [s for x in results[policy] for s in x["slowdowns"]]
        if restores:
            print(
                f"{policy}: restore per recovery median {statistics.median(restores):.3f} s over "
                f"{len(restores)}"
                + (
                    f"; predicted slowdowns of the layouts moved to: {', '.join(f'x{s:.2f}' for s in slowdowns)}"
                    if slowdowns
                    else ""
                )
            )
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
