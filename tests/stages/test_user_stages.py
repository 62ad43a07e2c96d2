"""Pipelines of hand-written stages and of the MLP train like their unpipelined model."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from mpmd import models
import mpmd
from tests.support import reference
from tests.support.user_stages import UserModel, token_batches


@pytest.mark.parametrize(
    "name", ["1f1b", pytest.param("zb-h1", marks=(pytest.mark.slow, pytest.mark.every_jax)), "gpipe"]
)
def test_user_written_stages(name):
    data = token_batches()
    ref_losses, ref_grads, ref_params = reference.train(UserModel, models.lm_loss, data, optax.adamw(1e-3))
    pipe = mpmd.Pipeline(UserModel().stages, models.lm_loss)
    with mpmd.Trainer(pipe, optax.adamw(1e-3), schedule=name, num_microbatches=4) as trainer:
        loss, grads = trainer.grads(*data[0])
        assert loss == pytest.approx(ref_losses[0], rel=1e-5)
        reference.assert_leaves_close(reference.stage_leaves(grads), ref_grads, 1e-5, what="gradients")
        losses = [trainer.step(x, y)["loss"] for x, y in data]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        reference.assert_leaves_close(reference.stage_leaves(trainer.params()), ref_params, 1e-5)


@pytest.mark.parametrize("name,p", [("1f1b", 2), ("zb-h1", 3), ("interleaved-1f1b", 2)])
def test_mlp(name, p):
    make = lambda: models.MLP(5, 16, 3, 2, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    data = [
        (rng.normal(size=(12, 5)).astype(np.float32), rng.normal(size=(12, 2)).astype(np.float32)) for _ in range(3)
    ]
    ref_losses, ref_grads, ref_params = reference.train(make, models.mse_loss, data, optax.adamw(1e-3))
    v = 2 if name == "interleaved-1f1b" else 1
    pipe = mpmd.Pipeline(mpmd.split(make(), num_stages=p * v), models.mse_loss)
    with mpmd.Trainer(
        pipe, optax.adamw(1e-3), schedule=name, num_microbatches=p * 2 if v > 1 else 3, virtual_stages=v
    ) as trainer:
        _, grads = trainer.grads(*data[0])
        reference.assert_leaves_close(reference.stage_leaves(grads), ref_grads, 1e-5, what="gradients")
        losses = [trainer.step(x, y)["loss"] for x, y in data]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        reference.assert_leaves_close(reference.stage_leaves(trainer.params()), ref_params, 1e-5)


def test_params_are_host_arrays_per_stage():
    pipe = mpmd.Pipeline(UserModel().stages, models.lm_loss)
    with mpmd.Trainer(pipe, optax.sgd(0.1), schedule="1f1b", num_microbatches=4) as trainer:
        params = trainer.params()
    assert len(params) == 4
    assert isinstance(params[1], nnx.State)
    assert all(isinstance(l, np.ndarray) for l in jax.tree.leaves(params))
    assert params[1]["proj"]["kernel"].shape == (12, 20)


def test_activation_specs_are_traced_once_per_input_spec():
    """The lowering, the cost model, the memory estimate and the batch plan all ask a
    Pipeline for its activation specs: each distinct input is traced once, and a different
    one is traced anew, with its own answer."""
    traced = []

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.numpy.ones((3,)))

        def __call__(self, x):
            traced.append(x.shape)
            return x * self.w

    pipe = mpmd.Pipeline([Scale(), Scale()], models.mse_loss)
    small, big = jax.ShapeDtypeStruct((2, 3), np.float32), jax.ShapeDtypeStruct((5, 3), np.float32)
    first = pipe.activation_specs(small)
    assert pipe.activation_specs(small) == first and len(traced) == 2
    assert [s.shape for s in pipe.activation_specs(big)] == [(5, 3)] * 3 and len(traced) == 4
    assert pipe.activation_specs(jax.ShapeDtypeStruct((2, 3), np.float32)) == first and len(traced) == 4
