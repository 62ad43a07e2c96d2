"""Checkpoint intervals that maximise goodput: every (checkpoint.every, memory_every) around
Young/Daly's, simulated by mpmd/tuner/goodput.py under the same failures, the best picked.

    plan = intervals.plan(goodput.Costs(), goodput.Hosts(1024, 1000 * 3600), goodput.Policy(every=200), 86400)
    plan.best.policy.every, plan.best.policy.memory_every, plan.best.goodput, plan.young_daly

Young/Daly's interval, sqrt(2 x MTBF x save cost) seconds of work between saves, is first
order in save cost / MTBF: it holds where a save is much shorter than the time between
failures and a restart costs little; it is printed beside as a check. Each tier is given the
failures it serves: the in-memory tier the losses it can restore (a worker host holding one
slice), the persistent tier the others (all of them without the in-memory tier).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from mpmd.tuner.goodput import CAUSES, Costs, Hosts, Policy, Result, check, draw, simulate


class Choice(NamedTuple):
    """A policy's simulated outcome, as means over the trials."""

    policy: Policy
    goodput: float
    goodput_error: float  # the standard error of the mean over trials
    lost_share: dict  # cause -> share of the wall
    failures: float  # per run


class Plan(NamedTuple):
    """What `plan` found: the configured policy's outcome, the best intervals', Young/Daly's
    intervals' (simulated the same way: the check beside), every candidate ranked, and what was
    simulated."""

    configured: Choice
    best: Choice
    young_daly: Choice
    ranked: list
    trials: int
    simulated_wall_s: float
    failures_per_run: float


def young_daly_s(mtbf_s: float, save_s: float) -> float:
    """Young's interval between saves, sqrt(2 * MTBF * save cost) seconds of work: first order in
    save_s / MTBF, the regime where a save is much shorter than the time between failures."""
    return math.sqrt(2.0 * mtbf_s * save_s)


def _young_daly_steps(costs: Costs, hosts: Hosts, memory: bool) -> tuple[int, int | None]:
    """(every, memory_every) by Young/Daly: the persistent tier serves the failures the in-memory
    tier cannot (all of them without it), the in-memory tier the others."""
    share = hosts.memory_share if memory else 0.0
    every_mtbf = hosts.failure_every_s / (1.0 - share) if share < 1 else math.inf
    every = max(round(young_daly_s(every_mtbf, costs.save_s) / costs.step_s), 1)
    if not hosts.memory_share:
        return every, None
    mem_mtbf = hosts.failure_every_s / hosts.memory_share
    return every, max(round(young_daly_s(mem_mtbf, costs.snapshot_s) / costs.step_s), 1)


def _around(center: float, low: float, high: float, ratio: float) -> list[int]:
    """Whole numbers >= 1 from center * low to center * high, a factor `ratio` apart."""
    count = int(round(math.log(high / low) / math.log(ratio)))
    return sorted({max(int(round(center * low * ratio**k)), 1) for k in range(count + 1)})


def _choices(policies: list, out: Result) -> list:
    trials = out.goodput.shape[1]
    return [
        Choice(
            policy,
            float(out.goodput[c].mean()),
            float(out.goodput[c].std() / math.sqrt(trials)),
            {cause: float((out.lost_s[cause][c] / out.wall_s[c]).mean()) for cause in CAUSES},
            float(out.failures[c].mean()),
        )
        for c, policy in enumerate(policies)
    ]


# Work budget: (policies x trials) lanes times failures per run; the time it takes grows with
# both, and a run's goodput is a rate, so a long run with many failures is simulated over a
# window of MAX_FAILURES failures rather than all of it.
LANE_EVENTS = 1_000_000
MAX_FAILURES = 400


def plan(
    costs: Costs, hosts: Hosts, configured: Policy, wall_s: float, seed: int = 0, trials: int | None = None
) -> Plan:
    """The checkpoint.every and memory_every that maximise goodput for a run of wall_s seconds
    under `configured`'s spares and elastic policy, among intervals around Young/Daly's (a
    factor 8 either way, sqrt(2) apart, then 2^(1/8) apart around the best), every candidate
    under the same failures (common random numbers: differences between candidates are not
    the trials' noise)."""
    check(costs, hosts, [configured])
    if not (wall_s > 0 and math.isfinite(wall_s)):
        raise ValueError(f"the wall time must be a finite number of seconds > 0, got {wall_s!r}")
    window = min(wall_s, MAX_FAILURES * hosts.failure_every_s)
    failures = window / hosts.failure_every_s
    e_plain, _ = _young_daly_steps(costs, hosts, memory=False)
    e_mem, m_yd = _young_daly_steps(costs, hosts, memory=True)
    everies = _around(
        math.sqrt(e_plain * e_mem),
        min(e_plain, e_mem) / math.sqrt(e_plain * e_mem) / 8,
        max(e_plain, e_mem) / math.sqrt(e_plain * e_mem) * 8,
        math.sqrt(2),
    )
    memories = [0] + (_around(m_yd, 1 / 8, 8, math.sqrt(2)) if m_yd else [])
    policies = [configured] + [configured._replace(every=e, memory_every=m) for e in everies for m in memories if m < e]
    if trials is None:
        trials = int(min(max(LANE_EVENTS // (len(policies) * max(failures, 1.0)), 8), 256))
    faults = draw(hosts, window, trials, seed)
    choices = _choices(policies, simulate(costs, policies, faults, hosts.num_slices, wall_s=window))
    best = max(choices[1:], key=lambda c: c.goodput)
    fine = [
        configured._replace(every=e, memory_every=m)
        for e in _around(best.policy.every, 2**-0.5, 2**0.5, 2**0.125)
        for m in (_around(best.policy.memory_every, 2**-0.5, 2**0.5, 2**0.125) if best.policy.memory_every else [0])
        if m < e
    ]
    every_yd, memory_yd = _young_daly_steps(costs, hosts, memory=best.policy.memory_every > 0)
    fine.append(configured._replace(every=every_yd, memory_every=memory_yd if best.policy.memory_every else 0))
    choices += _choices(fine, simulate(costs, fine, faults, hosts.num_slices, wall_s=window))
    unique = {(c.policy.every, c.policy.memory_every): c for c in reversed(choices[1:-1])}
    ranked = sorted(unique.values(), key=lambda c: -c.goodput)
    return Plan(choices[0], ranked[0], choices[-1], ranked, trials, window, failures)
