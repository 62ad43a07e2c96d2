"""The receive window measured: per slice, the received-but-unused data and the peak memory
of a traced step, against the simulator's prediction, with the window (the default: each
slice's peak of live activations) and without it (every receive posted at the step's start).

    .venv/bin/python benchmarks/bench_recv_window.py

Model: GPT (vocab 256, d_model 256, 4 heads, 6 blocks, seq 64, batch 32) split into p
stages, adamw, on InProcessCluster (the executor and its receive posting are the workers'
own). Per slice:
  held      most receives outstanding at once (posted, not yet used), and their bytes;
  bound     the window w (the schedule's peak live activations on that slice) and w x the
            largest bundle received there: what held must stay within;
  measured  the executor's peak of its buffers' bytes plus its outstanding receives, looked
            at between instructions (runtime/worker/executor.py StepResult.peak_bytes; XLA's
            temporaries and sends not yet pulled are not in it);
  predicted mpmd.stages.costs.slice_memory: params + grads + optimizer state + the peak of
            saved residuals from the simulator (which counts nothing in transit);
  ratio     measured / predicted.
"""

from __future__ import annotations

import os

import cpu_setup  # noqa: E402  (first: sets the flags before anything imports jax)

cpu_setup.before_jax(devices=8)


GPT = dict(vocab_size=256, d_model=256, num_heads=4, num_layers=6, seq_len=64)
BATCH = 32
CASES = [("1f1b", 4, 8), ("zb-h1", 4, 8), ("interleaved-1f1b", 4, 8)]
UNBOUNDED = 10**6


def pipeline(num_stages: int):
    from mpmd import models
    import mpmd
    from flax import nnx

    return mpmd.Pipeline(mpmd.split(models.GPT(**GPT, rngs=nnx.Rngs(0)), num_stages=num_stages), models.lm_loss)


def traced(name: str, p: int, m: int, v: int, recv_window):
    """The last of two traced steps' per-slice "held" and "peak_bytes"."""
    import numpy as np
    import optax

    import mpmd

    rng = np.random.default_rng(0)
    x = rng.integers(0, GPT["vocab_size"], (BATCH, GPT["seq_len"])).astype(np.int32)
    with mpmd.Trainer(
        pipeline(p * v),
        optax.adamw(1e-3),
        schedule=name,
        num_microbatches=m,
        virtual_stages=v,
        recv_window=recv_window,
        cluster=mpmd.InProcessCluster(),
    ) as trainer:
        out = [trainer.step(x, x, trace=True) for _ in range(2)][-1]
        return out["held"], out["peak_bytes"]


def main() -> None:
    import jax
    import numpy as np
    import optax

    from mpmd.lowering import core as lowering
    from mpmd.schedules import core as schedules
    from mpmd.stages import costs as stage_costs

    print(f"load average at start: {os.getloadavg()}")
    for name, p, m in CASES:
        v = 2 if name.startswith("interleaved") else 1
        schedule = schedules.make(name, p * v, m, v)
        windows = lowering.recv_windows(schedule)
        pipe = pipeline(p * v)
        micro = jax.ShapeDtypeStruct((BATCH // m, GPT["seq_len"]), np.int32)
        predicted = stage_costs.slice_memory(schedule, stage_costs.memory(pipe, optax.adamw(1e-3), micro, micro))
        acts = pipe.activation_specs(micro)
        bundle = max(sum(l.size * l.dtype.itemsize for l in jax.tree.leaves(a)) for a in acts[1:-1])
        held, peak = traced(name, p, m, v, None)
        free_held, free_peak = traced(name, p, m, v, UNBOUNDED)
        print(f"\n{name}, p={p}, m={m}" + (f", v={v}" if v > 1 else "") + f"; largest received bundle {bundle} B")
        print(
            f"{'slice':>5} {'w':>3} {'held':>6} {'held KB':>8} {'bound KB':>9} {'unbounded':>10} {'unb. KB':>8} "
            f"{'measured MB':>12} {'unb. MB':>8} {'predicted MB':>13} {'ratio':>6}"
        )
        for r in range(schedule.num_slices):
            print(
                f"{r:>5} {windows[r]:>3} {held[r][0]:>6} {held[r][1] / 1e3:>8.1f} {windows[r] * bundle / 1e3:>9.1f} "
                f"{free_held[r][0]:>10} {free_held[r][1] / 1e3:>8.1f} {peak[r] / 1e6:>12.3f} "
                f"{free_peak[r] / 1e6:>8.3f} {predicted[r]['total'] / 1e6:>13.3f} "
                f"{peak[r] / predicted[r]['total']:>6.3f}"
            )
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
