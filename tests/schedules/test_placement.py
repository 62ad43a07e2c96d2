"""Placement is data: a schedule carries stage -> slice, and everything downstream reads it."""

import numpy as np
import optax
import pytest
from flax import nnx

from mpmd import models
import mpmd
from mpmd.lowering import core as lowering
from mpmd.schedules import core as schedules
from mpmd.schedules import timeline
from mpmd.schedules.core import ScheduleError
from mpmd.schedules.simulate import simulate
from mpmd.runtime.worker.instructions import Recv, Send, Spec
from tests.support import reference

VOCAB, D, HEADS, BLOCKS, SEQ, BATCH, M = 32, 16, 2, 2, 8, 8, 4


def make_gpt():
    return models.GPT(VOCAB, D, HEADS, BLOCKS, SEQ, rngs=nnx.Rngs(0))


def batches(steps=3):
    rng = np.random.default_rng(3)
    return [
        (rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32), rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
        for _ in range(steps)
    ]


def sgd():
    return optax.sgd(0.1, momentum=0.9)


def test_v_placement_goes_down_and_back_up():
    assert schedules.v_placement(4, 2) == (0, 1, 1, 0)
    assert schedules.v_placement(6, 3) == (0, 1, 2, 2, 1, 0)
    assert schedules.loop_placement(6, 3) == (0, 1, 2, 0, 1, 2)
    assert schedules.make("interleaved-1f1b", 6, 6, 2).placement == (0, 1, 2, 0, 1, 2)
    assert schedules.make("1f1b", 3, 4).placement == (0, 1, 2)


def test_gpipe_on_a_v_runs_and_matches_unpipelined():
    # Four stages (embedding, two blocks, head) on two slices as a V: slice 0 holds the first
    # and the last stage, slice 1 the two middle ones.
    schedule = schedules.gpipe(4, M, placement=schedules.v_placement(4, 2))
    assert schedule.num_slices == 2 and schedule.stages_on(0) == (0, 3) and schedule.virtual_stages == 2
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=4), models.lm_loss)
    data = batches()
    ref_losses, _, ref_params = reference.train(make_gpt, models.lm_loss, data, sgd(), max_grad_norm=1.0)
    with mpmd.Trainer(
        pipe, optimizer=sgd(), schedule=schedule, max_grad_norm=1.0, cluster=mpmd.InProcessCluster()
    ) as trainer:
        assert trainer.num_slices == 2 and trainer.placement == (0, 1, 1, 0)
        # Forward-only plans follow the same placement.
        assert trainer.evaluate(*data[0]) == pytest.approx(ref_losses[0], rel=1e-5)
        losses = [trainer.step(x, y)["loss"] for x, y in data]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        reference.assert_leaves_close(reference.stage_leaves(trainer.params()), ref_params, rtol=1e-5)
        low = trainer.lowered
    # The turn of the V is local: stage 1 -> 2 needs no transfer, 0 -> 1 and 2 -> 3 do.
    keys = {i.key.split("/")[0] for stream in low.train for i in stream if isinstance(i, (Send, Recv))}
    assert {"act1", "act3", "grad0", "grad2"} <= keys and not {"act2", "grad1"} & keys
    assert set(low.programs[0]) >= {"fwd0", "fwd3", "update0", "update3"}
    assert not {"fwd1", "fwd2"} & set(low.programs[0])


def test_a_permuted_placement_moves_every_stage():
    # Same schedule, slices swapped: stage 0 on slice 1. Streams swap with it.
    base = schedules.make("1f1b", 2, 4)
    swapped = base._replace(slices=base.slices[::-1], placement=(1, 0))
    timeline.validate(swapped)
    act = [(Spec((4,), "float32"),)] * 3
    plain = lowering.Transfers.plain(act)
    a, b = lowering.train_streams(base, plain, False), lowering.train_streams(swapped, plain, False)
    flip = lambda ins: ins._replace(**{f: 1 - getattr(ins, f) for f in ("dst", "src") if hasattr(ins, f)})
    assert b == [[flip(i) for i in stream] for stream in a[::-1]]
    assert simulate(swapped).makespan == simulate(base).makespan


@pytest.mark.parametrize(
    "placement,match",
    [
        ((0, 1, 1), "placement to give a slice index >= 0 for each of the 4 stages"),
        ((0, -1, 1, 0), "placement to give a slice index"),
        ((0, 2, 2, 0), r"leaves slice\(s\) \[1\] without a stage"),
    ],
)
def test_bad_placement_is_refused(placement, match):
    with pytest.raises(ValueError, match=match):
        schedules.gpipe(4, 2, placement=placement)


def test_validator_reads_the_placement():
    schedule = schedules.gpipe(4, 2, placement=(0, 1, 1, 0))
    with pytest.raises(
        ScheduleError,
        match=r"wrong slice: F\(stage=3, mb=0\) at slice 0, position 2; "
        r"stage 3 belongs on slice 1",
    ):
        timeline.validate(schedule._replace(placement=(0, 0, 1, 1)))
    with pytest.raises(ScheduleError, match=r"placement \(0, 1, 5, 0\) must give each"):
        timeline.validate(schedule._replace(placement=(0, 1, 5, 0)))


def test_trainer_checks_a_given_schedule_against_its_pipeline():
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=4), models.lm_loss)
    schedule = schedules.gpipe(4, M, placement=schedules.v_placement(4, 2))
    with pytest.raises(ValueError, match="num_microbatches=8 disagrees with the given schedule's num_microbatches=4"):
        mpmd.Trainer(pipe, optimizer=sgd(), schedule=schedule, num_microbatches=8)
    with pytest.raises(ValueError, match="is for 2 stages, the pipeline has 4"):
        mpmd.Trainer(pipe, optimizer=sgd(), schedule=schedules.make("1f1b", 2, 4))
