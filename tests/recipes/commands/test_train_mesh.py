"""`mpmd train` on slices of two devices each, end to end through the real CLI.

The controller is a real subprocess with real worker processes (cluster.backend=local), each
worker owning 2 CPU host devices. A data-parallel run (mesh.data=2) whose worker is SIGKILLed
mid-run is repaired by the Trainer (a new worker, the last checkpoint restored) and ends with
the per-step losses of an uninterrupted run, bitwise; its run directory then resumes under a
tensor-parallel mesh (mesh.tensor=2): the mesh is layout, not math, so the resume needs no
--allow-config-change, and its losses follow the uninterrupted data-parallel run's to
float32 rounding (other reduction orders). A mesh that cannot be exits 2 before any worker
starts, naming the product or the parameter.
"""

import os
import re
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from mpmd.recipes.run import run_log
from mpmd.runtime.worker.slice_store import CheckpointStore
from tests.support.processes import Controller, alive, mpmd_train, wait_gone

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)

# The run a worker is killed in, after step KILL_AFTER: by then the save of step EVERY, which
# the save of step 2 x EVERY waits for, is committed.
STEPS, EVERY, KILL_AFTER = 12, 3, 7
MORE_STEPS = 15  # that run resumed under another mesh
OVERRIDES = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.seq_len=32",
    "train.batch_size=8",
    "train.eval_every=0",
    "train.sample_tokens=0",
    f"checkpoint.every={EVERY}",
    "log.progress=lines",
    "log.every=1",
    "log.trace_steps=[]",
    "log.tensorboard=false",
    "data.max_bytes=300000",
    "cluster.backend=local",
    "cluster.devices_per_worker=2",
]
DATA_2 = ["mesh.data=2"]
TENSOR_2 = ["mesh.tensor=2", "mesh.data=1"]


def controller(run_dir: Path, *args: str) -> Controller:
    return Controller(run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES, *args])


def worker_pids(run_dir: Path) -> dict[int, list[int]]:
    """slot -> the pid of every worker process that served it, oldest first, from the line each
    logs when it starts serving (a replacement appends to its slot's log)."""
    return {
        int(log.stem.removeprefix("worker_")): [
            int(p) for p in re.findall(r"worker\[(\d+)\] INFO serving slice", log.read_text())
        ]
        for log in sorted((run_dir / "logs").glob("worker_*.log"))
    }


def all_worker_pids(run_dir: Path) -> list[int]:
    return [p for pids in worker_pids(run_dir).values() for p in pids]


def losses(run_dir: Path, steps: int) -> list[float]:
    records = run_log.read(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "each step exactly once"
    return [r["loss"] for r in records]


def saved_layout(run_dir: Path) -> tuple[set, set]:
    """({mesh shape}, {mesh axes some array is split over}) of the newest committed
    checkpoint, from the layouts Orbax recorded with its arrays."""
    import orbax.checkpoint as ocp

    store = CheckpointStore(run_dir)
    step_dir = store.step_dir(store.committed()[-1])
    shapes, split = set(), set()
    for part in sorted(step_dir.glob("slice_*")):
        with ocp.StandardCheckpointer() as ck:
            meta = ck.metadata(part.resolve()).item_metadata
        for leaf in jax.tree.leaves(getattr(meta, "tree", meta)):
            shapes.add(tuple(zip(leaf.sharding.axis_names, map(int, leaf.sharding.shape))))
            for entry in leaf.sharding.partition_spec:
                split.update((entry,) if isinstance(entry, str) else entry or ())
    return shapes, split


# A slice's mesh has four axes (data, fsdp, tensor, expert): Orbax records all of them.
ON_DATA_2 = {(("data", 2), ("fsdp", 1), ("tensor", 1), ("expert", 1))}
ON_TENSOR_2 = {(("data", 1), ("fsdp", 1), ("tensor", 2), ("expert", 1))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The uninterrupted data-parallel run's per-step losses, MORE_STEPS of them."""
    run_dir = tmp_path_factory.mktemp("mesh") / "reference"
    controller(run_dir, *DATA_2, f"train.steps={MORE_STEPS}").succeed()
    assert wait_gone(all_worker_pids(run_dir)) == []
    return losses(run_dir, MORE_STEPS)


def test_worker_sigkill_recovers_bitwise_then_resumes_tensor_parallel(reference, tmp_path):
    run_dir = tmp_path / "killed"
    ctl = controller(run_dir, *DATA_2, f"train.steps={STEPS}")
    try:
        ctl.wait_for_step(KILL_AFTER)
        ctl.wait_for_commit()  # a checkpoint to recover from (saves commit in the background)
        victim = worker_pids(run_dir)[1][-1]
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        ctl.proc.kill()  # its workers follow it (their stdin closes)
        raise
    out = ctl.succeed()
    m = re.search(r"recovered: .*resuming after step (\d+)", out)
    assert m, f"the Trainer did not recover from the killed worker:\n{out}"
    assert int(m.group(1)) % EVERY == 0 and EVERY <= int(m.group(1)) < STEPS, "not restored from a checkpoint"
    pids = worker_pids(run_dir)
    assert len(pids[0]) == 1 and pids[1][0] == victim and len(pids[1]) == 2, f"slot 1 not replaced: {pids}"
    assert not alive(victim) and wait_gone(all_worker_pids(run_dir)) == []
    assert losses(run_dir, STEPS) == reference[:STEPS]
    # The first step after compiles nothing: every executable the replacement's 2-device mesh
    # needs is loaded from the persistent compilation cache its predecessor filled.
    after = next(r for r in run_log.read(run_dir) if "recovered" in r)
    assert after.get("compiles", 0) == after.get("cache_loads", 0), after
    assert saved_layout(run_dir) == (ON_DATA_2, set())  # data-parallel: parameters replicated

    # The same run directory on a tensor-parallel mesh: the checkpoint is laid out anew.
    out = controller(run_dir, *TENSOR_2, f"train.steps={MORE_STEPS}").succeed()
    assert f"resumed from {run_dir}/checkpoints/{STEPS}\n" in out, out
    got = losses(run_dir, MORE_STEPS)
    assert got[:STEPS] == reference[:STEPS]
    np.testing.assert_allclose(got[STEPS:], reference[STEPS:], rtol=1e-5)
    assert saved_layout(run_dir) == (ON_TENSOR_2, {"tensor"})
    assert wait_gone(all_worker_pids(run_dir)) == []


@pytest.mark.parametrize(
    "mesh, message",
    [
        (["mesh.tensor=3"], "error: mesh: data=1 x fsdp=1 x tensor=3 = 3 devices, but cluster.devices_per_worker=2"),
        (
            ["mesh.tensor=2", "mesh.data=1", "model.vocab_size=257"],
            (
                "error: mesh: parameter layers/0/token/embedding of stage 0: dimension 257 ('vocab') is not "
                "divisible by mesh axis tensor=2"
            ),
        ),
    ],
    ids=["product", "parameter"],
)
def test_bad_mesh_exits_2_before_any_worker_starts(tmp_path, mesh, message):
    run_dir = tmp_path / "never"
    proc = mpmd_train("configs/gpt_tiny.yaml", *OVERRIDES, *mesh, f"run_dir={run_dir}")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    # Workers log to <run_dir>/logs from their start; no run directory, no worker.
    assert not run_dir.exists()
