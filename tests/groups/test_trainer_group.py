"""A Trainer on one group of slices while the other group takes its parameters, on real worker
processes: the Trainer is one client of the groups (mpmd/groups/cluster.py)."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import models
from mpmd.groups.client import Groups
from mpmd import rl
from mpmd.rl.sync import WeightSync
from mpmd.stages.leaf_paths import path_string
from tests.runtime.test_mesh_slices import M, assert_matches, data, make_gpt, sgd
from tests.support import reference

pytestmark = [pytest.mark.slow, pytest.mark.every_jax]

LEARNER = [{"data": 2}, {"tensor": 2}]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("groups"))
    g = Groups(
        mpmd.LocalCluster(3, devices_per_worker=2, root=root), {"learner": LEARNER, "sampler": {"tensor": 2}}, root=root
    )
    yield g
    g.close()


def trainer_on(groups, **kw):
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    return mpmd.Trainer(
        pipe,
        sgd(),
        schedule="1f1b",
        num_microbatches=M,
        max_grad_norm=1.0,
        mesh=mpmd.Mesh(LEARNER),
        cluster=groups.cluster_for("learner"),
        **kw,
    )


def test_a_trainer_on_a_group_equals_unpipelined(groups, unpipelined_gpt):
    trainer = trainer_on(groups)
    try:
        batches = data()
        _, grads = trainer.grads(*batches[0])
        # a program on the other group between steps shares the runs' one order
        h = groups.put(np.arange(4, dtype=np.float32), "sampler", P("tensor"))
        losses = []
        for x, y in batches:
            losses.append(trainer.step(x, y)["loss"])
            h = groups.run(lambda a: a + 1, h, out_layouts=P("tensor"))
        got = (losses, reference.stage_leaves(grads), reference.stage_leaves(trainer.params()))
        assert np.array_equal(groups.fetch(h), np.arange(4, dtype=np.float32) + len(batches))
    finally:
        trainer.close()
    assert_matches(got, unpipelined_gpt)


def test_parameters_synced_to_the_sampler_are_bitwise_the_learners(groups):
    """After every step, each stage's parameters go slice to slice to the sampler's one slice,
    laid out there by the model's rules on its mesh (tensor = 2), without the controller
    waiting for the step; each copy is bitwise the parameters of that step."""
    trainer = trainer_on(groups)
    sync = WeightSync(trainer, groups, "learner", "sampler")
    targets = sync.layouts
    try:
        copies, want = [], []
        for x, y in data(2):
            trainer.step(x, y)
            synced = sync()
            assert all(h.slice == groups.slice_of("sampler") for h in synced)
            copies.append([groups.fetch(h) for h in synced])
            want.append(trainer.params())
        assert any(t != P() for stage in targets for t in stage)  # something was resharded
    finally:
        trainer.close()
    for got_step, want_step in zip(copies, want):
        for got, params in zip(got_step, want_step):
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
                assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(copies[0]), jax.tree.leaves(copies[1])))


def test_a_trainer_must_take_the_groups_slices_and_meshes(groups):
    with pytest.raises(ValueError, match=r"has meshes .* but the run asks"):
        pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
        mpmd.Trainer(pipe, sgd(), schedule="1f1b", num_microbatches=M, cluster=groups.cluster_for("learner"))


def test_a_tensor_parallel_sampler_draws_what_one_device_draws(groups):
    """The sampler's slice is tensor-parallel (tensor = 2: the synced weights split over it by
    the model's rules); its draws from the learner's weights are those of the same sampler
    program on one device here."""
    trainer = trainer_on(groups)
    try:
        x, y = data(1)[0]
        trainer.step(x, y)
        sync = WeightSync(trainer, groups, "learner", "sampler")
        model = make_gpt()
        sample = rl.GroupSampler(
            groups, "sampler", trainer.pipeline, model, num_samples=2, max_new_tokens=5, temperature=0.8
        )
        prompts = [[3, 1, 4], [1, 5], [9]]
        tokens, lens = rl.padded(prompts, 3)
        key = jax.random.key_data(jax.random.key(11))
        got = groups.fetch(sample(sync(), tokens, lens, [5, 6, 7], key))
        params = {
            path: leaf
            for paths, tree in zip(trainer.pipeline.param_paths, trainer.params())
            for path, leaf in zip(paths, jax.tree.leaves(tree))
        }
    finally:
        trainer.close(close_cluster=False)
    state = nnx.split(model)[1]
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    full = [params.get(path_string(p), leaf) for p, leaf in flat]
    fn, _ = rl.program(model, num_samples=2, max_new_tokens=5, temperature=0.8)
    want = jax.jit(fn)(full, tokens, lens, np.array([5, 6, 7], np.int32), key)
    assert any(t != P() for stage in sync.layouts for t in stage)  # the weights are split there
    assert np.array_equal(got.tokens, np.asarray(want.tokens))
    np.testing.assert_allclose(got.logprobs, np.asarray(want.logprobs), atol=1e-5)
