"""Hot spares (runtime/control/spares.py): a SIGKILLed worker's slice is taken over by a warm
spare, the run ends bitwise like an uninterrupted one, the first step after the loss compiles
nothing (the workers' own count of XLA compiles on the step's thread), a new spare is started
to restore the count, and nothing is left running after close(). Also for a slice served by
a gang of two processes, and on workers started by hand (static)."""

import os
import signal
import time

import pytest

import mpmd
from tests.support import recovery_runs
from tests.support.processes import alive, wait_gone

pytestmark = [pytest.mark.slow, pytest.mark.every_jax]  # real worker processes (tests/README.md)

MEMORY = mpmd.Checkpointing(every=recovery_runs.EVERY, memory_every=1)


def wait_for_spares(cluster, count: int, timeout_s: float = 120.0) -> None:
    """Until `count` spares are warm (the one started after a loss: a process to start and
    every slice's programs to compile, on a machine whose cores the run shares)."""
    deadline = time.monotonic() + timeout_s
    while cluster.spares.ready < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.spares.ready == count, f"{cluster.spares.ready} warm spare(s), not {count}"


def first_after_rewind(compiles: list) -> int:
    """The executables compiled in the first step collected after the (one) rewind."""
    return compiles[compiles.index(None) + 1]


def run_and_check(cluster, tmp_path, fault, want, steps=recovery_runs.STEPS, **trainer_kw):
    trainer = recovery_runs.make_trainer(cluster, tmp_path / "run", checkpoint=MEMORY, **trainer_kw)
    try:
        got = recovery_runs.train(trainer, recovery_runs.data(), fault, steps=steps)
        compiles = list(recovery_runs.train.compiles)
        assert got[2] == 1 and trainer.recovery_s["tier"] == "memory"
        recovery_runs.assert_same_run(got[:2], want)
        assert cluster.spares.promoted == 1
        assert compiles[0] > 0, "the first step compiled nothing: the count would show nothing"
        assert first_after_rewind(compiles) == 0, f"compiled after the spare took over: {compiles}"
        wait_for_spares(cluster, 1)  # the count is restored
        pids = list(cluster.pids)
        assert all(alive(p) for p in pids if p not in fault.fired)
    finally:
        trainer.close()
    assert wait_gone(pids + fault.fired) == [], "a worker or spare is still running after close()"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_lost_worker_is_taken_over_by_a_warm_spare(uninterrupted, tmp_path, sig):
    """SIGSTOP: the stopped worker is found hung by its heartbeat probe (long before failure_timeout_s),
    and the spare started in its slot stops it for good (SIGKILL by its pid)."""
    cluster = mpmd.LocalCluster(hot_spares=1, failure_timeout_s=30.0)
    run_and_check(cluster, tmp_path, recovery_runs.kill_once(5, sig), uninterrupted)
    assert cluster.spares.started == 1
    if sig == signal.SIGSTOP:
        assert "lost: hung: its heartbeat unanswered" in recovery_runs.train.rewound[0], recovery_runs.train.rewound


def test_a_gang_slice_is_taken_over_by_a_warm_spare_gang(uninterrupted_data2, tmp_path):
    cluster = mpmd.LocalCluster(num_workers=2, processes_per_slice=2, hot_spares=1, root=str(tmp_path))

    def kill_process_1_of_slice_1(i, trainer):
        if i == 3 and not kill_process_1_of_slice_1.fired:
            victim = trainer.cluster.gang_pids(1)[1]
            kill_process_1_of_slice_1.fired.append(victim)
            os.kill(victim, signal.SIGKILL)

    kill_process_1_of_slice_1.fired = []
    run_and_check(
        cluster,
        tmp_path,
        kill_process_1_of_slice_1,
        uninterrupted_data2,
        steps=recovery_runs.GANG_STEPS,
        mesh={"data": 2},
    )
