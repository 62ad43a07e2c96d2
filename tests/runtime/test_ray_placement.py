"""How a slot's placement group is shaped (runtime/launchers/ray_placement.py), on the nodes
a Ray cluster reports, and the bounded wait for a Ray address: no Ray needed."""

import time

import pytest

from mpmd.runtime.control.cluster import ClusterUnavailable
from mpmd.runtime.launchers import ray_placement as placement
from mpmd.runtime.launchers.workers import free_port

HEAD = ("10.0.0.1", {"memory": 8e9})  # a head started with --num-cpus=0
ONE = {"CPU": 1.0}


def nodes(*cpus):
    return [(f"10.0.0.{i + 2}", {"CPU": float(c), "memory": 8e9}) for i, c in enumerate(cpus)]


def test_spread_only_over_nodes_that_hold_a_bundle():
    # Four 1-CPU nodes hold a gang of 2 one process per node.
    assert placement.strategy(ONE, 2, [HEAD] + nodes(1, 1, 1, 1)) == "STRICT_SPREAD"
    # The 0-CPU head is a node but holds no bundle: with one 4-CPU node the gang is packed
    # (STRICT_SPREAD there stays pending for ever).
    assert placement.strategy(ONE, 2, [HEAD] + nodes(4)) == "PACK"
    assert placement.strategy({"CPU": 2.0}, 2, [HEAD] + nodes(2, 3)) == "STRICT_SPREAD"
    assert placement.strategy({"CPU": 2.0}, 2, [HEAD] + nodes(1, 3)) is None  # 1 + 0 bundles
    assert placement.strategy({"CPU": 1.0, "GPU": 1.0}, 2, nodes(4)) is None


def test_a_refusal_says_what_is_missing_on_how_many_nodes():
    offers = [HEAD] + nodes(1, 1)
    assert placement.missing(ONE, 3, offers) == "CPU (needs 3 in all, 2 there; 1 of 3 node(s) lack 1)"
    assert (
        placement.describe_offers(offers, ONE)
        == "node 10.0.0.1 {CPU: 0}; node 10.0.0.2 {CPU: 1}; node 10.0.0.3 {CPU: 1}"
    )
    assert placement.describe_offers([], ONE) == "no live node"


def test_an_address_nothing_listens_on_fails_within_the_timeout():
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    t0 = time.monotonic()
    with pytest.raises(
        ClusterUnavailable,
        match=rf"cannot reach the Ray cluster at {address} within "
        rf"connect_timeout_s=1 s \(.*\): check that its head runs",
    ) as e:
        placement.check_reachable(address, 1.0)
    assert time.monotonic() - t0 < 30, "the connection was waited for far longer than connect_timeout_s"
    assert "\n" not in str(e.value)
    placement.check_reachable("auto", 1.0)  # not HOST:PORT: left to ray.init
