"""A slice is a mesh of devices: SPMD inside each stage, MPMD across slices.

Every pipelined run is checked against plain unpipelined JAX training (SGD with momentum,
float32, clipping on): loss, first-step gradients and parameters after 3 steps within 1e-5
of each leaf's scale. Shardings change only the order of float sums (a data-parallel
gradient is reduced across devices, a tensor-parallel matmul sums partial products), so
results agree to rounding, not bitwise; between two runtimes with the same meshes they agree
bitwise.
"""

import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mpmd import models
import mpmd
from mpmd.stages import names
from mpmd.stages import sharding
from mpmd.runtime.wire import reshard
from mpmd.runtime.worker.mesh import bind
from tests.support import reference
from tests.support.marked_models import MarkedGPT
from tests.support.user_stages import UserModel, token_batches

# Many training runs against the unpipelined model, each seconds: outside the fast loop.
pytestmark = [pytest.mark.slow, pytest.mark.every_jax]

M, RTOL = 4, 1e-5
make_gpt = reference.make_gpt  # 32-token vocabulary, width 16, 6 blocks, 8 positions


def data(steps=3):
    return reference.batches()[:steps]


def sgd():
    return optax.sgd(0.1, momentum=0.9)


def run(
    cluster, mesh, schedule="1f1b", num_stages=2, virtual_stages=None, steps=3, close=True, fsdp_gather="per_microbatch"
):
    """(losses, first-step grads, final params) of the GPT pipelined on `mesh`."""
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=num_stages), models.lm_loss)
    trainer = mpmd.Trainer(
        pipe,
        sgd(),
        schedule=schedule,
        num_microbatches=M,
        virtual_stages=virtual_stages,
        max_grad_norm=1.0,
        mesh=mpmd.Mesh(mesh, fsdp_gather=fsdp_gather),
        cluster=cluster,
    )
    try:
        batches = data(steps)
        _, grads = trainer.grads(*batches[0])
        losses = [trainer.step(x, y)["loss"] for x, y in batches]
        return losses, reference.stage_leaves(grads), reference.stage_leaves(trainer.params())
    finally:
        trainer.close(close_cluster=close)


def assert_matches(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    reference.assert_leaves_close(got[1], want[1], RTOL, "gradients")
    reference.assert_leaves_close(got[2], want[2], RTOL, "parameters")


@pytest.mark.parametrize(
    "mesh,schedule,stages,v",
    [
        ({"data": 2}, "gpipe", 2, None),
        ({"tensor": 2}, "1f1b", 2, None),
        ({"fsdp": 2}, "zb-h1", 2, None),
        ([{"tensor": 2}, {"data": 2}], "1f1b", 2, None),  # unlike slices
        ({"data": 2, "tensor": 2}, "zb-h1", 2, None),  # D = 4
        ([{"data": 2}, {"fsdp": 2, "tensor": 2}], "interleaved-1f1b", 4, 2),
    ],
    ids=[
        "data2-gpipe",
        "tensor2-1f1b",
        "fsdp2-zbh1",
        "tensor2|data2-1f1b",
        "data2xtensor2-zbh1",
        "data2|fsdp2xtensor2-interleaved",
    ],
)
def test_mesh_slices_match_unpipelined_in_process(unpipelined_gpt, mesh, schedule, stages, v):
    assert_matches(run(mpmd.InProcessCluster(), mesh, schedule, stages, v), unpipelined_gpt)


# FSDP weights gathered once a step (mpmd/stages/gather.py): only where the gather happens
# changes, so the run matches unpipelined JAX as per_microbatch does.
@pytest.mark.parametrize(
    "mesh,schedule,stages,v",
    [
        ({"fsdp": 2}, "1f1b", 2, None),
        ({"fsdp": 2}, "zb-h1", 2, None),
        ({"fsdp": 2}, "zb-v", 4, 2),  # a V: two stages a slice
        ([{"fsdp": 2}, {"data": 2}], "1f1b", 2, None),  # one slice gathers, one has nothing to
    ],
    ids=["fsdp2-1f1b", "fsdp2-zbh1", "fsdp2-zbv", "fsdp2|data2-1f1b"],
)
def test_fsdp_gathered_once_a_step_matches_unpipelined_in_process(unpipelined_gpt, mesh, schedule, stages, v):
    assert_matches(run(mpmd.InProcessCluster(), mesh, schedule, stages, v, fsdp_gather="per_step"), unpipelined_gpt)


def test_layouts_follow_the_rules():
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with mpmd.Trainer(
        pipe, sgd(), num_microbatches=2, mesh=[{"tensor": 2}, {"data": 2, "fsdp": 2}], cluster=mpmd.InProcessCluster()
    ) as trainer:
        trainer.step(*data(1)[0])
        s0, s1 = trainer.cluster.executors
        paths = sharding.param_paths(pipe.fns[0])
        token = s0.buffers[names.params(0)][paths.index("layers/0/token/embedding")]
        assert token.sharding.spec == P("tensor", None) and len(token.sharding.device_set) == 2
        # stage 1 (blocks, head) on data=2 x fsdp=2: model-width dims split over fsdp, on 4 devices
        paths1 = sharding.param_paths(pipe.fns[1])
        up = s1.buffers[names.params(1)][paths1.index("layers/0/mlp/up/kernel")]
        assert up.sharding.spec == P("fsdp", None) and len(up.sharding.device_set) == 4
        # optimizer state (momentum) lies like its parameter
        assert s1.buffers[names.opt_state(1)][paths1.index("layers/0/mlp/up/kernel")].sharding.spec == P("fsdp", None)
        # the activation (4 rows a microbatch) crossing data=1 -> data x fsdp = 4 is split
        # along the batch on arrival
        recv = next(i for i in trainer.lowered.train[1] if type(i).__name__ == "Recv")
        assert recv.specs[0].layout == (("data", "fsdp"),) and recv.pieces == (1,)


def test_unannotated_user_stages_are_replicated_and_data_parallel():
    batches = token_batches()
    want = reference.train(UserModel, models.lm_loss, batches, sgd())
    pipe = mpmd.Pipeline(UserModel().stages, models.lm_loss)
    with mpmd.Trainer(pipe, sgd(), num_microbatches=M, mesh={"data": 2}, cluster=mpmd.InProcessCluster()) as trainer:
        _, grads = trainer.grads(*batches[0])
        losses = [trainer.step(x, y)["loss"] for x, y in batches]
        params = trainer.params()
        for k, ex in enumerate(trainer.cluster.executors):
            assert all(a.sharding.spec == P() and len(a.sharding.device_set) == 2 for a in ex.buffers[names.params(k)])
    assert_matches((losses, reference.stage_leaves(grads), reference.stage_leaves(params)), want)


def test_a_stateless_optimizer_trains_on_a_mesh_slice():
    """Plain SGD keeps no state: its opt_init takes the parameters, uses none and returns
    nothing, which jax.export records as a 1-device program. It used to be refused on a
    2-device slice ("exported for 1 device(s); this slice has 2")."""
    want = reference.train(make_gpt, models.lm_loss, data(), optax.sgd(0.1))
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with mpmd.Trainer(
        pipe, optax.sgd(0.1), num_microbatches=M, mesh={"data": 2}, cluster=mpmd.InProcessCluster()
    ) as trainer:
        _, grads = trainer.grads(*data()[0])
        losses = [trainer.step(x, y)["loss"] for x, y in data()]
        got = (losses, reference.stage_leaves(grads), reference.stage_leaves(trainer.params()))
    assert_matches(got, want)


def test_tied_weight_across_unlike_slices():
    """The embedding tied with the LM head lies P(vocab over tensor) on slice 0 and replicated
    on slice 1; the holders' gradients cross both ways, resharded, and the copies stay equal."""

    def make():
        return MarkedGPT(rngs=nnx.Rngs(0))

    model = make()
    _axes_on_embedding(model)
    batches = data()
    pipe = mpmd.Pipeline(mpmd.split(model), models.lm_loss)
    assert pipe.shared

    class Whole:  # the tied model as one layer, for reference.train
        def layers(self):
            return [make()]

    want = reference.train(Whole, models.lm_loss, batches, sgd(), max_grad_norm=1.0)
    table = np.asarray(model.embed.embedding[...])
    trained = next(p for p in want[2] if p.shape == table.shape)
    with mpmd.Trainer(
        pipe,
        sgd(),
        num_microbatches=M,
        max_grad_norm=1.0,
        mesh=[{"tensor": 2}, {"data": 2}, {"data": 1}],
        cluster=mpmd.InProcessCluster(),
    ) as trainer:
        losses = [trainer.step(x, y)["loss"] for x, y in batches]
        params = trainer.params()
        (group,) = pipe.shared
        (k0, i0), (k1, i1) = group
        assert trainer.cluster.executors[0].buffers[names.params(k0)][i0].sharding.spec == P("tensor", None)
    np.testing.assert_allclose(losses, want[0], rtol=RTOL)
    first, last = (np.asarray(params[k0][i0]), np.asarray(params[k1][i1]))
    assert (k0, k1) == (0, 2) and np.array_equal(first, last)
    reference.assert_leaves_close([first], [trained], RTOL)


def _axes_on_embedding(model):
    """Annotate MarkedGPT's (unannotated) tied embedding as [vocab, embed]."""
    model.embed.embedding.set_metadata(out_sharding=("vocab", "embed"))


# -- real worker processes (2 workers x 2 devices: tests/conftest.py two_device_workers) -------------
@pytest.mark.parametrize(
    "mesh,schedule",
    [({"data": 2}, "1f1b"), ([{"tensor": 2}, {"fsdp": 2}], "zb-h1")],
    ids=["data2-1f1b", "tensor2|fsdp2-zbh1"],
)
def test_mesh_slices_on_worker_processes_equal_in_process(two_device_workers, unpipelined_gpt, mesh, schedule):
    got = two_device_workers(mesh, schedule)[0]
    assert_matches(got, unpipelined_gpt)
    # Same meshes, same programs, same threading: the two runtimes agree bit for bit.
    same = run(mpmd.InProcessCluster(), mesh, schedule)
    assert got[0] == same[0]
    for a, b in zip(got[2], same[2]):
        assert np.array_equal(a, b)


def test_fsdp_gathered_once_a_step_on_worker_processes_equals_in_process(two_device_workers, unpipelined_gpt):
    got = two_device_workers({"fsdp": 2}, "1f1b", "per_step")[0]
    assert_matches(got, unpipelined_gpt)
    same = run(mpmd.InProcessCluster(), {"fsdp": 2}, "1f1b", fsdp_gather="per_step")
    assert got[0] == same[0]
    for a, b in zip(got[2], same[2]):
        assert np.array_equal(a, b)


# -- checkpoints across meshes -----------------------------------------------------------------
def test_checkpoint_saved_on_one_mesh_resumes_on_another(tmp_path):
    batches = data()

    def trainer(mesh):
        pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
        return mpmd.Trainer(
            pipe,
            sgd(),
            num_microbatches=M,
            mesh=mesh,
            run_dir=tmp_path,
            checkpoint=mpmd.Checkpointing(asynchronous=False),
            cluster=mpmd.InProcessCluster(),
        )

    with trainer({"tensor": 2}) as t:
        t.step(*batches[0])
        t.save()
        saved = reference.stage_leaves(t.params())
        want = [t.step(x, y)["loss"] for x, y in batches[1:]]
    for mesh in ({"data": 2}, [{"fsdp": 2, "tensor": 2}, None]):
        with trainer(mesh) as t:
            assert t.step_count == 1
            for a, b in zip(reference.stage_leaves(t.params()), saved):
                assert np.array_equal(a, b)  # a restore moves bytes; it changes none
            got = [t.step(x, y)["loss"] for x, y in batches[1:]]
        np.testing.assert_allclose(got, want, rtol=RTOL)


# -- resharding ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "src,dst",
    [
        ((2, 1, 1), (2, 1, 1)),
        ((2, 1, 1), (1, 1, 2)),
        ((1, 1, 2), (2, 2, 1)),
        ((4, 1, 1), (2, 1, 1)),
        ((2, 1, 1), (1, 2, 2)),
    ],
)
@pytest.mark.parametrize("layout", ["batch", "columns"])
def test_cut_and_assemble_move_every_element(src, dst, layout):
    """Any sender layout to any receiver layout: the receiver's array equals the sender's."""
    import jax

    devices = jax.devices()
    n_src = int(np.prod(src))
    a_mesh, b_mesh = bind(src, devices[:n_src]), bind(dst, devices[n_src : n_src + int(np.prod(dst))])
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    src_layout = P(("data", "fsdp"), None) if layout == "batch" else P(None, "tensor")
    a = jax.device_put(x, jax.sharding.NamedSharding(a_mesh, src_layout))
    pieces = sharding.batch_pieces(src_layout, sharding.SliceMesh(*src))
    dst_layout = (
        tuple(sharding.batch_layout(x.shape, sharding.SliceMesh(*dst))) if layout == "batch" else (None, "tensor")
    )
    parts = reshard.cut(a, pieces)
    assert len(parts) == pieces and all(len(p.sharding.device_set) == 1 for p in parts)
    # as handed over in memory (pieces still on the sender's devices), and as pulled over the
    # wire onto the devices `landing` picks on the receiver
    landed = [jax.device_put(p, d) for p, d in zip(parts, reshard.landing(x.shape, dst_layout, b_mesh, pieces))]
    for arrived in (parts, landed):
        b = reshard.assemble(arrived, x.shape, dst_layout, b_mesh)
        assert b.sharding.spec == P(*dst_layout) and set(b.sharding.device_set) == set(b_mesh.devices.flat)
        assert np.array_equal(np.asarray(b), x)


# -- bad shapes are refused before anything starts -------------------------------------------------
def test_mesh_product_must_equal_the_workers_devices():
    cluster = mpmd.LocalCluster(num_workers=2, devices_per_worker=2)
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with pytest.raises(
        sharding.LayoutError, match=r"slice 1: mesh data=1 x fsdp=1 x tensor=4 = 4 devices, but each slice has 2"
    ):
        mpmd.Trainer(pipe, sgd(), num_microbatches=M, mesh=[{"data": 2}, {"tensor": 4}], cluster=cluster)
    assert cluster.num_slices == 0  # no worker was started


def test_axis_that_does_not_divide_a_parameter_is_named():
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with pytest.raises(
        sharding.LayoutError,
        match=r"parameter layers/0/token/embedding of stage 0: dimension 32 \('vocab'\) "
        r"is not divisible by mesh axis tensor=3",
    ):
        mpmd.Trainer(pipe, sgd(), num_microbatches=M, mesh={"tensor": 3}, cluster=mpmd.InProcessCluster())
    with pytest.raises(sharding.LayoutError, match="slice 1: mesh"):
        sharding.slice_meshes([{"data": 2}, {"data": 2, "tensor": 2}], 2, devices_per_slice=2)
    with pytest.raises(sharding.LayoutError, match="unknown mesh axis 'model'"):
        sharding.slice_meshes({"model": 2}, 2)
    with pytest.raises(sharding.LayoutError, match="rules"):
        sharding.check_rules({"embed": "model"})
