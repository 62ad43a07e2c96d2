"""RayCluster: workers as real Ray actors on a real (local, loopback) Ray instance.

They must train exactly like the in-process cluster; an actor killed under a running Trainer
must be noticed (by the failed RPC at once, by the heartbeat when idle) and replaced by a
new actor in its slot, after which training goes on exactly as if nothing had happened.
"""

import os
import re
import signal
import sys
import time

import optax
import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")

from mpmd import models  # noqa: E402
import mpmd  # noqa: E402
from tests.support import reference  # noqa: E402
from tests.support.processes import TINY_GPT, alive, mpmd_train, wait_gone  # noqa: E402
from tests.support.ray_nodes import RayNodes  # noqa: E402
from tests.support.reference import assert_same, batches, make_gpt, train_pipeline as train  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # worker processes or a controller (tests/README.md)


def make_pipeline():
    return mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)


def make_trainer(cluster):
    return mpmd.Trainer(make_pipeline(), optax.adamw(1e-3), schedule="1f1b", num_microbatches=4, cluster=cluster)


def train_steps(trainer, data):
    losses = [trainer.step(x, y)["loss"] for x, y in data]
    return losses, reference.stage_leaves(trainer.params())


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance of 4 CPUs (tests/support/ray_nodes.py: started in its own process),
    this process its driver."""
    assert not ray.is_initialized()
    nodes = RayNodes(0, head_cpus=4)
    yield
    nodes.close()


@pytest.fixture(scope="module")
def cluster(ray_instance):
    c = mpmd.RayCluster(num_workers=2, failure_timeout_s=3.0)
    c.start(2)
    yield c
    pids = list(c.pids)
    c.close()
    assert ray.is_initialized(), "RayCluster shut down a Ray instance it did not start"
    assert wait_gone(pids) == [], "worker actors outlived their cluster"


@pytest.fixture(scope="module")
def inprocess():
    return train(make_pipeline, "1f1b", 4, 1, mpmd.InProcessCluster(), batches())


def test_same_as_inprocess(cluster, inprocess):
    assert all(a.startswith("127.0.0.1:") for a in cluster.addresses), cluster.addresses
    trainer = make_trainer(cluster)
    try:
        assert_same(train_steps(trainer, batches()), inprocess)
    finally:
        trainer.close(close_cluster=False)
    assert cluster.rpc_counts["Run"] > 0


def kill(cluster, i):
    address, pid = cluster.addresses[i], cluster.pids[i]
    ray.kill(cluster.actors[i], no_restart=True)
    assert wait_gone([pid]) == []
    return address, pid


def test_killed_actors_are_detected_and_replaced(cluster, inprocess):
    trainer = make_trainer(cluster)
    data = batches()
    try:
        trainer.step(*data[0])
        # Killed between steps: the next step's RPC fails at once (or, first, a heartbeat's
        # probe: its connection refused).
        address, pid = kill(cluster, 0)
        lost = rf"slice 0 \(worker {re.escape(address)}\) lost: (UNAVAILABLE|hung)"
        with pytest.raises(mpmd.Rewound, match=lost) as e:
            trainer.step(*data[1])
        assert e.value.step == 0  # no checkpoint: back to the initial state
        assert cluster.pids[0] != pid and alive(cluster.pids[0])
        assert cluster.addresses[0].startswith("127.0.0.1:")

        # Killed while idle: the heartbeat declares it lost after failure_timeout_s (or its
        # probe sooner).
        address, pid = kill(cluster, 1)
        deadline = time.monotonic() + cluster.failure_timeout_s + 5.0
        while cluster.lost_slice() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        lost = cluster.lost_slice()
        assert lost is not None and lost[0] == 1 and ("no answer for" in lost[1] or "hung" in lost[1]), lost
        with pytest.raises(mpmd.Rewound, match=rf"slice 1 \(worker {re.escape(address)}\) lost: (no answer|hung)"):
            trainer.step(*data[0])
        assert cluster.pids[1] != pid and alive(cluster.pids[1])
        assert cluster.lost_slice() is None

        # Two new actors later, training from the start is exactly the uninterrupted run.
        assert_same(train_steps(trainer, data), inprocess)
    finally:
        trainer.close(close_cluster=False)


def test_a_sigtermed_actor_is_a_lost_worker(cluster, inprocess):
    """An actor's process sent SIGTERM (Ray's own stop, a node drained, a spot VM reclaimed)
    is a lost worker, as a SIGKILLed one: replaced by a new actor, and training from the start
    is exactly the uninterrupted run."""
    trainer = make_trainer(cluster)
    data = batches()
    try:
        trainer.step(*data[0])
        address, pid = cluster.addresses[1], cluster.pids[1]
        os.kill(pid, signal.SIGTERM)
        assert wait_gone([pid]) == []
        with pytest.raises(mpmd.Rewound, match=rf"slice 1 \(worker {re.escape(address)}\) lost"):
            trainer.step(*data[1])
        assert cluster.pids[1] != pid and alive(cluster.pids[1])
        assert_same(train_steps(trainer, data), inprocess)
    finally:
        trainer.close(close_cluster=False)


def test_without_ray_says_how_to_install(monkeypatch):
    from mpmd.recipes import config
    from mpmd.recipes.run import build

    cfg = config.load(None, ["cluster.backend=ray"])
    assert isinstance(build.build_cluster(cfg), mpmd.RayCluster)  # the recipe's arguments fit
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ray\]'"):
        mpmd.RayCluster(num_workers=2)
    # An ImportError only (not a ValueError posing as a bad value): callers that want a
    # friendly message catch RayMissingError by name.
    from mpmd.runtime.launchers.ray import RayMissingError

    assert not issubclass(RayMissingError, ValueError)
    # The recipe reports it as a bad choice of cluster.backend, naming the install command.
    with pytest.raises(
        config.ConfigError,
        match=r"cluster\.backend='ray'.*RayCluster needs Ray.*"
        r"pip install -e '\.\[ray\]'",
    ):
        build.build_cluster(cfg)


def test_bad_arguments_fail_before_ray_starts():
    with pytest.raises(ValueError, match="resources_per_worker must map resource names to amounts"):
        mpmd.RayCluster(resources_per_worker={"GPU": -1})
    with pytest.raises(ValueError, match="devices_per_worker must be a positive integer"):
        mpmd.RayCluster(devices_per_worker=0)
    with pytest.raises(ValueError, match="gpus=True reserves devices_per_worker=2 GPU"):
        mpmd.RayCluster(devices_per_worker=2, gpus=True, resources_per_worker={"GPU": 1})


def test_mpmd_train_on_ray_gives_the_local_losses(tmp_path):
    """`mpmd train ... cluster.backend=ray` and `cluster.backend=local`: the same per-step
    losses, bit for bit (actors are pinned like local workers, so they compute alike)."""
    import json

    losses = {}
    for backend in ("local", "ray"):
        run_dir = tmp_path / backend
        proc = mpmd_train(
            "configs/gpt_tiny.yaml",
            f"cluster.backend={backend}",
            "train.steps=4",
            "train.eval_every=0",
            "train.sample_tokens=0",
            "log.trace_steps=[]",
            f"run_dir={run_dir}",
            *TINY_GPT,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[backend] = [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["local"]) == 4
    assert losses["ray"] == losses["local"]


def test_a_hot_spare_actor_takes_a_killed_actors_slice_without_compiling(ray_instance, inprocess):
    """cluster.hot_spares on Ray: a third actor, warmed; the killed actor's slice goes to it, its
    first step compiles nothing, and a new spare actor restores the count."""
    # Half a CPU each: beside the module's cluster (2 actors of one), within the 4 Ray was given.
    cluster = mpmd.RayCluster(num_workers=2, hot_spares=1, resources_per_worker={"CPU": 0.5})
    trainer = make_trainer(cluster)
    data = batches()
    try:
        trainer.step(*data[0])
        deadline = time.monotonic() + 120
        while cluster.spares.ready < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        spare_pid = cluster.pids[2]
        kill(cluster, 1)
        with pytest.raises(mpmd.Rewound, match=r"slice 1 \(worker .*\) lost"):
            trainer.step(*data[1])
        assert cluster.slot_of(1) == 2 and cluster.pids[2] == spare_pid and cluster.spares.promoted == 1
        first = trainer.step(*data[0])  # from the initial state again (no checkpoint)
        assert "compiles" not in first and first["loss"] == inprocess[0][0], first
        while cluster.spares.ready < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.spares.started == 1 and alive(cluster.pids[1])
        assert_same(train_steps(trainer, data[1:]), (inprocess[0][1:], inprocess[1]))
        pids = list(cluster.pids)
    finally:
        trainer.close()
    assert wait_gone(pids) == [], "a worker or spare actor outlived its cluster"
