"""RayCluster across several Ray nodes (runtime/launchers/ray.py, ray_placement.py): a real
head with 0 CPUs and real 1-CPU nodes on this machine (tests/support/ray_nodes.py), one
module-scoped cluster for every test; losing a node is a SIGKILL of its process group.

One slice per node; a node lost with a spare node there is replaced on the spare; without
a spare under on_loss=auto the run shrinks once replace_timeout_s is spent, its checkpoint
boundaries only look at the replacement asked for (never wait), and it grows back once a
node joins; each run ends bitwise as the uninterrupted one. Gangs spread one process per
node only over nodes that hold a bundle (the 0-CPU head does not), else a refusal naming
what is missing. A dead cluster.address ends `mpmd train` with one line.
"""

import logging
import re
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")

import mpmd  # noqa: E402
from mpmd.runtime.control.cluster import ClusterUnavailable  # noqa: E402
from mpmd.runtime.control.rpc import WorkerClient, WorkerError  # noqa: E402
from mpmd.runtime.launchers.workers import free_port  # noqa: E402
from tests.support.processes import TINY_GPT, mpmd_train, wait_gone  # noqa: E402
from tests.support.ray_nodes import RayNodes  # noqa: E402
from tests.support.recovery_runs import EVERY, assert_same_run, run_with_fault  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # real Ray nodes, worker actors, SIGKILL (tests/README.md)


@pytest.fixture(scope="module")
def nodes():
    """A head with 0 CPUs and three 1-CPU nodes; this process is their driver."""
    assert not ray.is_initialized()
    cluster = RayNodes(3)
    yield cluster
    cluster.close()


def ray_cluster(nodes, tmp_path, **kw):
    return mpmd.RayCluster(
        num_workers=2,
        address=nodes.address,
        failure_timeout_s=2.0,
        root=str(tmp_path),
        log_dir=str(tmp_path / "logs"),
        **kw,
    )


def keep_two_nodes(nodes) -> None:
    """The head and two 1-CPU nodes alive, whatever the tests before left (a test also runs
    alone, or after one that failed midway)."""
    while len(nodes.alive()) > 3:
        nodes.kill(nodes.alive()[-1].pid)
    nodes.settle()
    assert len(nodes.alive()) == 3, "fewer than two nodes left by the tests before"


def warn_worker_0(cluster, caplog) -> str:
    """Send slice 0's worker one RPC with a wrong token (it logs a warning); the one console
    line it came back as (logger mpmd.workers)."""
    intruder = WorkerClient(cluster.addresses[0], "not-the-token-0123456789", {"Heartbeat": 0}, tls=cluster.tls)
    try:
        with pytest.raises(WorkerError):
            intruder.call("Heartbeat", timeout_s=10)
    finally:
        intruder.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records if "refused Heartbeat" in r.getMessage()]
        if lines:
            return lines[0]
        time.sleep(0.2)
    raise AssertionError("the worker's warning never reached the console")


class NodeLoss:
    """Before batch `kill_at`: the checkpoint in flight committed, SIGKILL the node (process
    group) of slice 1's worker. Before batch `add_at`: a new node joins, and the run goes on
    once Ray has placed the replacement asked for; before batch `started_at`, once its actor
    started (so the next boundary's look finds it ready). Records every batch's slice count."""

    def __init__(self, nodes, kill_at: int, add_at: int | None = None, started_at: int | None = None):
        self.nodes, self.kill_at, self.add_at, self.started_at = nodes, kill_at, add_at, started_at
        self.fired: list[int] = []
        self.placed: list[int | None] = []  # the node of each slice's worker, at batch 0
        self.slices_seen: list[int] = []
        self.pending_group = None  # the replacement's placement group, as first asked

    def __call__(self, i, trainer):
        cluster = trainer.cluster
        self.slices_seen.append(cluster.num_slices)
        if i == 0 and not self.placed:
            self.placed = [self.nodes.node_of(p) for p in cluster.pids]
        if i == self.kill_at and not self.fired:
            trainer.checkpoints.wait()
            worker = cluster.pids[1]
            self.fired.append(self.nodes.node_of(worker))
            self.nodes.kill(self.fired[0])
            # Ray's workers leave with their raylet, a moment later: gone before the next step.
            assert wait_gone([worker]) == [], "slice 1's worker outlived its node"
        if i == self.add_at:
            assert cluster.num_slices == 1, "the run did not shrink"
            self.pending_group = cluster.launcher.pending[1].group
            self.nodes.add(1)
            assert self.pending_group.wait(60), "Ray did not place the pending replacement on the new node"
        if i == self.started_at:
            assert cluster.launcher.pending[1].advance(0.0, 120.0), "the replacement's actor did not start"


def test_one_slice_per_node_and_a_lost_node_replaced_on_the_spare(nodes, uninterrupted, tmp_path, caplog):
    """2 slices on three 1-CPU nodes: one actor per node (never on the 0-CPU head); slice 1's
    node SIGKILLed after the step 2 checkpoint: a new actor on the spare node, and the run
    ends bitwise as the uninterrupted one. Each actor's output is in its logs/worker_<slot>.log,
    and a worker's warning reaches this console as one line naming the slice and that file."""
    spare = {p.pid for p in nodes.alive()[1:]}
    cluster = ray_cluster(nodes, tmp_path)
    fault = NodeLoss(nodes, kill_at=3)
    caplog.set_level(logging.WARNING, logger="mpmd.workers")
    try:
        got = run_with_fault(
            tmp_path,
            fault,
            cluster=cluster,
            trainer_kw=dict(recovery=mpmd.Recovery(on_loss="replace", replace_timeout_s=60)),
        )
        new_node = nodes.node_of(cluster.pids[1])
        relayed = warn_worker_0(cluster, caplog)
    finally:
        cluster.close()
    log_0 = tmp_path / "logs" / "worker_0.log"
    assert re.fullmatch(
        rf"worker 0 WARNING refused Heartbeat from \S+: wrong token \(see {re.escape(str(log_0))}\)", relayed
    ), relayed
    assert "WARNING refused Heartbeat" in log_0.read_text()  # the worker's own account
    assert_same_run(got, uninterrupted)
    assert None not in fault.placed and len(set(fault.placed)) == 2, fault.placed
    (left,) = spare - set(fault.placed)
    assert new_node == left, "the replacement is not on the spare node"
    for slot in (0, 1):
        assert (tmp_path / "logs" / f"worker_{slot}.log").stat().st_size > 0


def test_no_spare_shrinks_then_grows_back_when_a_node_joins(nodes, uninterrupted, tmp_path):
    """2 slices on the two 1-CPU nodes left, on_loss=auto, replace_timeout_s=3: slice 1's node
    SIGKILLed before step 2, no node to replace it on, so the run goes on on 1 slice once the
    3 s are spent (the replacement stays asked of Ray); the step 2 boundary only looks. A node
    joins, Ray places the replacement asked for (the same placement group), and at the step 4
    boundary the run is on 2 slices again: bitwise the uninterrupted run."""
    keep_two_nodes(nodes)
    cluster = ray_cluster(nodes, tmp_path)
    fault = NodeLoss(nodes, kill_at=1, add_at=2, started_at=3)
    try:
        got = run_with_fault(
            tmp_path,
            fault,
            cluster=cluster,
            trainer_kw=dict(recovery=mpmd.Recovery(on_loss="auto", replace_timeout_s=3)),
        )
        trainer = run_with_fault.trainer
        grown_group = cluster.placement_groups[1]
    finally:
        cluster.close()
    assert_same_run(got, uninterrupted)
    assert [(c["step"], c["num_slices"]) for c in trainer.layout_changes] == [(0, 1), (2 * EVERY, 2)], (
        trainer.layout_changes
    )
    # batches 0-1 on 2 slices, the kill, batches 0-3 again on 1, then 4-7 on 2
    assert fault.slices_seen == [2, 2] + [1] * 4 + [2] * 4, fault.slices_seen
    assert grown_group.id == fault.pending_group.id, "the replacement was asked of Ray more than once"
    # Waited replace_timeout_s for a node, in vain, then shrank; the boundaries' looks cost
    # next to nothing (they were 120 s each): all of it booked as lost to missing capacity.
    goodput = trainer.goodput()
    assert 3.0 <= goodput["capacity_s"] < 3.0 + 30, goodput
    assert goodput["capacity_s"] <= goodput["lost_s"] and goodput["reduced_width_s"] > 0, goodput


def test_gangs_spread_over_nodes_that_hold_a_bundle(nodes, tmp_path):
    """A slice of 2 processes on the head (0 CPUs) and two 1-CPU nodes: STRICT_SPREAD, one
    process per node. A gang of 3 cannot be placed (the head holds no {CPU: 1} bundle): refused
    at once, naming what is missing and what each node offers."""
    keep_two_nodes(nodes)
    cluster = mpmd.RayCluster(num_workers=1, processes_per_slice=2, address=nodes.address, root=str(tmp_path))
    try:
        cluster.start(1)
        assert ray.util.placement_group_table(cluster.placement_groups[0])["strategy"] == "STRICT_SPREAD"
        on = [nodes.node_of(p) for p in cluster.pids]
        assert None not in on and len(set(on)) == 2, on
    finally:
        cluster.close()
    three = mpmd.RayCluster(num_workers=1, processes_per_slice=3, address=nodes.address, root=str(tmp_path))
    with pytest.raises(
        ClusterUnavailable,
        match=r"cannot place 1 slice\(s\) of 3 worker\(s\).*missing CPU "
        r"\(needs 3 in all, 2 there; 1 of 3 node\(s\) lack 1\).*CPU: 0",
    ) as e:
        three.start(1)
    assert "\n" not in str(e.value)
    three.close()


def test_a_dead_address_fails_within_connect_timeout_in_one_line(tmp_path):
    """`mpmd train` on a cluster.address nothing listens on: exit 1, one line naming the
    address and what to check, no traceback."""
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    proc = mpmd_train(
        "configs/gpt_tiny.yaml",
        "cluster.backend=ray",
        f"cluster.address={address}",
        "cluster.connect_timeout_s=2",
        f"run_dir={tmp_path / 'run'}",
        *TINY_GPT,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines[-1].startswith(f"error: cannot reach the Ray cluster at {address} within connect_timeout_s=2 s"), (
        proc.stderr[-3000:]
    )
    assert "ray start --head" in lines[-1] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
