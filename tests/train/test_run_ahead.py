"""Run-ahead dispatch (Trainer.submit, train.run_ahead): sending step N+1 while step N runs
changes nothing that is computed, saved, logged or recovered."""

import collections
import signal

import numpy as np
import optax
import pytest

from mpmd import models
import mpmd
from mpmd.recipes import config
from mpmd.recipes.run import run_log
from mpmd.recipes.run import train as train_recipe
from tests.support import reference
from tests.support.processes import TINY_GPT
from tests.support.recovery_runs import assert_same_run, kill_once, run_with_fault
from tests.support.reference import batches, make_gpt

EVERY = 3  # checkpoint cadence: step 3's save must not see step 4's update


def train_ahead(ahead: int, run_dir, cluster=None):
    """(losses, final leaves, most steps in flight, params restored from step 3's checkpoint)
    of the small GPT under 1F1B with SGD + momentum, `ahead` steps sent beyond the oldest."""
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with mpmd.Trainer(
        pipe,
        optax.sgd(0.1, momentum=0.9),
        schedule="1f1b",
        num_microbatches=4,
        cluster=cluster or mpmd.InProcessCluster(),
        run_ahead=ahead,
        run_dir=run_dir,
        checkpoint=mpmd.Checkpointing(every=EVERY, keep=5),
    ) as trainer:
        pending, losses, most = collections.deque(), [], 0
        for x, y in batches() * 2:
            pending.append(trainer.submit(x, y))
            most = max(most, trainer.in_flight)
            if len(pending) > ahead:
                losses.append(pending.popleft().result())
        losses += [p.result() for p in pending]
        assert [m["step"] for m in losses] == list(range(1, len(losses) + 1))
        final = reference.stage_leaves(trainer.params())
    return [m["loss"] for m in losses], final, most


def restored_at(run_dir, step: int):
    """The parameters of `run_dir`'s checkpoint of `step` (older ones moved aside to reach it)."""
    import shutil

    ck = run_dir / "checkpoints"
    for newer in [p for p in ck.iterdir() if p.name.isdigit() and int(p.name) > step]:
        shutil.rmtree(newer)
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with mpmd.Trainer(
        pipe,
        optax.sgd(0.1, momentum=0.9),
        schedule="1f1b",
        num_microbatches=4,
        cluster=mpmd.InProcessCluster(),
        run_dir=run_dir,
    ) as trainer:
        assert trainer.resumed[0] == step
        return reference.stage_leaves(trainer.params())


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    """(train_ahead(0) in-process, its run_dir): both tests below compare against it."""
    run_dir = tmp_path_factory.mktemp("ahead") / "0"
    return train_ahead(0, run_dir), run_dir


@pytest.mark.slow
@pytest.mark.every_jax
def test_run_ahead_is_bitwise_the_synchronous_run(synchronous, tmp_path):
    """Depth 0, 1 and 2: the same losses, parameters and checkpoints, bit for bit, and the
    same as the unpipelined model (within float rounding); the deeper runs really had that
    many steps in flight."""
    runs = {0: synchronous[0], **{ahead: train_ahead(ahead, tmp_path / str(ahead)) for ahead in (1, 2)}}
    run_dirs = {0: synchronous[1], 1: tmp_path / "1", 2: tmp_path / "2"}
    assert [runs[a][2] for a in (0, 1, 2)] == [1, 2, 3]
    for ahead in (1, 2):
        reference.assert_same(runs[0][:2], runs[ahead][:2])
    ref_losses, _, ref_params = reference.train(make_gpt, models.lm_loss, batches() * 2, optax.sgd(0.1, momentum=0.9))
    np.testing.assert_allclose(runs[0][0], ref_losses, rtol=1e-5)
    reference.assert_leaves_close(runs[0][1], ref_params, rtol=1e-5)
    # Step 3's checkpoint holds the state after step 3 only, whatever was sent after it.
    at2 = {ahead: restored_at(run_dirs[ahead], EVERY) for ahead in (0, 1, 2)}
    for ahead in (1, 2):
        assert all(np.array_equal(a, b) for a, b in zip(at2[0], at2[ahead]))
    assert not all(np.array_equal(a, b) for a, b in zip(at2[0], runs[0][1]))


@pytest.mark.slow
def test_run_ahead_over_local_workers_is_bitwise_in_process(synchronous, tmp_path):
    """The worker processes queue a Run sent ahead behind the running one, in order."""
    ahead = train_ahead(1, tmp_path / "local", mpmd.LocalCluster())
    assert ahead[2] == 2
    reference.assert_same(synchronous[0][:2], ahead[:2])


@pytest.mark.slow
def test_worker_sigkilled_with_a_step_queued(uninterrupted, workers, tmp_path):
    """SIGKILL slice 1's worker while one step runs and the next is queued behind it: the
    queued step is discarded (aborted on the survivor, nothing of it applied or counted),
    the run rewinds to the last checkpoint and ends bitwise equal to the uninterrupted,
    synchronous run."""
    fault = kill_once(3, signal.SIGKILL)
    losses, params, rewinds = run_with_fault(tmp_path, fault, ahead=1, cluster=workers)
    assert fault.fired and rewinds == 1
    assert_same_run((losses, params), uninterrupted)


def test_recipe_run_ahead_logs_the_same_run(tmp_path):
    """`mpmd train` with train.run_ahead=0 and 1: the same metrics, once per step, the same
    evals (each after its own step), the same final checkpoint."""
    logged = {}
    for ahead in (0, 1):
        cfg = config.load(
            "configs/gpt_tiny.yaml",
            [
                "cluster.backend=inprocess",
                "train.steps=5",
                "train.eval_every=2",
                "checkpoint.every=3",
                "train.sample_tokens=0",
                "log.tensorboard=false",
                f"train.run_ahead={ahead}",
                f"run_dir={tmp_path / str(ahead)}",
                *TINY_GPT,
            ],
        )
        summary = train_recipe.run(cfg)
        logged[ahead] = (run_log.read(tmp_path / str(ahead)), summary)
    (sync, s0), (ahead, s1) = logged[0], logged[1]
    assert [r["step"] for r in ahead] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm", "lr", "eval_loss"):
        assert [r.get(key) for r in ahead] == [r.get(key) for r in sync], key
    assert s0["eval_loss"] == s1["eval_loss"] and s0["last_loss"] == s1["last_loss"]


def test_run_ahead_must_be_a_non_negative_integer():
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="run_ahead must be a non-negative integer"):
            mpmd.Trainer(pipe, optax.sgd(0.1), schedule="1f1b", num_microbatches=2, run_ahead=bad)
    with pytest.raises(config.ConfigError, match="train.run_ahead"):
        config.load("configs/gpt_tiny.yaml", ["train.run_ahead=-1"])
