"""The cluster contract of runtime/control/cluster.py: every backend takes each verb of `Cluster`
as declared and has the attributes it declares, every launcher those of `Launcher`, and replacement either brings up a new worker or says, with ReplaceUnsupported,
that it cannot.
"""

import importlib.util
import inspect

import numpy as np
import pytest

import mpmd
from mpmd.runtime.control.client import new_token
from mpmd.runtime.launchers.static import StaticLauncher
from mpmd.runtime.control.cluster import Cluster, Launcher, ReplaceUnsupported, WorkerLost
from mpmd.runtime.launchers.local import LocalLauncher
from mpmd.runtime.launchers.shared import SharedCluster, SharedLauncher
from mpmd.stages import sharding
from tests.support.processes import alive, wait_gone

HAVE_RAY = importlib.util.find_spec("ray") is not None


def clusters():
    # Constructing starts nothing: no process, no Ray instance, no call to a manager.
    made = [
        mpmd.InProcessCluster(),
        mpmd.StaticCluster(["127.0.0.1:1"], token="t"),
        mpmd.LocalCluster(num_workers=2),
        SharedCluster(address="127.0.0.1:1", submit_token="0" * 32),
    ]
    if HAVE_RAY:
        made.append(mpmd.RayCluster(num_workers=2))
    return made


def launchers():
    made = [StaticLauncher(["127.0.0.1:1"]), LocalLauncher(new_token()), SharedLauncher("127.0.0.1:1", "0" * 32)]
    if HAVE_RAY:
        from mpmd.runtime.launchers.ray import RayLauncher

        made.append(RayLauncher(new_token()))
    return made


def declared(protocol) -> dict:
    """The verbs (functions) and attributes (properties) a protocol declares."""
    return {
        n: v
        for n, v in vars(protocol).items()
        if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))
    }


def shape(fn) -> list:
    """What a caller relies on: each parameter's name, kind and default (not annotations)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cluster", clusters(), ids=lambda c: type(c).__name__)
def test_every_backend_takes_each_verb_as_the_protocol_declares_it(cluster):
    # Not isinstance (a runtime-checkable Protocol checks names only): every verb takes the
    # parameters the protocol names, in its order, kinds and defaults, so a Trainer calling
    # cluster.launch(plan, run, feeds, fetch, trace=...) works on every backend.
    verbs = {n: v for n, v in declared(Cluster).items() if inspect.isfunction(v)}
    assert {"start", "run", "launch", "put", "get", "replace", "remove", "add", "close"} <= set(verbs)
    for name, verb in verbs.items():
        assert shape(getattr(type(cluster), name)) == shape(verb), f"{type(cluster).__name__}.{name}"


@pytest.mark.parametrize("cluster", clusters(), ids=lambda c: type(c).__name__)
def test_every_backend_has_every_attribute_the_trainer_reads(cluster):
    attributes = {n for n, v in declared(Cluster).items() if isinstance(v, property)}
    assert attributes == {"num_slices", "devices_per_slice", "generation_tag"}
    assert cluster.num_slices == 0
    assert isinstance(cluster.generation_tag, str) and cluster.generation_tag.startswith("g")
    expected = {"LocalCluster": 1, "RayCluster": 1}.get(type(cluster).__name__)
    assert cluster.devices_per_slice == expected, type(cluster).__name__


def test_a_cluster_that_starts_its_own_workers_knows_its_slices_devices():
    # What the Trainer checks a mesh against before any worker starts.
    assert mpmd.LocalCluster(devices_per_worker=2, processes_per_slice=2).devices_per_slice == 4
    with pytest.raises(sharding.LayoutError, match="slice 0: mesh .* but each slice has 4"):
        sharding.slice_meshes(
            {"data": 2}, 2, mpmd.LocalCluster(devices_per_worker=2, processes_per_slice=2).devices_per_slice
        )


@pytest.mark.parametrize("launcher", launchers(), ids=lambda c: type(c).__name__)
def test_every_launcher_takes_each_verb_as_the_protocol_declares_it(launcher):
    for name, verb in declared(Launcher).items():
        assert shape(getattr(type(launcher), name)) == shape(verb), f"{type(launcher).__name__}.{name}"
    assert isinstance(launcher.addresses, list)  # the attributes it declares
    assert launcher.readmits is (type(launcher).__name__ == "StaticLauncher")


def test_a_cluster_refuses_an_unknown_transport_naming_those_allowed():
    allowed = "transport must be one of auto, socket, shm"
    with pytest.raises(ValueError, match=allowed + r" \(auto: .*\), got 'tcp'"):
        mpmd.StaticCluster(["127.0.0.1:7001"], token="t" * 32, transport="tcp")
    cluster = mpmd.StaticCluster(["127.0.0.1:7001"], token="t" * 32)
    assert cluster.transport == "auto"
    with pytest.raises(ValueError, match=allowed):
        cluster.transport = "rdma"
    cluster.transport = "shm"  # what the next start asks of the workers
    assert cluster.transport == "shm"


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
    with pytest.raises(ValueError, match="3 workers needed .the slices., and hot spares.., got 2"):
        StaticLauncher(["127.0.0.1:1", "127.0.0.1:2"]).start(3)


@pytest.mark.slow
def test_local_replace_starts_a_new_live_worker(workers):
    # On the session's shared workers (tests/conftest.py), which also checks that closing
    # them, replacement included, leaves no worker.
    cluster = workers
    cluster.start(2)
    old_pid, old_address = cluster.pids[1], cluster.addresses[1]
    cluster.replace(1)
    new_pid = cluster.pids[1]
    assert new_pid != old_pid and alive(new_pid)
    assert wait_gone([old_pid]) == [], "the replaced worker is still running"
    assert cluster.clients[1].address == cluster.addresses[1] != old_address
    # The new worker serves its slice.
    cluster.put(1, "x", [np.arange(3, dtype=np.float32)])
    np.testing.assert_array_equal(cluster.get(1, ["x"])["x"][0], np.arange(3, dtype=np.float32))
