"""Fault injection with real worker processes and real signals.

Every scenario ends with exactly the parameters of an uninterrupted run (bitwise: the
in-process and multi-process runtimes run the same programs with the same threading) and
leaves no process behind.
"""
import os
import shutil
import signal
import threading
import time

import numpy as np
import optax
import pytest
from flax import nnx

import models
import mpmd
from tests import reference
from tests.test_multiprocess import wait_gone

STEPS, EVERY = 8, 2


def make_pipe():
    return mpmd.Pipeline(mpmd.split(models.GPT(64, 64, 2, 4, 32, rngs=nnx.Rngs(0)), num_stages=2), models.lm_loss)


def data():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 64, (16, 32)).astype(np.int32) for _ in range(STEPS)]


def make_trainer(cluster, run_dir, **kw):
    return mpmd.Trainer(make_pipe(), optax.adamw(1e-3), "gpipe", num_microbatches=4, cluster=cluster,
                        run_dir=run_dir, checkpoint_every=EVERY, **kw)


def train(trainer, batches, fault=None):
    """Train to STEPS, replaying after a recovery; `fault(i, trainer)` runs before batch i
    is stepped. Returns ({step: loss}, final params, number of rewinds)."""
    losses, rewinds, i = {}, 0, (trainer.resumed[1]["i"] if trainer.resumed else 0)
    while i < STEPS:
        if fault is not None:
            fault(i, trainer)
        try:
            out = trainer.step(batches[i], batches[i], data_state={"i": i + 1})
        except mpmd.Rewound as e:
            rewinds += 1
            i = e.data_state["i"] if e.data_state else 0
            losses = {s: l for s, l in losses.items() if s <= e.step}
            continue
        losses[out["step"]] = out["loss"]
        i += 1
    return losses, reference.stage_leaves(trainer.params()), rewinds


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    with make_trainer(mpmd.InProcessCluster(), tmp_path_factory.mktemp("ref")) as trainer:
        losses, params, _ = train(trainer, data())
    return losses, params


def assert_same_run(got, want):
    assert got[0] == want[0], "per-step losses differ from the uninterrupted run"
    assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1])), "final parameters differ"


def kill_once(at_step, sig, delay_s=0.0, slice_index=1):
    """A fault that sends `sig` to a worker while batch `at_step` is being trained,
    `delay_s` after the step starts (0: just before it)."""
    fired = []

    def fault(i, trainer):
        if i == at_step and not fired:
            fired.append(trainer.cluster.pids[slice_index])
            pid = fired[0]
            threading.Timer(delay_s, lambda: os.kill(pid, sig)).start()
    fault.fired = fired
    return fault


def run_with_fault(tmp_path, fault, **cluster_kw):
    cluster = mpmd.LocalCluster(**cluster_kw)
    trainer = make_trainer(cluster, tmp_path)
    try:
        result = train(trainer, data(), fault)
        pids = list(cluster.pids)
    finally:
        trainer.close()
    assert wait_gone(pids + list(getattr(fault, "fired", []))) == []
    return result


@pytest.mark.parametrize("phase,delay_s", [("forward", 0.01), ("backward", 0.06)])
def test_worker_sigkilled_mid_step(uninterrupted, tmp_path, phase, delay_s):
    # GPipe runs every forward before any backward: early in the step is the forward phase.
    fault = kill_once(5, signal.SIGKILL, delay_s)
    losses, params, rewinds = run_with_fault(tmp_path, fault)
    assert rewinds == 1
    assert_same_run((losses, params), uninterrupted)


def test_worker_sigkilled_during_async_save(uninterrupted, tmp_path):
    def fault(i, trainer):
        # Batch i == EVERY * 2 comes right after the save of step 4 was started.
        if i == 2 * EVERY and not fault.fired:
            fault.fired.append(trainer.cluster.pids[0])
            os.kill(fault.fired[0], signal.SIGKILL)
    fault.fired = []
    losses, params, rewinds = run_with_fault(tmp_path, fault)
    assert rewinds == 1
    assert_same_run((losses, params), uninterrupted)


def test_worker_sigstopped_is_declared_lost(uninterrupted, tmp_path):
    fault = kill_once(3, signal.SIGSTOP)
    t0 = time.monotonic()
    losses, params, rewinds = run_with_fault(tmp_path, fault, failure_timeout_s=2.0)
    assert rewinds == 1
    assert time.monotonic() - t0 < 60
    assert_same_run((losses, params), uninterrupted)


def test_newest_checkpoint_damaged_falls_back(uninterrupted, tmp_path, caplog):
    """Resume with the newest step truncated, then with a stage directory deleted: each time
    the previous committed step is used, with a warning naming the damaged one."""
    with make_trainer(mpmd.InProcessCluster(), tmp_path, keep=3) as trainer:
        with pytest.raises(_Stop):
            train(trainer, data(), fault=_stop_after(6))
    ck = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in ck.iterdir()) == [2, 4, 6]
    # Truncate every data file of step 6's stage 0.
    for f in (ck / "6" / "stage_0").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "d" in f.parts[-2:-1]:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    shutil.rmtree(ck / "4" / "stage_1")
    with caplog.at_level("WARNING", logger="mpmd"):
        trainer = make_trainer(mpmd.LocalCluster(), tmp_path)
        try:
            assert trainer.resumed[0] == 2
            losses, params, _ = train(trainer, data())
        finally:
            trainer.close()
    assert "skipping checkpoint step 6" in caplog.text and "skipping checkpoint step 4" in caplog.text
    assert [s for s in losses] == list(range(3, STEPS + 1))
    assert losses == {s: l for s, l in uninterrupted[0].items() if s > 2}
    assert all(np.array_equal(a, b) for a, b in zip(params, uninterrupted[1]))


def _stop_after(n):
    def fault(i, trainer):
        if i == n:
            raise _Stop
    return fault


class _Stop(Exception):
    pass


def test_gives_up_after_max_restarts(tmp_path):
    cluster = mpmd.LocalCluster()
    trainer = make_trainer(cluster, tmp_path, max_restarts=0)
    try:
        batches = data()
        trainer.step(batches[0], batches[0])
        trainer.step(batches[1], batches[1], data_state={"i": 2})
        trainer.checkpoints.wait()
        os.kill(cluster.pids[1], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"slice 1 .* lost.*giving up after 0 recoveries.*last committed checkpoint: step 2"):
            trainer.step(batches[2], batches[2])
    finally:
        pids = list(cluster.pids)
        trainer.close()
    assert wait_gone(pids) == []
