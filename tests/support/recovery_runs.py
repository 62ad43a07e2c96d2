"""Runs of a small pipeline with and without injected faults, shared by the fault tests
(tests/train/test_recovery.py, tests/runtime/test_control_faults.py); the uninterrupted runs are fixtures
in conftest.py. And what every fault test checks of the checkpoints a faulty run committed
(assert_commits_verify: tests/runtime/test_fencing.py, tests/runtime/test_hosts.py)."""

import collections
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mpmd import models
import mpmd
from tests.support import reference
from tests.support.processes import alive, wait_gone

STEPS, EVERY = 8, 2


def make_pipe(spin=None, num_stages=2):
    """The GPT in two stages (or `num_stages`: 4 is embedding, block, block, head); with
    spin=(forward_iters, backward_iters), stage 1 starts with a `Spin` of those counts."""
    stages = mpmd.split(models.GPT(64, 64, 2, 4, 32, rngs=nnx.Rngs(0)), num_stages=num_stages)
    if spin is not None:
        stages[1] = nnx.Sequential(Spin(*spin), *stages[1].layers)
    return mpmd.Pipeline(stages, models.lm_loss)


class Spin(nnx.Module):
    """The identity, exactly, whose forward first burns `forward_iters` serial sines over the
    activation and whose backward burns `backward_iters` over the gradient (~15 CPU us each on
    one microbatch here): it stretches one phase of a stage so that a kill aimed at its
    middle lands inside it with a wide margin."""

    def __init__(self, forward_iters: int, backward_iters: int):
        self.forward_iters, self.backward_iters = forward_iters, backward_iters

    def __call__(self, x):
        return _spin(x, self.forward_iters, self.backward_iters)


def _burn(x, iters):
    if not iters:
        return x
    # x + 0 * (finite sum) is x bitwise; XLA does not fold a float multiply by zero (NaN * 0).
    return x + 0.0 * jnp.sum(jax.lax.fori_loop(0, iters, lambda _, u: jnp.sin(u), x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _spin(x, forward_iters, backward_iters):
    return _burn(x, forward_iters)


_spin.defvjp(lambda x, f, b: (_burn(x, f), None), lambda f, b, _, g: (_burn(g, b),))


def data():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 64, (16, 32)).astype(np.int32) for _ in range(STEPS)]


def make_trainer(cluster, run_dir, spin=None, checkpoint=None, num_stages=2, schedule="gpipe", **kw):
    """The Trainer of make_pipe(spin, num_stages); `checkpoint` (an mpmd.Checkpointing)
    defaults to a checkpoint every EVERY steps."""
    return mpmd.Trainer(
        make_pipe(spin, num_stages),
        optax.adamw(1e-3),
        schedule=schedule,
        num_microbatches=4,
        cluster=cluster,
        run_dir=run_dir,
        checkpoint=checkpoint if checkpoint is not None else mpmd.Checkpointing(every=EVERY),
        **kw,
    )


def train(trainer, batches, fault=None, traces=None, steps=STEPS, ahead=0):
    """Train to `steps`, replaying after a recovery; `fault(i, trainer)` runs before batch i
    is sent. `ahead`: how many steps are sent (Trainer.submit) before the oldest one's result
    is collected (0: one step at a time, as Trainer.step). With a `traces` list, every
    completed step is traced and appended to it as (i, start_ns, slice 1's worker pid,
    per-slice events), start_ns taken just before the step is sent.
    Returns ({step: loss}, final params, number of rewinds); `train.rewound` then holds each
    rewind's message (it names what was lost and why), and `train.compiles` the executables
    every slice built in each collected step, in the order collected, a rewind as None, and
    `train.loads` {step: (executables built, of them loaded from the persistent cache)} of
    the last time each step ran."""
    train.rewound, train.compiles, train.loads = [], [], {}
    losses, rewinds, i = {}, 0, (trainer.resumed[1]["i"] if trainer.resumed else 0)
    pending = collections.deque()  # (batch index, start_ns, PendingStep), oldest first
    while i < steps or pending:
        try:
            if i < steps and len(pending) <= ahead:
                if fault is not None:
                    fault(i, trainer)
                start_ns = time.time_ns()
                pending.append(
                    (
                        i,
                        start_ns,
                        trainer.submit(batches[i], batches[i], data_state={"i": i + 1}, trace=traces is not None),
                    )
                )
                i += 1
                continue
            batch, start_ns, step = pending.popleft()
            out = step.result()
        except mpmd.Rewound as e:
            rewinds += 1
            train.rewound.append(str(e))
            train.compiles.append(None)
            i = e.data_state["i"] if e.data_state else 0
            losses = {s: l for s, l in losses.items() if s <= e.step}
            pending.clear()  # discarded with the failed step: nothing of them landed
            continue
        if traces is not None:
            traces.append((batch, start_ns, trainer.cluster.pids[1], out["events"]))
        losses[out["step"]] = out["loss"]
        train.compiles.append(out.get("compiles", 0))
        train.loads[out["step"]] = (out.get("compiles", 0), out.get("cache_loads", 0))
    return losses, reference.stage_leaves(trainer.params()), rewinds


# Per phase, the Spin that stretches slice 1's forward ("F") or backward ("B") phase: ~4 x 0.12 CPU s.
SPIN = {"F": (9000, 0), "B": (0, 9000)}
GANG_STEPS = 5  # the gang tests: a checkpoint every 2 steps; killed before step 4 is sent: back to step 2's commit
SPIN_STEPS = 4  # a spinning step is slow: killed in step 4, the run replays steps 3 and 4


def slice_part(step_dir, r: int):
    """Slice r's part of a checkpoint step: the directory its manifest names for it
    (`slice_<r>.<generation>`)."""
    import json

    manifest = json.loads((step_dir / "manifest.json").read_text())
    parts = {leaf["part"] for leaf in manifest["leaves"].values() if leaf["part"].startswith(f"slice_{r}.")}
    assert len(parts) == 1, parts
    return step_dir / parts.pop()


def assert_commits_verify(run_dir, stale=()) -> dict[int, set[str]]:
    """Every committed step of `run_dir` verifies, and holds nothing a worker left behind in an
    older generation (a zombie) wrote: no step is damaged; each step's parts are of one
    generation (`slice_<r>.<generation>`); none is a directory in `stale` (where a zombie was
    told to write); nothing in a part was written after the step's manifest; and every leaf
    reads back with the digest its manifest records. {step: its parts}."""
    from mpmd.runtime.worker.slice_store import CheckpointStore, SliceCheckpointer

    store = CheckpointStore(run_dir)
    assert store.damaged() == {}, store.damaged()
    stale = {os.path.realpath(d) for d in stale}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    found = {}
    for step in store.committed():
        manifest = store.manifest(step)
        parts = {leaf["part"] for leaf in manifest["leaves"].values()}
        generations = {p.partition(".")[2] for p in parts}
        assert len(generations) == 1 and "" not in generations, (
            f"step {step}'s parts are not of one generation: {parts}"
        )
        paths = {p: store.step_dir(step) / p for p in parts}
        told = stale & {os.path.realpath(d) for d in paths.values()}
        assert not told, f"step {step} commits {sorted(told)}, where a worker left behind was told to write"
        committed_at = (store.step_dir(step) / "manifest.json").stat().st_mtime_ns
        for d in paths.values():
            for f in [d, *d.rglob("*")]:
                assert f.stat().st_mtime_ns <= committed_at, f"{f} was written after step {step} was committed"
        for part, d in paths.items():
            leaves = {k: leaf.get("digest") for k, leaf in manifest["leaves"].items() if leaf["part"] == part}
            assert None not in leaves.values(), f"step {step}'s part {part} has leaves without digests"
            SliceCheckpointer().restore({str(d): {k: [(k, 0)] for k in leaves}}, lambda *_: device, leaves)
        found[step] = parts
    return found


def assert_same_run(got, want):
    assert got[0] == want[0], "per-step losses differ from the uninterrupted run"
    assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1])), "final parameters differ"


def kill_once(at_step, sig, slice_index=1):
    """A fault that sends `sig` to a worker just before batch `at_step` is stepped."""

    def fault(i, trainer):
        if i == at_step and not fault.fired:
            fault.fired.append(trainer.cluster.pids[slice_index])
            os.kill(fault.fired[0], sig)

    fault.fired = []
    return fault


def run_with_fault(
    tmp_path, fault, spin=None, traces=None, cluster=None, steps=STEPS, ahead=0, trainer_kw=None, **cluster_kw
):
    """train() a Trainer of make_trainer with `fault` on `cluster`, a shared one (the
    `workers` fixture) that stays up: every worker the fault killed must be gone and every
    slice served by a live worker. Without one, on a LocalCluster(**cluster_kw) of its own,
    closed with the Trainer: then no worker may be left."""
    own = cluster is None
    probe_timeout_s = cluster_kw.pop("probe_timeout_s", None)  # set on the control plane, not a launcher
    cluster = mpmd.LocalCluster(**cluster_kw) if own else cluster
    if own and probe_timeout_s is not None:
        cluster.probe_timeout_s = probe_timeout_s
    trainer = make_trainer(cluster, tmp_path, spin, **(trainer_kw or {}))
    try:
        result = train(trainer, data(), fault, traces, steps, ahead)
        pids = list(cluster.pids)
        run_with_fault.trainer = trainer  # for the caller's checks of how it recovered
    finally:
        trainer.close(close_cluster=own)
    fired = list(getattr(fault, "fired", []))
    assert wait_gone(pids + fired if own else fired) == []
    assert own or all(alive(p) for p in cluster.pids), "a slice of the shared cluster has no live worker"
    return result
