"""Every pipeline schedule on real compute: measured step against the simulated makespan from
measured task costs, against 1F1B, and against the unpipelined model on one core.

    .venv/bin/python benchmarks/bench_schedules.py [--quick]
    .venv/bin/python benchmarks/bench_schedules.py --flops     # F, B, W, BW per stage (XLA FLOPs)

GPT (vocab 256, 8 layers, d_model 512, 8 heads, seq 64), batch 32, m = 8 microbatches,
adamw. Schedules: every one mpmd.schedules.SCHEDULES builds on 2 slices (one stage per
slice, or two where a schedule places several stages on a slice: interleaved-1f1b with
v = 2, V-shaped ones), each trained on its own LocalCluster(num_workers=2): real worker
processes, each pinned to one core with one XLA thread, real transfers. Baseline: the same
model's whole-batch adamw step, jitted, in a subprocess pinned to one core with XLA's
intra-op threads off.

Rounds are interleaved: each round times the baseline and then every schedule (the order
rotates per round), so load drift hits all alike; figures are medians over rounds. A step
returns once its loss is on the host, while its backward and update may still run
(asynchronous dispatch, in the workers as in jax.jit), so a round times only finished work:
a pipelined round is `steps` steps and one traced step (a traced step blocks on every
task, so when it returns every slice is done), step time = wall time / (steps + 1); the
baseline's round is `steps` steps and a wait for its parameters, wall time / steps. Every
round starts with nothing of any runner in flight.

Simulated: each round's traced step gives every task's duration under that round's load:
per stage and kind, the median over microbatches and rounds of its F, B and W programs (or
of its full backward, priced as B with W = 0, where the schedule does not split it; the
first stage's B runs no program: 0). mpmd.schedules.simulate runs the schedule with those costs
(comm_s = 0), and each slice's measured update time is added after its last task.
measured / simulated near 1 means the runtime runs the schedule as the simulator predicts;
the excess is dispatch, transfers and waits the simulator does not charge.

On this 2-core machine the controller, the two workers and any other load share the cores:
the load average is printed at the start and the end; compare runs made at low load.

--flops prints each stage's forward, input-gradient (B), weight-gradient (W) and full
backward (BW) FLOPs by XLA's cost analysis for the 2-stage split (B + W = BW: W does not
recompute the vjp; mpmd/stages/backward_split.py).
"""

from __future__ import annotations

import os
import sys

# Before jax is imported. The baseline subprocess sets its own flags (see _baseline_main).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--baseline" not in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GPT = dict(vocab_size=256, d_model=512, num_heads=8, num_layers=8, seq_len=64)
BATCH, M, NUM_SLICES, LR = 32, 8, 2, 3e-4


def make_batches(num: int) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (BATCH, GPT["seq_len"])
    return [
        (
            rng.integers(0, GPT["vocab_size"], shape).astype(np.int32),
            rng.integers(0, GPT["vocab_size"], shape).astype(np.int32),
        )
        for _ in range(num)
    ]


def two_slice_schedules(num_microbatches: int) -> list:
    """Every registered schedule that runs on NUM_SLICES slices: first as two stages per
    slice with virtual_stages = 2, else one stage per slice, else two stages per slice with
    the generator's own placement (a V). Registry order."""
    from mpmd.schedules import core as schedules

    out = []
    for name in schedules.SCHEDULES:
        for num_stages, v in ((2 * NUM_SLICES, 2), (NUM_SLICES, 1), (2 * NUM_SLICES, 1)):
            try:
                schedule = schedules.make(name, num_stages, num_microbatches, v)
            except ValueError:
                continue
            if schedule.num_slices == NUM_SLICES:
                out.append(schedule)
                break
        else:
            print(f"  ({name}: no form on {NUM_SLICES} slices with m={num_microbatches}; skipped)")
    return out


# -- the unpipelined baseline: a subprocess pinned to one core ------------------------------
def _baseline_main() -> None:
    """Subprocess body: reads a step count per line, runs that many adamw steps of the whole
    batch, answers one JSON line (seconds per step, last loss)."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import jax
    import optax
    from flax import nnx

    from mpmd import models

    graphdef, params, rest = nnx.split(models.GPT(**GPT, rngs=nnx.Rngs(0)), nnx.Param, ...)
    optimizer = optax.adamw(LR)

    def step(p, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: models.lm_loss(nnx.merge(graphdef, p, rest)(x), y))(p)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    state = (params, optimizer.init(params))
    batches, i = make_batches(4), 0
    print(json.dumps({"cpus": sorted(os.sched_getaffinity(0))}), flush=True)
    for line in sys.stdin:
        n, loss, start = int(line), None, time.perf_counter()
        for _ in range(n):
            *state, loss = step(*state, *batches[i % len(batches)])
            loss, i = float(loss), i + 1  # the host read a pipelined step's loss fetch also does
        jax.block_until_ready(state)  # the last update is part of the round
        print(json.dumps({"step_s": (time.perf_counter() - start) / n, "loss": loss}), flush=True)


class Baseline:
    def __init__(self):
        env = dict(
            os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_multi_thread_eigen=false"
        )
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--baseline"], env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.cpus = self._read()["cpus"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"baseline subprocess ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def steps(self, n: int) -> float:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._read()["step_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# -- pipelined runs ----------------------------------------------------------------------------
def task_costs(schedule, traced_steps: list) -> tuple[list[dict], list[float]]:
    """(per-stage {"F", "B", "W"} seconds, per-slice update seconds) from traced steps: the
    median duration of each stage's programs of each kind. A full backward (no split) is
    priced as B with W = 0; the first stage's B of a split backward runs no program: 0."""
    from mpmd.tuner.profile import task_durations

    durations = task_durations(metrics["events"] for metrics in traced_steps)
    median = lambda key: statistics.median(durations[key]) if key in durations else 0.0
    costs = [{kind: median((kind, k)) for kind in ("F", "B", "W")} for k in range(schedule.num_stages)]
    updates = [sum(median(("U", k)) for k in schedule.stages_on(r)) for r in range(schedule.num_slices)]
    return costs, updates


def main(quick: bool) -> None:
    import jax
    import optax
    from flax import nnx

    from mpmd import models
    import mpmd
    from mpmd.schedules.simulate import step_s

    num_warmup, num_rounds, num_steps = (1, 2, 1) if quick else (1, 5, 3)
    start = time.perf_counter()
    print(
        f"bench_schedules{' --quick' if quick else ''}: {os.cpu_count()} cores, jax {jax.__version__}, "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    print(
        f"GPT {GPT}, batch {BATCH}, m={M}, adamw, {NUM_SLICES} LocalCluster workers; "
        f"{num_rounds} rounds of {num_steps} steps (+ 1 traced, pipelined) after {num_warmup} warm-up"
    )
    found = two_slice_schedules(M)
    batches = make_batches(num_warmup + num_steps)
    baseline = Baseline()
    trainers = {}
    try:
        for schedule in found:
            pipe = mpmd.Pipeline(mpmd.split(models.GPT(**GPT, rngs=nnx.Rngs(0)), schedule.num_stages), models.lm_loss)
            trainers[schedule.name] = mpmd.Trainer(
                pipe, optax.adamw(LR), schedule=schedule, cluster=mpmd.LocalCluster(num_workers=NUM_SLICES)
            )
        runners = {"unpipelined": baseline.steps}
        traced: dict = {name: [] for name in trainers}
        for name, trainer in trainers.items():

            def run(n, trainer=trainer, traced=traced[name]):
                begin = time.perf_counter()
                for x, y in batches[num_warmup : num_warmup + n]:
                    trainer.step(x, y)
                traced.append(trainer.step(*batches[0], trace=True))
                return (time.perf_counter() - begin) / (n + 1)

            for x, y in batches[:num_warmup]:
                trainer.step(x, y)
            trainer.step(*batches[0], trace=True)  # compiles the traced path; ends idle
            runners[name] = run
        baseline.steps(num_warmup)  # compiles
        per_step: dict = {name: [] for name in runners}
        order = list(runners)
        for i in range(num_rounds):
            for name in order[i % len(order) :] + order[: i % len(order)]:
                per_step[name].append(runners[name](num_steps))
        simulated = {}
        for schedule in found:
            costs, updates = task_costs(schedule, traced[schedule.name])
            simulated[schedule.name] = (step_s(schedule, costs, updates), costs)
    finally:
        for trainer in trainers.values():
            trainer.close()
        baseline.close()

    base = statistics.median(per_step["unpipelined"])
    ref = statistics.median(per_step["1f1b"]) if "1f1b" in per_step else None
    print(f"\nunpipelined, 1 core {baseline.cpus}, 1 thread: {base:.3f} s/step (median of {num_rounds} rounds)")
    print(
        f"{'schedule':>17} {'stages':>6} {'step s':>7} {'sim s':>7} {'meas/sim':>9} {'vs 1f1b':>8} "
        f"{'sim vs 1f1b':>12} {'speedup':>8}   measured costs per stage, ms: F/B/W"
    )
    ref_sim = simulated["1f1b"][0] if "1f1b" in simulated else None
    for schedule in found:
        name = schedule.name
        step = statistics.median(per_step[name])
        sim, costs = simulated[name]
        vs = f"{step / ref:>8.3f}" if ref else f"{'-':>8}"
        vs_sim = f"{sim / ref_sim:>12.3f}" if ref_sim else f"{'-':>12}"
        shown = "  ".join("/".join(f"{c[k] * 1e3:.0f}" for k in ("F", "B", "W")) for c in costs)
        print(
            f"{name:>17} {schedule.num_stages:>6} {step:>7.3f} {sim:>7.3f} {step / sim:>9.3f} {vs} {vs_sim} "
            f"{base / step:>7.2f}x   {shown}"
        )
    print(
        "(vs 1f1b: step / 1f1b's step, < 1 is faster; sim vs 1f1b: the same for the simulated steps; "
        "speedup: unpipelined step / pipelined step.\n goals: every meas/sim <= 1.05; zero-bubble "
        "schedules >= 5% faster than 1f1b where sim vs 1f1b predicts it)"
    )
    print(f"\ntotal {time.perf_counter() - start:.0f} s, load average at end {os.getloadavg()[0]:.2f}")


def flops() -> None:
    """Per stage of the benchmark's GPT split in NUM_SLICES: F, B, W, BW MFLOP (one microbatch)."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from mpmd import models
    import mpmd
    from mpmd.stages import costs as stage_costs

    tokens = jax.ShapeDtypeStruct((BATCH // M, GPT["seq_len"]), np.int32)
    pipe = mpmd.Pipeline(mpmd.split(models.GPT(**GPT, rngs=nnx.Rngs(0)), NUM_SLICES), models.lm_loss)
    print(
        f"GPT {GPT}, microbatch {tokens.shape}, {NUM_SLICES} stages; XLA cost analysis, MFLOP; "
        f"bytes per microbatch held for the backward: residuals (F until W) and kept (B until W)"
    )
    print(f"{'stage':>5} {'F':>9} {'B':>9} {'W':>9} {'BW':>9} {'(B+W)/BW':>9} {'resid MiB':>10} {'kept MiB':>9}")
    memory = stage_costs.memory(pipe, optax.adamw(LR), tokens, tokens)
    for k, c in enumerate(stage_costs.measure(pipe, tokens, tokens, flops_only=True)):
        print(
            f"{k:>5} "
            + " ".join(f"{c[kind] / 1e6:>9.1f}" for kind in ("F", "B", "W", "BW"))
            + f" {(c['B'] + c['W']) / c['BW']:>9.3f} {memory[k]['residuals'] / 2**20:>10.2f}"
            + f" {memory[k]['kept'] / 2**20:>9.2f}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--baseline"]:
        _baseline_main()
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--quick", action="store_true", help="few rounds: a smoke run, not a measurement")
        parser.add_argument("--flops", action="store_true", help="print F/B/W/BW FLOPs per stage and exit")
        args = parser.parse_args()
        flops() if args.flops else main(args.quick)
