"""Elastic training: a lost worker that gets no replacement (cluster.on_loss), the run on
the survivors, and the way back to the configured slices once workers can start again.

Real worker processes, real SIGKILL, real Orbax. The same stages and microbatches run in
every layout and each stage accumulates its microbatches in the same order, so the losses
must equal an uninterrupted run's (asserted to 1e-6 relative; they come out bitwise here).
"""

import itertools
import math
import os
import signal

import jax
import numpy as np
import optax
import pytest

import mpmd
from mpmd.train import elastic
from mpmd.schedules import core as schedules
from mpmd.schedules import timeline
from mpmd.stages import costs as stage_costs
from mpmd.schedules.simulate import simulate
from mpmd.runtime.control.inprocess import InProcessCluster
from tests.support.processes import wait_gone
from tests.support.recovery_runs import EVERY, data, make_pipe, make_trainer, run_with_fault, train

FOUR = dict(num_stages=4, schedule="1f1b")


@pytest.fixture(scope="module")
def uninterrupted4(tmp_path_factory):
    """The 4-stage run on 4 slices, never interrupted (in-process: the same programs)."""
    with make_trainer(InProcessCluster(), tmp_path_factory.mktemp("ref4"), **FOUR) as trainer:
        losses, params, _ = train(trainer, data())
    return losses, params


def assert_close_run(got, want):
    assert got[0].keys() == want[0].keys()
    np.testing.assert_allclose([got[0][k] for k in sorted(got[0])], [want[0][k] for k in sorted(want[0])], rtol=1e-6)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class Faults:
    """Before batch `kill_at`: wait for the checkpoint in flight to commit, then SIGKILL slice
    1's worker; before batch `capacity_at` (if any): raise the cluster's max_workers by one,
    i.e. capacity comes back. Records the other slices' worker pids at the kill."""

    def __init__(self, kill_at: int, capacity_at: int | None = None):
        self.kill_at, self.capacity_at = kill_at, capacity_at
        self.fired: list[int] = []
        self.survivors: list[int] = []
        self.slices_seen: list[int] = []  # the cluster's slice count before each batch

    def __call__(self, i, trainer):
        self.slices_seen.append(trainer.cluster.num_slices)
        if i == self.kill_at and not self.fired:
            trainer.checkpoints.wait()
            pids = trainer.cluster.pids
            self.survivors = [p for r, p in enumerate(pids) if r != 1]
            self.fired.append(pids[1])
            os.kill(pids[1], signal.SIGKILL)
        if i == self.capacity_at:
            assert all(os.path.exists(f"/proc/{p}") for p in self.survivors), "a survivor was restarted"
            assert [p for r, p in enumerate(trainer.cluster.pids) if r != 1] == self.survivors
            trainer.cluster.max_workers += 1


@pytest.mark.slow
def test_lost_worker_without_replacement_shrinks_then_grows_back(uninterrupted4, tmp_path):
    """on_loss=auto with no worker to be had (max_workers spent): slice 1 of 4 is SIGKILLed
    before step 4, the run restores step 2 onto 3 slices (survivors keep their processes)
    and goes on; capacity returns before step 6, and at the step 6 checkpoint the run is on
    4 slices again. Losses and final parameters equal the uninterrupted 4-slice run's. The
    first step back on the 4-slice layout, one seen before, compiles nothing: every executable
    it builds is loaded from the persistent compilation cache."""
    faults = Faults(kill_at=3, capacity_at=5)
    got = run_with_fault(
        tmp_path,
        faults,
        max_workers=4,
        trainer_kw=dict(**FOUR, recovery=mpmd.Recovery(on_loss="auto", replace_timeout_s=0)),
    )
    trainer = run_with_fault.trainer
    assert_close_run(got, uninterrupted4)
    changes = [(c["step"], c["num_slices"]) for c in trainer.layout_changes]
    assert changes == [(EVERY, 3), (3 * EVERY, 4)], trainer.layout_changes
    built, loaded = train.loads[3 * EVERY + 1]
    assert built > 0 and loaded == built, (built, loaded)
    assert 3 in faults.slices_seen and faults.slices_seen[-1] == 4
    assert trainer.layout_changes[0]["predicted_slowdown"] > 1
    goodput = trainer.goodput()
    assert goodput["failures"] == 1 and goodput["replayed_steps"] == 2 and goodput["layout_changes"] == 2
    assert goodput["reduced_width_s"] > 0 and goodput["lost_s"] > 0


@pytest.mark.slow
def test_shrink_finishes_on_the_survivors(uninterrupted4, tmp_path):
    """on_loss=shrink, no capacity ever, the in-memory tier on: the run restores the
    persistent checkpoint onto 3 slices, rebuilds the in-memory ring over them and ends
    there, with the same losses."""
    faults = Faults(kill_at=5)
    got = run_with_fault(
        tmp_path,
        faults,
        max_workers=4,
        trainer_kw=dict(
            **FOUR, recovery=mpmd.Recovery(on_loss="shrink"), checkpoint=mpmd.Checkpointing(every=EVERY, memory_every=1)
        ),
    )
    trainer = run_with_fault.trainer
    assert_close_run(got, uninterrupted4)
    assert faults.slices_seen[-1] == 3 and trainer.num_slices == 3
    assert trainer.recovery_s["tier"] == "persistent" and trainer.memory.num_slices == 3
    assert trainer.memory.newest().step == 8
    (change,) = trainer.layout_changes
    assert change["step"] == 2 * EVERY and change["num_slices"] == 3
    assert trainer.goodput()["reduced_width_s"] > 0


def _budget_of_two_slices() -> int:
    """The most bytes a slice holds in the 2-slice 1F1B layout: every 1-slice layout needs
    more (1F1B on one slice holds one microbatch's activations, but both stages' state)."""
    micro = jax.ShapeDtypeStruct((4, 32), np.int32)
    per_stage = stage_costs.memory(make_pipe(), optax.adamw(1e-3), micro, micro)
    return max(s["total"] for s in stage_costs.slice_memory(schedules.one_f_one_b(2, 4), per_stage))


@pytest.mark.slow
@pytest.mark.parametrize("on_loss", ["replace", "shrink"])
def test_no_replacement_and_no_fit_stop_naming_slice_and_commit(on_loss, tmp_path):
    """on_loss=replace without a worker to be had, and on_loss=shrink where the survivors'
    memory holds no layout, both stop with an error naming the lost slice and the last
    committed step; no process is left."""
    extra = {"slice_memory_bytes": _budget_of_two_slices()} if on_loss == "shrink" else {}
    cluster = mpmd.LocalCluster(max_workers=2)
    trainer = make_trainer(
        cluster, tmp_path, schedule="1f1b", recovery=mpmd.Recovery(on_loss=on_loss, replace_timeout_s=0, **extra)
    )
    faults = Faults(kill_at=3)
    try:
        with pytest.raises(RuntimeError) as e:
            train(trainer, data(), faults)
        pids = list(cluster.pids)
    finally:
        trainer.close()
    why = "cannot replace it" if on_loss == "replace" else "no layout of the 2 stages on 1 slice"
    assert "slice 1 " in str(e.value) and why in str(e.value), e.value
    assert str(e.value).endswith(f"last committed checkpoint: step {EVERY}"), e.value
    assert wait_gone(pids + faults.fired) == []


def test_bad_elastic_arguments_are_value_errors():
    pipe = make_pipe()
    for kw, what in (
        (dict(on_loss="grow"), "on_loss must be one of"),
        (dict(replace_timeout_s=-1), "replace_timeout_s must be"),
        (dict(replace_timeout_s=math.inf), "replace_timeout_s must be"),
        (dict(slice_memory_bytes=0), "slice_memory_bytes must be"),
    ):
        with pytest.raises(ValueError, match=what):
            mpmd.Recovery(**kw)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_workers must be"):
            mpmd.LocalCluster(max_workers=bad)
    with pytest.raises(ValueError, match="max_workers=1"):  # before any worker starts
        mpmd.Trainer(pipe, optax.sgd(0.1), num_microbatches=2, cluster=mpmd.LocalCluster(max_workers=1))


# -- layouts on fewer slices (pure Python) ----------------------------------------------------
def test_1f1b_over_stage_blocks_is_valid_and_bounded():
    """1F1B with any contiguous block placement validates (no deadlock) and holds at most
    (p - r) x (block size) stage activations on slice r."""
    for S in range(1, 7):
        for p in range(1, S + 1):
            for placement in elastic.block_placements([1.0] * S, p):
                for m in (1, 2, 5):
                    sched = schedules.one_f_one_b(S, m, placement=placement)
                    timeline.validate(sched)
                    peak = simulate(sched).peak_live_activations
                    for r in range(p):
                        assert peak[r] <= (p - r) * placement.count(r), (placement, m, r, peak)
    with pytest.raises(ValueError, match="contiguous blocks"):
        schedules.one_f_one_b(4, 4, placement=(0, 1, 0, 1))


def test_choose_takes_the_fastest_layout_that_fits():
    costs = [1.0, 3.0, 3.0, 1.0]
    found = elastic.candidates(4, 4, 3, costs)
    best = elastic.choose(4, 4, 3, costs)
    assert best.makespan == min(c.makespan for c in found)
    # Memory: per stage as stage_costs.memory gives it; a budget only the 4-slice layout meets.
    per_stage = [{"params": 100, "grads": 100, "optimizer": 200, "residuals": 10, "kept": 0}] * 4
    found = elastic.candidates(4, 4, 3, costs, per_stage)
    least = min(c.peak_bytes for c in found)
    assert elastic.choose(4, 4, 3, costs, per_stage, least).peak_bytes == least
    with pytest.raises(elastic.NoFit, match="no layout of the 4 stages on 3 slice"):
        elastic.choose(4, 4, 3, costs, per_stage, least - 1)


def test_balanced_cut_minimises_the_costliest_block():
    rng = np.random.default_rng(0)
    for S, p in ((6, 3), (7, 2), (8, 5)):
        costs = list(rng.uniform(0.5, 2.0, S))
        block = lambda pl: max(sum(c for c, r in zip(costs, pl) if r == q) for q in range(p))
        brute = min(block(elastic._from_cuts(S, cuts)) for cuts in itertools.combinations(range(1, S), p - 1))
        assert math.isclose(block(elastic._balanced(costs, p)), brute)
    (placement,) = elastic.block_placements([1.0] * 40, 20)  # C(39, 19) cuts: the balanced one
    assert placement == tuple(k // 2 for k in range(40))


def test_inprocess_cluster_remove_and_add_renumber_fresh_slices():
    """The Cluster verbs a shrink and a grow back use, on threads: slices after the removed
    one move down, every slice starts afresh, and add undoes a remove only."""
    from mpmd.runtime.control.cluster import ReplaceUnsupported

    cluster = InProcessCluster()
    cluster.start(3)
    try:
        cluster.put(2, "x", [np.ones(2, np.float32)])
        cluster.remove(1)
        assert cluster.num_slices == 2
        with pytest.raises(Exception, match="x"):  # fresh: nothing stored survives
            cluster.get(1, ["x"])
        cluster.add()
        assert cluster.num_slices == 3
        with pytest.raises(ReplaceUnsupported):
            cluster.add()
    finally:
        cluster.close()


@pytest.mark.slow
def test_a_second_loss_without_replacement_shrinks_again_at_once(uninterrupted4, tmp_path):
    """4 slices, max_workers=4, on_loss=auto with the default 60 s replace timeout: slice 1's
    worker SIGKILLed before step 4, and another as the survivors are being set up on 3
    slices. Neither waits for a replacement that cannot come (max_workers spent), and the
    second, found by the shrink's own Setup, is a lost worker like the first: the run shrinks
    to 2 slices at once and ends with the uninterrupted 4-slice run's losses and parameters;
    goodput books two workers lost."""
    second = []

    def fault(i, trainer):
        if i == 3 and not fault.fired:
            trainer.checkpoints.wait()
            cluster = trainer.cluster
            fault.fired.append(cluster.pids[1])
            remove = cluster.remove

            def killing_remove(*args, **kw):  # the next loss lands in the middle of the first's shrink
                if not second:
                    second.append(cluster.pids[2])
                    os.kill(second[0], signal.SIGKILL)
                    wait_gone(second)
                return remove(*args, **kw)

            cluster.remove = killing_remove
            os.kill(fault.fired[0], signal.SIGKILL)

    fault.fired = []
    got = run_with_fault(
        tmp_path, fault, max_workers=4, trainer_kw=dict(**FOUR, recovery=mpmd.Recovery(on_loss="auto"))
    )
    trainer = run_with_fault.trainer
    assert second and wait_gone(second) == []
    assert_close_run(got, uninterrupted4)
    assert trainer.num_slices == 2, trainer.layout_changes
    goodput = trainer.goodput()
    assert goodput["failures"] == 2, goodput
    assert goodput["replace_s"] < 10, f"waited for a replacement that could not come: {goodput}"
