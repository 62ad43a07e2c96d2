"""The goodput simulator (mpmd/tuner/goodput.py) against runs worked out by hand: no failure, a
loss served by the in-memory tier, a hot spare and its replacement, a loss during a
recovery, a shrink and its grow back; the books adding up; bad input."""

import numpy as np
import pytest

from mpmd.tuner import goodput as g

# Costs that are exact in binary, so the hand-worked walls are exact too.
COSTS = g.Costs(
    step_s=0.5,
    save_s=0.25,
    snapshot_s=0.125,
    detect_s=1.0,
    spawn_s=2.0,
    promote_s=0.5,
    restore_s=4.0,
    memory_restore_s=1.0,
    compile_s=3.0,
)
TIERS = g.Policy(every=10, memory_every=5)
# 100 steps from step 0: 50 s of steps, 10 saves (2.5 s), 20 snapshots (2.5 s).
FAULT_FREE_S = 55.0


def one(policy, faults, **length):
    out = g.simulate(COSTS, [policy], faults, 4, **length)
    lost = {cause: float(v[0, 0]) for cause, v in out.lost_s.items()}
    return float(out.wall_s[0, 0]), float(out.goodput[0, 0]), lost


def test_without_failures_goodput_is_one_less_the_checkpoints_share():
    wall, goodput, lost = one(TIERS, g.trace(4, []), wall_s=FAULT_FREE_S)
    assert goodput == 50.0 / 55.0
    assert lost == dict.fromkeys(g.CAUSES, 0.0) | {"save": 2.5, "snapshot": 2.5}
    wall, goodput, _ = one(TIERS, g.trace(4, []), steps=100)
    assert (wall, goodput) == (55.0, 50.0 / 55.0)
    # Drawn failures that never come (a host failing once in 10^12 h) change nothing either.
    hosts = g.Hosts(num_slices=4, mtbf_s=3.6e15)
    out = g.simulate(COSTS, [TIERS], g.draw(hosts, FAULT_FREE_S, trials=3), 4, wall_s=FAULT_FREE_S)
    assert np.all(out.goodput == 50.0 / 55.0)


def test_a_loss_the_memory_tier_serves_costs_detect_spawn_restore_compile_and_replay():
    # Ten steps take 5.5 s (5 + a save + two snapshots): step 35 ends at 19.125 s, step 36 at
    # 19.625; the loss at 20.1 cuts step 37 after 0.475 s. The newest snapshot is step 35's:
    # steps 36 and the cut part of 37 are replayed (0.975 s). Then 1 + 2 + 1 + 3 s to recover.
    wall, goodput, lost = one(TIERS, g.trace(4, [(20.1, [1])]), steps=100)
    assert wall == pytest.approx(55.0 + 0.975 + 7.0)
    assert goodput == pytest.approx(50.0 / wall)
    want = {"save": 2.5, "snapshot": 2.5, "detect": 1.0, "spawn": 2.0, "restore": 1.0, "compile": 3.0, "replay": 0.975}
    assert lost == pytest.approx(dict.fromkeys(g.CAUSES, 0.0) | want)
    # The same fault given as where it struck: 36 steps done and 0.95 of the 37th.
    by_step = one(TIERS, g.trace(4, [(36.95, [1])], at_step=True), steps=100)
    assert by_step[:2] == pytest.approx((wall, goodput)) and by_step[2] == pytest.approx(lost)
    # A slice lost with its ring peer (slices 1 and 2): the persistent tier's step 30 serves and
    # costs 4 s; steps 31..36 and the cut part of 37 are replayed, step 35's snapshot taken again.
    wall, _, lost = one(TIERS, g.trace(4, [(20.1, [1, 2])]), steps=100)
    assert (lost["restore"], lost["snapshot"]) == (4.0, 2.625)
    assert lost["replay"] == pytest.approx(6 * 0.5 + 0.475)
    assert wall == pytest.approx(55.0 + 0.125 + 3.475 + 1 + 2 + 4 + 3)


def test_a_hot_spare_is_promoted_and_is_ready_again_after_spawn_and_compile():
    spare = TIERS._replace(hot_spares=1)
    # Promoted at 20.1: 1 + 0.5 + 1 s, no spawn, no compile.
    wall, _, lost = one(spare, g.trace(4, [(20.1, [1])]), steps=100)
    assert wall == pytest.approx(55.0 + 0.975 + 2.5)
    assert (lost["promote"], lost["spawn"], lost["compile"]) == (0.5, 0.0, 0.0)
    # A second loss at 24.0, before the new spare is ready (20.1 + 2 + 3 = 25.1): a new worker.
    # The run resumed at 22.6 from step 35: steps 36, 37 done, 0.4 s of 38 cut.
    wall, _, lost = one(spare, g.trace(4, [(20.1, [1]), (24.0, [2])]), steps=100)
    assert wall == pytest.approx(55.0 + 0.975 + 2.5 + 1.4 + 7.0)
    assert (lost["promote"], lost["spawn"], lost["compile"]) == (0.5, 2.0, 3.0)
    # At 26.0 it is ready: promoted again. Steps 36..41 were done and 0.025 s of 42; step 40's
    # snapshot serves: step 41 and the cut part are replayed.
    wall, _, lost = one(spare, g.trace(4, [(20.1, [1]), (26.0, [2])]), steps=100)
    assert wall == pytest.approx(55.0 + 0.975 + 2.5 + 0.525 + 2.5)
    assert (lost["promote"], lost["spawn"]) == (1.0, 0.0)


def test_a_loss_during_a_recovery_starts_it_again_and_its_unrun_part_is_not_counted():
    # The first recovery would end at 27.1; at 21.1 only its detection (1 s) had happened.
    wall, _, lost = one(TIERS, g.trace(4, [(20.1, [1]), (21.1, [3])]), steps=100)
    assert wall == pytest.approx(55.0 + 0.975 + 1.0 + 7.0)
    assert (lost["detect"], lost["spawn"], lost["restore"], lost["compile"]) == pytest.approx((2.0, 2.0, 1.0, 3.0))


def test_a_shrink_runs_narrow_until_the_next_checkpoint_then_moves_back():
    # Every 10 steps take 5.25 s; the loss at 20.1 cuts step 39 (steps 31..38 replayed from step
    # 30's checkpoint: 4.35 s). Relayout (compile 3 s) and restore 4 s; then 3 slices make
    # steps 31..40 at 0.5 x 4 / 3 s each, and at step 40's checkpoint the run moves back onto
    # 4 (restore 4 + compile 3 s).
    shrink = g.Policy(every=10, on_loss="shrink")
    wall, _, lost = one(shrink, g.trace(4, [(20.1, [1])]), steps=100)
    narrow = 10 * (0.5 * 4 / 3 - 0.5)
    assert lost["relayout"] == pytest.approx(3.0 + 7.0)
    assert lost["narrow"] == pytest.approx(narrow)
    assert lost["replay"] == pytest.approx(4.35)
    assert wall == pytest.approx(52.5 + 1.0 + 4.0 + 10.0 + narrow + 4.35)
    # auto shrinks only when a worker would take longer than replace_timeout_s to come.
    waits = g.Policy(every=10, on_loss="auto", replace_wait_s=30.0, replace_timeout_s=5.0)
    _, _, lost = one(waits, g.trace(4, [(20.1, [1])]), steps=100)
    assert lost["capacity"] == 5.0 and lost["relayout"] > 0 and lost["spawn"] == 0.0
    _, _, lost = one(waits._replace(replace_timeout_s=60.0), g.trace(4, [(20.1, [1])]), steps=100)
    assert lost["capacity"] == 30.0 and lost["spawn"] == 2.0 and lost["relayout"] == 0.0


def test_the_lost_time_by_cause_and_the_useful_time_add_up_to_the_wall():
    hosts = g.Hosts(num_slices=64, mtbf_s=2000.0, slices_per_host=2)
    policies = [g.Policy(every=e, memory_every=m, hot_spares=s) for e in (20, 80) for m in (0, 5) for s in (0, 2)]
    out = g.simulate(COSTS, policies, g.draw(hosts, 2000.0, trials=5, seed=1), 64, wall_s=2000.0)
    total = out.goodput * out.wall_s + sum(out.lost_s.values())
    assert np.allclose(total, 2000.0) and np.all(out.failures > 0)
    assert all(np.all(v >= -1e-9) for v in out.lost_s.values())
    # Two slices a host: every loss takes a slice's copy with it, the memory tier never serves.
    assert np.all(out.memory_restores == 0)


def test_bad_input_names_the_field_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"mtbf must be > 0.*got -1"):
        g.draw(g.Hosts(num_slices=4, mtbf_s=-1.0), 100.0, trials=1)
    with pytest.raises(ValueError, match=r"on_loss must be one of replace, shrink, auto, got 'grow'"):
        g.simulate(COSTS, [g.Policy(on_loss="grow")], g.trace(4, []), 4, steps=10)
    with pytest.raises(ValueError, match=r"step_s must be a finite number of seconds > 0, got 0"):
        g.simulate(COSTS._replace(step_s=0), [TIERS], g.trace(4, []), 4, steps=10)
    with pytest.raises(ValueError, match="wall_s or as steps"):
        g.simulate(COSTS, [TIERS], g.trace(4, []), 4)
