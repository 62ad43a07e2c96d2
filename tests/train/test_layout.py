"""One function checks a run's layout (mpmd/train/layout.py): the Trainer, the recipe's config
check and dry run all call it, and a layout made once can be handed to the Trainer."""

import numpy as np
import optax
import pytest

import mpmd
from mpmd.stages.sharding import LayoutError, SliceMesh
from mpmd.train.layout import run_layout
from tests.support import reference
from tests.support.recovery_runs import make_pipe


def _losses(trainer, steps=1):
    with trainer:
        return [trainer.step(x, y)["loss"] for x, y in reference.batches()[:steps]], trainer.params()


def test_a_layout_made_once_trains_as_the_same_arguments_do():
    """Trainer(layout=run_layout(...)) and Trainer(schedule=..., mesh=...) lay the run out alike
    and train it bitwise alike (1F1B over 2 slices on data=2 meshes)."""
    pipe, sgd = make_pipe(), optax.sgd(0.1, momentum=0.9)
    args = dict(schedule="1f1b", num_microbatches=2, mesh={"data": 2})
    run = run_layout(pipe, sgd, **args)
    assert run.schedule.num_slices == 2 and run.placement == (0, 1)
    assert run.meshes == (SliceMesh(data=2), SliceMesh(data=2))
    by_layout = mpmd.Trainer(pipe, sgd, layout=run)
    assert by_layout.programs.layout == run.layout and by_layout.schedule == run.schedule
    got, got_params = _losses(by_layout)
    want, want_params = _losses(mpmd.Trainer(make_pipe(), sgd, **args))
    assert got == want
    for a, b in zip(reference.stage_leaves(got_params), reference.stage_leaves(want_params)):
        np.testing.assert_array_equal(a, b)


def test_a_layout_and_what_it_says_are_not_both_given():
    pipe, sgd = make_pipe(), optax.sgd(0.1)
    run = run_layout(pipe, sgd, num_microbatches=2)
    with pytest.raises(ValueError, match="give layout= or schedule, mesh, not both"):
        mpmd.Trainer(pipe, sgd, layout=run, schedule="gpipe", mesh={"data": 1})
    with pytest.raises(ValueError, match="layout is for 2 stages, the pipeline has 4"):
        mpmd.Trainer(make_pipe(num_stages=4), sgd, layout=run)
    with pytest.raises(ValueError, match="layout must be what mpmd.train.layout.run_layout returns"):
        mpmd.Trainer(pipe, sgd, layout=run.layout)


def test_the_layout_names_what_does_not_fit():
    pipe, sgd = make_pipe(), optax.sgd(0.1)
    with pytest.raises(LayoutError, match=r"mesh lists 3 slice shape\(s\) but the schedule has 2"):
        run_layout(pipe, sgd, num_microbatches=2, mesh=[{"data": 1}] * 3)
    with pytest.raises(ValueError, match=r"num_stages \(2\) must be divisible by virtual_stages \(3\)"):
        run_layout(pipe, sgd, schedule="interleaved-1f1b", virtual_stages=3)
    with pytest.raises(LayoutError, match="no slice has fsdp > 1"):
        run_layout(pipe, sgd, num_microbatches=2, mesh=mpmd.Mesh({"data": 2}, fsdp_gather="per_step"))
    # A cluster whose slices have another device count than the layout's meshes.
    run = run_layout(pipe, sgd, num_microbatches=2, mesh={"data": 2})
    run.check_devices(2)
    with pytest.raises(LayoutError, match="slice 0: mesh"):
        run.check_devices(4)
