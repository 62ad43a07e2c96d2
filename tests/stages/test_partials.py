"""Weight gradients accumulate unreduced over the batch axes and are reduced once a step
(mpmd/stages/partials.py): counted in the compiled programs of one training step's plan.

Equivalence with unpipelined JAX on data / fsdp / tensor meshes, gangs, tied weights,
zero-bubble schedules and clipping is tests/runtime/test_mesh_slices.py's and
tests/runtime/test_gang.py's (their meshes take this path)."""
import jax
import pytest
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import models
from mpmd.runtime.worker.mesh import bind
from mpmd.stages import partials
from mpmd.stages.sharding import SliceMesh
from tests.runtime.test_mesh_slices import make_gpt, sgd
from tests.support import reference
from tests.support.collectives import REDUCTIONS, step_collectives

M = 4


@pytest.mark.parametrize("mesh,schedule", [({"data": 2}, "1f1b"), ({"fsdp": 2}, "zb-h1")], ids=["data2", "fsdp2-zbh1"])
def test_one_reduction_per_parameter_a_step_not_one_per_microbatch(mesh, schedule):
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with mpmd.Trainer(pipe, sgd(), schedule=schedule, num_microbatches=M, max_grad_norm=1.0, mesh=mesh,
                      cluster=mpmd.InProcessCluster()) as trainer:
        trainer.step(*reference.batches()[0])
        lowered = trainer.lowered
        assert lowered.io.partial == (True, True)
        devices = bind(tuple(SliceMesh(**mesh)), jax.devices()[:2])
        for r, fn in enumerate(pipe.fns):
            # reduce{k} reduces each parameter's gradient once; no backward program reduces
            # anything (before: every one of the m backwards reduced every parameter).
            assert step_collectives(lowered, r, devices, REDUCTIONS) == {"reduce": len(fn.param_leaves)}


def test_partial_layout_takes_the_batch_axes_out_of_the_parameter_dims():
    mesh = SliceMesh(data=2, fsdp=2, tensor=2)
    assert partials.partial_layout(P("fsdp", "tensor"), mesh) == P(("data", "fsdp"), None, "tensor")
    assert partials.partial_layout(P(), SliceMesh(data=2)) == P(("data",))
    assert partials.partial_layout(P(("fsdp", "tensor"),), mesh) == P(("data", "fsdp"), "tensor")


def test_stages_that_see_the_whole_microbatch_keep_reducing_per_microbatch():
    """Why a stage keeps the per-microbatch reduction, named."""
    leaf = jax.ShapeDtypeStruct((8, 4), "float32")
    mesh = SliceMesh(data=2)
    assert partials.problem(mesh, [leaf], state=False, aux=False) is None
    assert "stage state" in partials.problem(mesh, [leaf], state=True, aux=False)
    assert "auxiliary losses" in partials.problem(mesh, [leaf], state=False, aux=True)
    assert "batch axis 0 divisible by 2" in partials.problem(mesh, [jax.ShapeDtypeStruct((3, 4), "float32")],
                                                             state=False, aux=False)
    assert "does not split" in partials.problem(SliceMesh(tensor=2), [leaf], state=False, aux=False)
