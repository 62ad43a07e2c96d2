"""The in-memory checkpoint tier (mpmd/train/snapshots.py) on real worker processes: a SIGKILLed
worker's slice comes back from its peer's copy of the newest snapshot and the run ends
bitwise equal to the uninterrupted one; a slice lost with its peer falls back to the
persistent tier; a full save queue blocks instead of dropping a save."""

import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

import mpmd
from mpmd.runtime.worker import slice_store
from mpmd.runtime.worker.slice_store import CheckpointStore, SliceCheckpointer
from tests.support.recovery_runs import EVERY, assert_same_run, kill_once, run_with_fault

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)


@pytest.mark.parametrize("ahead", [0, 1], ids=["in-step", "run-ahead"])
def test_killed_worker_restores_from_memory_and_replays_one_step(uninterrupted, workers, tmp_path, ahead):
    """Snapshots every step, persistent saves every 50 (none in 8 steps): slice 1's worker is
    killed before batch 5 is sent; slice 0 binds its own newest snapshot, the replacement
    receives slice 1's state from slice 0's copy, and only the failed step is computed
    again. With run-ahead each snapshot is sent right behind its step, before the next."""
    losses, params, rewinds = run_with_fault(
        tmp_path,
        kill_once(5, signal.SIGKILL),
        ahead=ahead,
        cluster=workers,
        trainer_kw={"checkpoint": mpmd.Checkpointing(every=50, memory_every=1)},
    )
    recovery = run_with_fault.trainer.recovery_s
    assert rewinds == 1
    assert recovery["tier"] == "memory" and recovery["replayed"] == 1, recovery
    assert CheckpointStore(tmp_path).committed() == [], "recovered from disk, not from memory"
    assert_same_run((losses, params), uninterrupted)


def test_first_slice_restored_from_its_peer_every_other_step(uninterrupted, workers, tmp_path):
    """Slice 0 (the first stage) killed before batch 5 with a snapshot every 2 steps: its
    state comes from the copy slice 1 holds of step 4, and two steps are replayed."""
    losses, params, rewinds = run_with_fault(
        tmp_path,
        kill_once(5, signal.SIGKILL, slice_index=0),
        cluster=workers,
        trainer_kw={"checkpoint": mpmd.Checkpointing(every=50, memory_every=2)},
    )
    recovery = run_with_fault.trainer.recovery_s
    assert rewinds == 1
    assert recovery["tier"] == "memory" and recovery["replayed"] == 2, recovery
    assert_same_run((losses, params), uninterrupted)


def test_slice_and_its_peer_lost_fall_back_to_the_persistent_tier(uninterrupted, workers, tmp_path):
    """Both workers killed at once after step 5: no copy of either slice's snapshot
    survives, so the run restores the last committed checkpoint (step 4) and replays."""

    def fault(i, trainer):
        if i == 5 and not fault.fired:
            trainer.checkpoints.wait()  # step 4 committed (saves are written in the background)
            fault.fired.extend(trainer.cluster.pids)
            for pid in fault.fired:
                os.kill(pid, signal.SIGKILL)

    fault.fired = []
    losses, params, rewinds = run_with_fault(
        tmp_path, fault, cluster=workers, trainer_kw={"checkpoint": mpmd.Checkpointing(every=EVERY, memory_every=1)}
    )
    recovery = run_with_fault.trainer.recovery_s
    assert rewinds == 1
    assert recovery["tier"] == "persistent" and recovery["replayed"] == 6 - 2 * EVERY, recovery
    assert_same_run((losses, params), uninterrupted)


def test_slice_on_a_mesh_restores_its_sharded_state_from_its_peer(multi_device_workers, tmp_path):
    """Slices of 2 devices on fsdp=2 (model-width leaves split over the devices, the rest
    replicated): slice 1's worker killed before batch 5 comes back from the packed copy slice 0
    holds (one array per dtype, one row per device, mpmd/train/packing.py) and the run ends
    bitwise equal to the uninterrupted one on the in-process runtime's same meshes."""
    from mpmd.runtime.control.inprocess import InProcessCluster
    from tests.support import recovery_runs

    kw = {"checkpoint": mpmd.Checkpointing(every=50, memory_every=1), "mesh": {"fsdp": 2}}
    with recovery_runs.make_trainer(InProcessCluster(), tmp_path / "whole", **kw) as trainer:
        want = recovery_runs.train(trainer, recovery_runs.data())[:2]
    losses, params, rewinds = run_with_fault(
        tmp_path / "killed", kill_once(5, signal.SIGKILL), cluster=multi_device_workers(2), trainer_kw=kw
    )
    recovery = run_with_fault.trainer.recovery_s
    assert rewinds == 1 and recovery["tier"] == "memory" and recovery["replayed"] == 1, recovery
    assert_same_run((losses, params), want)


def test_full_save_queue_blocks_and_drops_nothing(tmp_path):
    """While the writer cannot write (the process's Orbax lock held here), two saves queue;
    a third blocks until the first is written. All three end finalized on disk."""
    ck = SliceCheckpointer(max_queued=2)
    bundle = (jax.numpy.arange(6.0),)
    dirs = [str(tmp_path / f"step{i}") for i in range(3)]
    with slice_store._ORBAX:
        ck.save({dirs[0]: {"p0": bundle}})
        ck.save({dirs[1]: {"p0": bundle}})
        third = threading.Thread(target=ck.save, args=({dirs[2]: {"p0": bundle}},))
        third.start()
        time.sleep(0.5)
        assert third.is_alive(), "a save into a full queue returned: it was dropped or not queued"
    third.join(timeout=60)
    assert not third.is_alive()
    assert list(ck.wait()) == sorted(dirs)
    for d in dirs:
        got = ck.restore({d: ["p0"]}, lambda name, i: jax.sharding.make_single_device_sharding(jax.devices()[0]))
        assert np.array_equal(got["p0"][0], np.arange(6.0))
    assert all(os.path.isdir(d) for d in dirs)
