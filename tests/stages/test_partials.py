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
from mpmd.stages import names, partials
from mpmd.stages.sharding import SliceMesh
from tests.runtime.test_mesh_slices import make_gpt, sgd
from tests.support import reference
from tests.support.collectives import REDUCTIONS, compile_program, step_collectives

M = 4


# Arrays reduced per stage a step: data=2, every f32 gradient in one buffer; fsdp=2, one for
# the leaves split over fsdp (along whichever dim) and one for those it leaves whole.
@pytest.mark.parametrize(
    "mesh,schedule,buffers",
    [({"data": 2}, "1f1b", 1), pytest.param({"fsdp": 2}, "zb-h1", 2, marks=(pytest.mark.slow, pytest.mark.every_jax))],
    ids=["data2", "fsdp2-zbh1"],
)
def test_one_reduction_a_step_not_one_per_microbatch(mesh, schedule, buffers):
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with mpmd.Trainer(
        pipe,
        sgd(),
        schedule=schedule,
        num_microbatches=M,
        max_grad_norm=1.0,
        mesh=mesh,
        cluster=mpmd.InProcessCluster(),
    ) as trainer:
        trainer.step(*reference.batches()[0])
        lowered = trainer.lowered
        assert lowered.io.partial == (True, True)
        devices = bind(tuple(SliceMesh(**mesh)), jax.devices()[:2])
        for r, fn in enumerate(pipe.fns):
            # reduce{k} reduces the stage's gradients once, packed into a buffer per dtype and
            # layout; no backward program reduces anything (before: every one of the m
            # backwards reduced every parameter, and reduce{k} each parameter on its own).
            assert len(fn.param_leaves) > 10
            assert step_collectives(lowered, r, devices, REDUCTIONS) == {"reduce": buffers}


@pytest.mark.parametrize("mesh", [{"data": 2}, {"fsdp": 2}, {"data": 2, "tensor": 2}, {"data": 2, "fsdp": 2}])
def test_packed_reduction_equals_each_leaf_summed_bitwise(mesh):
    """reduced(..., layouts) sums leaves packed by dtype and layout, split along any one dim
    or none (plus a 0-d leaf, a bf16 one and one split along two dims, reduced alone): the
    same numbers, in the same layouts, as each partial summed on its own."""
    import numpy as np
    from jax.sharding import NamedSharding

    sm = SliceMesh(**mesh)
    devices = bind(tuple(sm), jax.devices()[: sm.size])
    two = P("fsdp" if sm.fsdp > 1 else None, "tensor" if sm.tensor > 1 else None)
    leaves = [
        ((12, 8), "float32", P()),
        ((12, 8), "float32", P("fsdp")),
        ((8, 12), "float32", P(None, "fsdp")),
        ((4, 8, 6), "float32", P(None, "tensor")),
        ((8,), "float32", P("tensor")),
        ((), "float32", P()),
        ((6, 4), "bfloat16", P()),
        ((4, 6), "bfloat16", P()),
        ((8, 8), "float32", two),
    ]
    layouts = [P(*(e if e is None or getattr(sm, e) > 1 else None for e in lay)) for _, _, lay in leaves]
    rng = np.random.default_rng(0)
    specs = partials.partial_specs(
        tuple(
            jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(sm.abstract(), lay))
            for (shape, dtype, _), lay in zip(leaves, layouts)
        ),
        sm,
    )
    args = [
        jax.device_put(rng.normal(size=s.shape).astype(s.dtype), NamedSharding(devices, s.sharding.spec)) for s in specs
    ]
    outs = tuple(NamedSharding(devices, lay) for lay in layouts)
    packed = jax.jit(lambda g: partials.reduced(g, layouts, sm), out_shardings=outs)(args)
    alone = jax.jit(partials.reduced, out_shardings=outs)(args)
    for p, a in zip(packed, alone):
        assert p.sharding.spec == a.sharding.spec and p.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(p), np.asarray(a))


@pytest.mark.parametrize("mesh", [{"data": 2}, {"data": 2, "tensor": 2}], ids=["data2", "data2-tensor2"])
def test_a_grouped_forward_stores_each_group_on_its_own_device(mesh):
    """Every residual a grouped forward stores, (n, ...), lies group g on device g, the
    batch-independent ones too (an attention mask broadcast per group: left to XLA it came
    out replicated, each device holding every group's copy)."""
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with mpmd.Trainer(pipe, sgd(), num_microbatches=M, mesh=mesh, cluster=mpmd.InProcessCluster()) as trainer:
        trainer.step(*reference.batches()[0])
        lowered = trainer.lowered
    sm = SliceMesh(**mesh)
    devices = bind(tuple(sm), jax.devices()[: sm.size])
    for r in range(2):
        spec = lowered.programs[r][names.program("fwd", r)]
        exp = jax.export.deserialize(bytearray(spec.data))
        compiled = compile_program(spec, devices)
        outs = jax.tree.leaves(compiled.output_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        # The stage's output leads, then the residuals; the last stage's loss (1,) and its
        # vjp's residuals come after, from the joined output (batch-split, or a scalar).
        grouped = [
            (a.shape, s.shard_shape(a.shape))
            for a, s in zip(exp.out_avals, outs)
            if a.ndim and a.shape[0] == sm.batch_ways
        ]
        assert len(grouped) > 10
        assert all(local[0] == 1 for _, local in grouped), grouped


def test_partial_layout_takes_the_batch_axes_out_of_the_parameter_dims():
    mesh = SliceMesh(data=2, fsdp=2, tensor=2)
    assert partials.partial_layout(P("fsdp", "tensor"), mesh) == P(("data", "fsdp"), None, "tensor")
    assert partials.partial_layout(P(), SliceMesh(data=2)) == P(("data",))
    assert partials.partial_layout(
        P(
            ("fsdp", "tensor"),
        ),
        mesh,
    ) == P(("data", "fsdp"), "tensor")


def test_stages_that_see_the_whole_microbatch_keep_reducing_per_microbatch():
    """Why a stage keeps the per-microbatch reduction, named."""
    leaf = jax.ShapeDtypeStruct((8, 4), "float32")
    mesh = SliceMesh(data=2)
    assert partials.problem(mesh, [leaf], state=False, aux=False) is None
    assert "stage state" in partials.problem(mesh, [leaf], state=True, aux=False)
    assert "auxiliary losses" in partials.problem(mesh, [leaf], state=False, aux=True)
    assert "batch axis 0 divisible by 2" in partials.problem(
        mesh, [jax.ShapeDtypeStruct((3, 4), "float32")], state=False, aux=False
    )
    assert "does not split" in partials.problem(SliceMesh(tensor=2), [leaf], state=False, aux=False)
