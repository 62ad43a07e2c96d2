"""The cluster contract of runtime/control/cluster.py: every backend is a `Cluster`, every launcher a
`Launcher`, and replacement either brings up a new worker or says, with ReplaceUnsupported,
that it cannot.
"""
import importlib.util

import numpy as np
import pytest

import mpmd
from mpmd.runtime.control.client import StaticLauncher, new_token
from mpmd.runtime.control.cluster import Cluster, Launcher, ReplaceUnsupported, WorkerLost
from mpmd.runtime.launchers.local import LocalLauncher
from tests.support.processes import alive, wait_gone

HAVE_RAY = importlib.util.find_spec("ray") is not None


def clusters():
    # Constructing starts nothing: no process, no Ray instance.
    made = [mpmd.InProcessCluster(), mpmd.StaticCluster(["127.0.0.1:1"], token="t"),
            mpmd.LocalCluster(num_workers=2)]
    if HAVE_RAY:
        made.append(mpmd.RayCluster(num_workers=2))
    return made


@pytest.mark.parametrize("cluster", clusters(), ids=lambda c: type(c).__name__)
def test_every_backend_is_a_cluster(cluster):
    assert isinstance(cluster, Cluster)
    assert cluster.num_slices == 0


def test_every_launcher_is_a_launcher():
    launchers = [StaticLauncher(["127.0.0.1:1"]), LocalLauncher(new_token())]
    if HAVE_RAY:
        from mpmd.runtime.launchers.ray import RayLauncher
        launchers.append(RayLauncher(new_token()))
    for launcher in launchers:
        assert isinstance(launcher, Launcher), type(launcher).__name__


def test_worker_lost_is_still_importable_from_client():
    from mpmd.runtime.control import client
    assert client.WorkerLost is WorkerLost is mpmd.WorkerLost


def test_inprocess_slice_cannot_be_replaced():
    cluster = mpmd.InProcessCluster()
    cluster.start(2)
    try:
        with pytest.raises(ReplaceUnsupported, match="in-process slice cannot be replaced"):
            cluster.replace(1)
    finally:
        cluster.close()


def test_static_launcher_hands_out_each_spare_once():
    launcher = StaticLauncher(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    assert launcher.start(2) == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert launcher.replace(0) == "127.0.0.1:3"
    with pytest.raises(ReplaceUnsupported, match="no spare address left"):
        launcher.replace(1)
    with pytest.raises(ValueError, match="3 slices need 3 workers, got 2"):
        StaticLauncher(["127.0.0.1:1", "127.0.0.1:2"]).start(3)


@pytest.mark.slow
def test_local_replace_starts_a_new_live_worker():
    cluster = mpmd.LocalCluster(num_workers=2)
    cluster.start(2)
    pids = list(cluster.pids)
    try:
        old_pid, old_address = pids[1], cluster.addresses[1]
        cluster.replace(1)
        new_pid = cluster.pids[1]
        pids.append(new_pid)
        assert new_pid != old_pid and alive(new_pid)
        assert wait_gone([old_pid]) == [], "the replaced worker is still running"
        assert cluster.clients[1].address == cluster.addresses[1] != old_address
        # The new worker serves its slice.
        cluster.put(1, "x", [np.arange(3, dtype=np.float32)])
        np.testing.assert_array_equal(cluster.get(1, ["x"])["x"][0], np.arange(3, dtype=np.float32))
    finally:
        cluster.close()
    assert wait_gone(pids) == [], "workers outlived their cluster"
