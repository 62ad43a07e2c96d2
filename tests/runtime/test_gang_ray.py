"""Gangs on Ray (runtime/launchers/ray.py): each slice a gang of 2 actors in a placement group
of its own, on a local Ray instance. One actor of slice 1 SIGKILLed mid-run: the slice's
placement group is removed and reserved again for a new gang, and the run ends as an
uninterrupted one does (the same checks as tests/runtime/test_gang.py's local gangs)."""

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")

import mpmd  # noqa: E402
from tests.support.processes import wait_gone  # noqa: E402
from tests.support.ray_nodes import RayNodes  # noqa: E402
from tests.runtime.test_gang import lose_one_process_of_slice_1  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # worker processes or a controller (tests/README.md)


def test_an_actor_killed_replaces_its_slices_placement_group(tmp_path, uninterrupted_data2):
    assert not ray.is_initialized()
    nodes = RayNodes(0, head_cpus=4)  # its own process (tests/support/ray_nodes.py)
    try:
        cluster = mpmd.RayCluster(num_workers=2, processes_per_slice=2, failure_timeout_s=3.0, root=str(tmp_path))
        try:
            cluster.start(2, root=str(tmp_path / "run"))
            assert cluster.devices_per_slice == 2 and len(cluster.pids) == 4
            groups = [g.id for g in cluster.placement_groups]
            lose_one_process_of_slice_1(cluster, tmp_path / "run", uninterrupted_data2)
            assert cluster.placement_groups[0].id == groups[0]
            assert cluster.placement_groups[1].id != groups[1], "slice 1's placement group was not replaced"
        finally:
            pids = list(cluster.pids)
            cluster.close()
        assert wait_gone(pids) == [], "gang actors outlived their cluster"
    finally:
        nodes.close()
