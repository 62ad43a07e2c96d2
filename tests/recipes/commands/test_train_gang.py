"""`mpmd train configs/gpt_tiny.yaml cluster.processes_per_slice=2 mesh.data=2` end to end:
4 worker processes (2 slices x a gang of 2), the controller SIGKILLed once a checkpoint is
committed, every worker of every gang gone after it, and the same command resuming to the
end with the per-step losses and final state of an uninterrupted run of the same mesh
(bitwise; the uninterrupted run is the in-process cluster's, 2 devices per slice)."""

import os
import signal
import uuid

import pytest

from mpmd.runtime.worker.slice_store import CheckpointStore
from tests.support import xla
from tests.support.processes import Controller, tiny_gpt_run, wait_gone
from tests.recipes.commands.test_train_resume import TAG, final_state, metrics, tagged

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)

STEPS, EVERY = 6, 2
OVERRIDES = [*tiny_gpt_run(STEPS, EVERY), "mesh.data=2"]
GANG = ["cluster.processes_per_slice=2"]
# Same mesh, one process: the in-process cluster gives each slice 2 of the controller's host devices.
IN_PROCESS = ["cluster.backend=inprocess"]


def controller(run_dir, tag, extra):
    env = {TAG: tag, "XLA_FLAGS": xla.flags(4)}
    return Controller(run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES, *extra], env)


def test_gang_run_killed_then_resumed_equals_an_uninterrupted_run(tmp_path):
    tag = uuid.uuid4().hex
    ctl = controller(tmp_path / "gang", tag, GANG)
    try:
        ctl.wait_for_step(3)
        ctl.wait_for_commit()
        workers = ctl.workers()
        assert len(workers) == 4, workers  # 2 slices x 2 processes
        os.kill(ctl.proc.pid, signal.SIGKILL)
    finally:
        if ctl.proc.poll() is None:
            ctl.proc.kill()
    assert ctl.finish()[0] == -signal.SIGKILL
    assert wait_gone(workers, timeout_s=10.0) == [], "gang processes outlived their SIGKILLed controller"
    killed_at = CheckpointStore(tmp_path / "gang").committed()[-1]
    assert killed_at < STEPS

    out = controller(tmp_path / "gang", tag, GANG).succeed()
    assert f"resumed from {tmp_path / 'gang'}/checkpoints/{killed_at}" in out
    controller(tmp_path / "ref", tag, IN_PROCESS).succeed()
    (got_step, got), (want_step, want) = final_state(tmp_path / "gang"), final_state(tmp_path / "ref")
    assert got_step == want_step == STEPS and got.keys() == want.keys()
    for name in want:
        assert all((a == b).all() for a, b in zip(got[name], want[name])), f"{name} differs"
    got_metrics, want_metrics = metrics(tmp_path / "gang"), metrics(tmp_path / "ref")
    assert [r["step"] for r in got_metrics] == list(range(1, STEPS + 1)), "each step exactly once"
    assert [r["loss"] for r in got_metrics] == [r["loss"] for r in want_metrics]
    assert wait_gone(tagged(tag)) == []
