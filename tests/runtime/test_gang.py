"""A slice is a gang of worker processes (runtime/worker/gang.py): 2 slices x 2 processes x 1 device.

Equivalence with plain unpipelined JAX training (SGD with momentum, float32, clipping on,
relative 1e-5, 3 steps) with the slice's mesh on `data` and on `tensor`; and the same run
on "2 processes x 1 device" and "1 process x 2 devices" per slice gives bitwise equal losses
(a reduction over two devices adds the same two numbers in either case).
"""

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import mpmd
from tests.support import reference
from tests.support import recovery_runs
from mpmd.runtime.launchers.workers import free_port
from tests.support.processes import ROOT, wait_gone
from tests.runtime.test_mesh_slices import assert_matches, run

pytestmark = [pytest.mark.slow, pytest.mark.every_jax]  # worker processes or a controller (tests/README.md)


@pytest.fixture(scope="module")
def gang_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gang")


@pytest.fixture(scope="module")
def gang(gang_root):
    cluster = mpmd.LocalCluster(num_workers=2, devices_per_worker=1, processes_per_slice=2, root=str(gang_root))
    yield cluster
    pids = cluster.pids
    cluster.close()
    assert wait_gone(pids) == []


@pytest.fixture(scope="module")
def gang_data2(gang):
    """(losses, grads, params) of the data=2 run, and the RPCs it took (gang is fresh here)."""
    got = run(gang, {"data": 2}, "1f1b", close=False)
    return got, rpcs(gang)


def rpcs(cluster) -> dict:
    return {k: n for k, n in cluster.rpc_counts.items() if k not in ("Heartbeat", "Shutdown")}


def test_gang_data2_matches_unpipelined(gang, gang_data2, unpipelined_gpt):
    assert len(gang.pids) == 4 and gang.devices_per_slice == 2
    assert_matches(gang_data2[0], unpipelined_gpt)


def test_gang_tensor2_matches_unpipelined(gang, unpipelined_gpt):
    assert_matches(run(gang, {"tensor": 2}, "1f1b", close=False), unpipelined_gpt)


def test_gang_fsdp2_gathered_once_a_step_matches_unpipelined(gang, unpipelined_gpt):
    """mesh.fsdp_gather=per_step on gangs: each stage's FSDP-sharded weights, one half on each
    process of the gang, are all-gathered across the two processes once at the step's first
    forward and freed after its last backward; the gradients reduce-scatter back once per
    step. The same training as the unpipelined model, as on one process of 2 devices
    (tests/runtime/test_mesh_slices.py)."""
    assert_matches(run(gang, {"fsdp": 2}, "1f1b", close=False, fsdp_gather="per_step"), unpipelined_gpt)


def test_two_processes_of_one_device_equal_one_process_of_two_bitwise(gang_data2, two_device_workers):
    """Also: the gangs took exactly twice the messages of one process per slice, verb by verb
    (one Run per process per step, nothing per microbatch). The one-process run is the mesh
    tests' (tests/runtime/test_mesh_slices.py, data2-1f1b on workers), made once."""
    (losses, _, _), took = two_device_workers({"data": 2}, "1f1b")
    assert losses == gang_data2[0][0]
    assert gang_data2[1] == {k: 2 * n for k, n in took.items()}


def test_a_gang_that_cannot_form_in_time_is_named_and_stopped():
    cluster = mpmd.LocalCluster(num_workers=1, processes_per_slice=2, start_timeout_s=0.05)
    with pytest.raises(
        RuntimeError,
        match=r"slice 0's gang of 2 processes did not form within "
        r"start_timeout_s=0.05 s: process 0 \(pid \d+\) not ready, "
        r"process 1 \(pid \d+\) not ready",
    ) as error:
        cluster.start(1)
    named = [int(p) for p in re.findall(r"pid (\d+)", str(error.value))]
    assert len(named) == 2 and wait_gone(named) == [], "a process of the gang that did not form is left"
    assert cluster.pids == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_processes_per_slice_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="processes_per_slice must be a positive integer"):
        mpmd.LocalCluster(processes_per_slice=bad)


def test_losing_one_process_loses_its_slice_whose_gang_is_replaced_whole(gang, gang_root, uninterrupted_data2):
    """SIGKILL one process of slice 1 mid-run: its whole gang is torn down and replaced, every
    slice restores the last commit (saved by every process of every gang), and the run ends
    as an uninterrupted one does, bitwise; slice 0 keeps its processes."""
    assert lose_one_process_of_slice_1(gang, gang_root / "run", uninterrupted_data2) == "persistent"


def test_a_replaced_gang_comes_back_from_the_in_memory_tier(gang, gang_root, uninterrupted_data2):
    """The same with checkpoint snapshots in memory every step (mpmd/train/snapshots.py): the new
    gang gets its state from its peer slice's copy, sent gang to gang."""
    assert (
        lose_one_process_of_slice_1(
            gang,
            gang_root / "run_memory",
            uninterrupted_data2,
            checkpoint=mpmd.Checkpointing(every=recovery_runs.EVERY, memory_every=1),
        )
        == "memory"
    )


def lose_one_process_of_slice_1(cluster, run_dir, want, **trainer_kw) -> str:
    """The run above on `cluster` (2 slices, gangs of 2), checked against `want` (the
    uninterrupted run: tests/conftest.py uninterrupted_data2); the tier it recovered from.
    Shared with Ray's gangs."""
    old_gang, other = cluster.gang_pids(1), cluster.gang_pids(0)

    def kill_process_1_of_slice_1(i, trainer):
        if i == 3 and not killed:
            trainer.checkpoints.wait()  # step 2 committed (saves are written in the background)
            killed.append(old_gang[1])
            os.kill(old_gang[1], signal.SIGKILL)

    killed = []
    trainer = recovery_runs.make_trainer(cluster, run_dir, mesh={"data": 2}, **trainer_kw)
    try:
        losses, params, rewinds = recovery_runs.train(
            trainer, recovery_runs.data(), kill_process_1_of_slice_1, steps=recovery_runs.GANG_STEPS
        )
    finally:
        trainer.close(close_cluster=False)
    assert killed and rewinds == 1
    assert wait_gone(old_gang) == [], "a process of the lost gang is still running"
    assert set(cluster.gang_pids(1)).isdisjoint(old_gang) and len(cluster.gang_pids(1)) == 2
    assert cluster.gang_pids(0) == other, "the surviving slice's processes were replaced"
    recovery_runs.assert_same_run((losses, params), want)
    return trainer.recovery_s["tier"]


def test_static_gangs_of_mpmd_worker_processes(gang_data2, tmp_path):
    """Gangs started by hand as on two hosts per slice (`mpmd worker ... --coordinator
    --num-processes 2 --process-id j`), given to StaticCluster as one flat list cut by
    processes_per_slice: the same losses, bitwise, as the local gangs."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789abcdef\n")
    os.chmod(token_file, 0o600)
    procs = []
    try:
        for _ in range(2):  # two slices, each a gang with its own coordinator
            coordinator = f"127.0.0.1:{free_port('127.0.0.1')}"
            procs += [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "mpmd.recipes.cli",
                        "worker",
                        "--listen",
                        "127.0.0.1:0",
                        "--token-file",
                        str(token_file),
                        "--root",
                        str(tmp_path),
                        "--coordinator",
                        coordinator,
                        "--num-processes",
                        "2",
                        "--process-id",
                        str(j),
                    ],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                for j in range(2)
            ]
        lines = [p.stdout.readline() for p in procs]  # ready once its whole gang has joined
        assert all(line.startswith("MPMD_WORKER_READY") for line in lines), lines
        cluster = mpmd.StaticCluster(
            [line.split()[1] for line in lines], token_file=str(token_file), processes_per_slice=2
        )
        assert run(cluster, {"data": 2}, "1f1b", steps=2)[0] == gang_data2[0][0][:2]
        for p in procs:  # closing the cluster shuts every process of every gang down
            assert p.wait(timeout=10) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.parametrize(
    "addresses,k,error",
    [
        ([["a:1", "b:2"], ["c:3"]], None, "the address lists have 1, 2"),
        (["a:1", "b:2", "c:3"], 2, "3 address(es) cannot be cut into gangs of processes_per_slice=2"),
        ([["a:1", "b:2"], ["c:3", "a:1"]], 2, "list a:1 more than once"),
        ([["a:1", "b:2"], "c:3"], None, "mixes single addresses and lists"),
        ([["a:1", "b"]], 2, "address 'b' must be 'host:port'"),
        ([["a:1", "b:2"]], 3, "processes_per_slice=3 but each address list names 2"),
    ],
)
def test_static_gang_addresses_are_checked(addresses, k, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        mpmd.StaticCluster(addresses, token="t" * 32, processes_per_slice=k)


STATIC = ["cluster.backend=static", "cluster.token_file=/secure/token"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["cluster.processes_per_slice=2", 'cluster.addresses=["a:1","b:2","c:3"]'],
            "cluster.addresses: 3 address(es) cannot be cut into gangs of processes_per_slice=2",
        ),
        (['cluster.addresses=[["a:1","b:2"],["c:3"]]'], "cluster.addresses: every slice's gang must have the same"),
        (['cluster.addresses=[["a:1","b:2"],["c:3","d:4"]]'], "processes_per_slice=1 but each address list names 2"),
        (
            ["cluster.processes_per_slice=2", 'cluster.addresses=[["a:1","b:2"]]'],
            "needs cluster.addresses with one gang (the 'host:port' of each of its processes) per slice (2), got 1",
        ),
        (
            ["cluster.backend=inprocess", "cluster.processes_per_slice=2"],
            "cluster.processes_per_slice=2 needs worker processes: cluster.backend 'local', 'static' or 'ray'",
        ),
        (
            ["cluster.processes_per_slice=2", "mesh.data=4"],
            "but a slice has 2 (cluster.devices_per_worker=1 x cluster.processes_per_slice=2)",
        ),
    ],
)
def test_gang_config_errors_name_the_key(overrides, message):
    from mpmd.recipes import config

    with pytest.raises(ValueError, match=re.escape(message)):
        config.load(None, (STATIC if "cluster.backend=inprocess" not in overrides else []) + overrides)


def test_gang_configs_that_are_accepted():
    from mpmd.recipes import config

    grouped = config.load(
        None, STATIC + ["cluster.processes_per_slice=2", 'cluster.addresses=[["a:1","b:2"],["c:3","d:4"]]']
    )
    flat = config.load(None, STATIC + ["cluster.processes_per_slice=2", 'cluster.addresses=["a:1","b:2","c:3","d:4"]'])
    assert len(grouped.cluster.addresses) == 2 and len(flat.cluster.addresses) == 4
    assert (
        config.load(None, ["cluster.processes_per_slice=2"]).slice_shapes() == [{"data": 2, "fsdp": 1, "tensor": 1}] * 2
    )


def test_gang_trains_real_workloads_like_unpipelined_jax(gang):
    """On gangs of 2 processes (data=2): a masked weighted loss, a side input to a middle
    stage, bool and int values across a cut between gangs and an auxiliary loss; then dropout
    and batch statistics (the statistics span both processes' batch shards)."""
    from tests.support import workloads as wl
    from tests.train.test_workloads import assert_equal_to_reference

    data = wl.batches(m=4)
    assert_equal_to_reference(
        wl.pipelined(
            wl.mixed_stages,
            wl.masked_loss,
            data,
            4,
            "interleaved-1f1b",
            cluster=gang,
            virtual_stages=2,
            mesh={"data": 2},
            close=False,
        ),
        wl.reference(wl.mixed_stages, wl.masked_loss, data, 4),
    )
    pairs = wl.float_batches()
    want_losses, want_params, _ = wl.nnx_reference(wl.stateful_stages, wl.square_loss, pairs, 4)
    pipe = mpmd.Pipeline(mpmd.split(wl.NoisyModel(), num_stages=2), wl.square_loss)
    trainer = mpmd.Trainer(pipe, wl.sgd(), schedule="1f1b", num_microbatches=4, mesh={"data": 2}, cluster=gang)
    try:
        losses = [trainer.step(x, y)["loss"] for x, y in pairs]
        params = reference.stage_leaves(trainer.params())
    finally:
        trainer.close(close_cluster=False)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    reference.assert_leaves_close(params, want_params, 1e-5)


def test_a_gang_process_that_leaves_takes_its_peers_with_it(tmp_path):
    """Process 0 of a gang SIGTERMed (as a lapsed lease or a Shutdown would make it leave):
    process 1 follows it at once, through the gang's key-value store, and both leave the
    distributed group together and exit 0; left behind, process 1 would lose the service with
    process 0 and JAX would abort it (runtime/worker/gang.py announce_leaving)."""
    from tests.support.processes import StandaloneWorkers

    with StandaloneWorkers(tmp_path, 2, shared=False, processes_per_slice=2, lease_s=600) as workers:
        workers.procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in workers.procs]
        logs = [log.read_text() for log in workers.logs]
    assert codes == [0, 0], (codes, [log[-2000:] for log in logs])
    assert "shutting down: its gang leaves (process 0: SIGTERM)" in logs[1], logs[1][-2000:]
    assert "did not reach shutdown" not in logs[0], logs[0][-2000:]
