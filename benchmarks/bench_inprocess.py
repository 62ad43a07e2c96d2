"""Overhead of the in-process pipeline over a plain jitted train step, and schedule tooling time.

    .venv/bin/python benchmarks/bench_inprocess.py [--quick]

1. One GPT (d_model 256, 4 blocks, seq 128, batch 16, vocab 256) trained two ways in this
   process: `mpmd.Trainer` with one stage on an InProcessCluster ("1f1b", p = 1), and a plain
   `jax.jit` of value_and_grad + optax.adamw update with donated params and optimizer state.
   Both take host (numpy) batches and read the loss back to the host every step, as a
   training loop does. After warm-up the two alternate rounds of num_steps steps, so machine
   noise hits both alike; a round's step time is its wall time / num_steps, and the ratio is
   median(pipeline) / median(plain). A round ends only when its parameters are final: the
   pipeline's loss is an output of the forward program, so `Trainer.step` returns while that
   step's backward and update still run (asynchronous dispatch), and without the wait that
   unfinished work would be billed to the next round, i.e. to the baseline. Goal: <= 1.10x at m = 1. The m = 4 line splits the same
   batch into 4 microbatches (4 smaller programs per step instead of 1): shown, no goal.
2. Schedule generation + validation + simulation for p = 64 slices, m = 512 microbatches,
   every schedule (interleaved-1f1b with v = 2, i.e. 128 stages). Goal: < 1 s each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from mpmd import models  # noqa: E402
import mpmd  # noqa: E402
from mpmd.schedules import core as schedules  # noqa: E402
from mpmd.schedules import timeline  # noqa: E402
from mpmd.schedules.simulate import simulate  # noqa: E402

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 256, 256, 4, 4, 128, 16
LR = 3e-4
SCHEDULE_CASES = (("1f1b", 64, 1), ("gpipe", 64, 1), ("zb-h1", 64, 1), ("interleaved-1f1b", 128, 2))
NUM_SCHEDULE_MICROBATCHES = 512


def make_gpt() -> models.GPT:
    return models.GPT(VOCAB, D_MODEL, HEADS, LAYERS, SEQ, rngs=nnx.Rngs(0))


def make_batches(num: int) -> list:
    rng = np.random.default_rng(0)
    return [
        (rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32), rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
        for _ in range(num)
    ]


class PlainStep:
    """The unpipelined baseline: one jitted step, params and optimizer state donated."""

    def __init__(self, optimizer):
        graphdef, params, rest = nnx.split(make_gpt(), nnx.Param, ...)

        def loss_fn(p, x, y):
            return models.lm_loss(nnx.merge(graphdef, p, rest)(x), y)

        def step(p, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, loss

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self.params, self.opt_state = params, optimizer.init(params)

    def step(self, x, y) -> float:
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, x, y)
        return float(loss)  # the host read the pipeline's loss fetch also does

    def wait(self) -> None:
        jax.block_until_ready((self.params, self.opt_state))


def wait_for_slices(trainer: mpmd.Trainer) -> None:
    # Benchmark-only peek at the in-process executors: block until every buffer a slice
    # holds (parameters, optimizer state) is computed, without copying it to the host.
    jax.block_until_ready([ex.buffers for ex in trainer.cluster.executors])


def compare(num_microbatches: int, num_warmup: int, num_rounds: int, num_steps: int) -> None:
    batches = make_batches(num_steps)
    plain = PlainStep(optax.adamw(LR))
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=1), models.lm_loss)
    with mpmd.Trainer(
        pipe,
        optimizer=optax.adamw(LR),
        schedule="1f1b",
        num_microbatches=num_microbatches,
        cluster=mpmd.InProcessCluster(),
    ) as trainer:
        # Same initial params, same data: the first losses must agree (same model, same math).
        first_plain = plain.step(*batches[0])
        first_pipe = trainer.step(*batches[0])["loss"]
        assert abs(first_plain - first_pipe) <= 1e-4 * abs(first_plain), (first_plain, first_pipe)
        runners = {"plain": (plain.step, plain.wait), "pipeline": (trainer.step, lambda: wait_for_slices(trainer))}
        for _ in range(num_warmup):
            for run, wait in runners.values():
                for x, y in batches:
                    run(x, y)
                wait()
        per_step_s = {name: [] for name in runners}
        for i in range(num_rounds):
            # Alternate which goes first, so neither always follows the other's cache state.
            for name in runners if i % 2 == 0 else reversed(list(runners)):
                run, wait = runners[name]
                start = time.perf_counter()
                for x, y in batches:
                    run(x, y)
                wait()
                per_step_s[name].append((time.perf_counter() - start) / num_steps)
    plain_s = statistics.median(per_step_s["plain"])
    pipe_s = statistics.median(per_step_s["pipeline"])
    paired = statistics.median(p / q for p, q in zip(per_step_s["pipeline"], per_step_s["plain"]))
    goal = (
        "  (goal <= 1.10x: " + ("met" if pipe_s / plain_s <= 1.10 else "MISSED") + ")" if num_microbatches == 1 else ""
    )
    print(
        f"p=1 m={num_microbatches}: plain jit {plain_s * 1e3:8.2f} ms/step, "
        f"pipeline {pipe_s * 1e3:8.2f} ms/step, ratio {pipe_s / plain_s:.3f}x "
        f"(median of paired rounds {paired:.3f}x, {num_rounds} rounds x {num_steps} steps){goal}"
    )


def schedule_times(num_microbatches: int, num_repeats: int) -> None:
    for name, num_stages, v in SCHEDULE_CASES:
        times, sim = [], None
        for _ in range(num_repeats):
            start = time.perf_counter()
            schedule = schedules.make(name, num_stages, num_microbatches, v)
            timeline.validate(schedule)
            sim = simulate(schedule)
            times.append(time.perf_counter() - start)
        best = min(times)
        num_tasks = sum(map(len, schedule.slices))
        print(
            f"{name:>17} p={len(schedule.slices)} stages={num_stages} m={num_microbatches}: "
            f"{num_tasks:6d} tasks, make+validate+simulate {best:.3f} s "
            f"(min of {num_repeats}; bubble {sim.bubble_fraction:.3f})"
            f"  (goal < 1 s: {'met' if best < 1.0 else 'MISSED'})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke run, not a measurement")
    args = parser.parse_args()
    if args.quick:
        num_warmup, num_rounds, num_steps, num_repeats = 1, 3, 2, 1
    else:
        num_warmup, num_rounds, num_steps, num_repeats = 2, 15, 5, 3
    print(f"GPT d_model={D_MODEL} layers={LAYERS} seq={SEQ} batch={BATCH} vocab={VOCAB}, devices: {jax.devices()}")
    for m in (1, 4):
        compare(m, num_warmup, num_rounds, num_steps)
    schedule_times(NUM_SCHEDULE_MICROBATCHES, num_repeats)


if __name__ == "__main__":
    main()
