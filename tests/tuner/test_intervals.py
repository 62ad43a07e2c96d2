"""The interval search (mpmd/tuner/intervals.py): its pick against Young/Daly where their formula
holds, and a plan of 1,024 slices."""

import math

from mpmd.tuner import goodput as g
from mpmd.tuner import intervals


def test_the_pick_is_near_young_daly_where_their_formula_holds():
    # A save much shorter than the time between failures, no restart cost, no memory tier (two
    # slices on one host): Young's interval sqrt(2 x 10^5 x 10) = 1414 s of 1 s steps.
    costs = g.Costs(1.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    hosts = g.Hosts(num_slices=2, mtbf_s=2e5, slices_per_host=2)  # the job fails every 10^5 s
    plan = intervals.plan(costs, hosts, g.Policy(every=100), wall_s=2e7, trials=32)
    assert plan.young_daly.policy.every == round(math.sqrt(2 * 1e5 * 10))
    assert abs(plan.best.policy.every / plan.young_daly.policy.every - 1) < 0.25
    assert plan.best.goodput >= plan.young_daly.goodput > plan.configured.goodput


def test_1024_slices_with_hot_spares_and_hosts_of_eight():
    hosts = g.Hosts(num_slices=1024, mtbf_s=500 * 3600.0, slices_per_host=8)
    plan = intervals.plan(g.Costs(), hosts, g.Policy(every=200, memory_every=10, hot_spares=8, on_loss="auto"), 86400.0)
    assert plan.failures_per_run > 1 and plan.best.goodput > plan.configured.goodput
    assert plan.best.policy.memory_every == 0  # a host of 8 slices takes every copy with it
