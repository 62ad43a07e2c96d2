"""Every argument the frontend rejects, with a message that names what is allowed."""

import numpy as np
import optax
import pytest
from flax import nnx

from mpmd import models
import mpmd
from tests.support.user_stages import HeadStage, UserModel, WidenStage


def gpt(layers=2):
    return models.GPT(32, 16, 2, layers, 8, rngs=nnx.Rngs(0))


def pipe(num_stages=4):
    return mpmd.Pipeline(mpmd.split(gpt(), num_stages=num_stages), models.lm_loss)


def tokens(batch):
    return np.zeros((batch, 8), np.int32)


def test_batch_not_divisible_by_microbatches():
    with mpmd.Trainer(pipe(2), optax.sgd(0.1), schedule="1f1b", num_microbatches=4) as trainer:
        with pytest.raises(
            ValueError, match=r"batch size 6 is not divisible by num_microbatches=4.*allowed.*\[1, 2, 3, 6\]"
        ):
            trainer.step(tokens(6), tokens(6))


def test_fewer_microbatches_than_slices():
    with pytest.raises(ValueError, match=r"'1f1b' needs num_microbatches >= .*\(4\), got 2"):
        mpmd.Trainer(pipe(4), optax.sgd(0.1), schedule="1f1b", num_microbatches=2)


def test_gpipe_allows_fewer_microbatches_than_slices():
    with mpmd.Trainer(pipe(4), optax.sgd(0.1), schedule="gpipe", num_microbatches=2) as trainer:
        assert np.isfinite(trainer.step(tokens(4), tokens(4))["loss"])


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"only 4 layers; allowed num_stages: 1..4"):
        mpmd.split(gpt(), num_stages=5)


def test_model_without_layers():
    with pytest.raises(ValueError, match=r"model.layers\(\)"):
        mpmd.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), num_stages=2)


def test_stages_not_divisible_by_virtual_stages():
    with pytest.raises(ValueError, match=r"num_stages \(4\) must be divisible by virtual_stages \(3\).*\[1, 2, 4\]"):
        mpmd.Trainer(pipe(4), optax.sgd(0.1), schedule="interleaved-1f1b", num_microbatches=4, virtual_stages=3)


def test_unknown_schedule():
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'.*1f1b.*gpipe.*interleaved-1f1b.*zb-h1"):
        mpmd.Trainer(pipe(2), optax.sgd(0.1), schedule="pipedream", num_microbatches=4)


def test_interleaved_needs_virtual_stages():
    with pytest.raises(ValueError, match=r"virtual_stages"):
        mpmd.Trainer(pipe(2), optax.sgd(0.1), schedule="interleaved-1f1b", num_microbatches=4)


def test_stage_output_does_not_fit_next_stage():
    rngs = nnx.Rngs(0)
    bad = UserModel().stages[:2] + [WidenStage(16, 8, rngs), HeadStage(8, 32, rngs)]  # expects 16, gets 20
    with pytest.raises(ValueError, match=r"stage 2 \(WidenStage\) cannot take stage 1's output float32\[2, 8, 20\]"):
        mpmd.Pipeline(bad, models.lm_loss, sample_input=tokens(2))
    # Without a sample input the same check runs at the first step, before any work is dispatched.
    with mpmd.Trainer(
        mpmd.Pipeline(bad, models.lm_loss), optax.sgd(0.1), schedule="gpipe", num_microbatches=2
    ) as trainer:
        with pytest.raises(ValueError, match=r"stage 2 \(WidenStage\) cannot take stage 1's output"):
            trainer.step(tokens(4), tokens(4))


def test_stage_must_be_a_module():
    with pytest.raises(ValueError, match=r"stage 1 must be an nnx.Module, got function"):
        mpmd.Pipeline([gpt().layers()[0], lambda x: x], models.lm_loss)


def test_too_few_devices_says_how_to_get_more():
    import jax

    with pytest.raises(ValueError, match=r"xla_force_host_platform_device_count=4"):
        mpmd.Trainer(
            pipe(4),
            optax.sgd(0.1),
            schedule="gpipe",
            num_microbatches=4,
            cluster=mpmd.InProcessCluster(devices=jax.devices()[:2]),
        )


def test_nonscalar_loss():
    with mpmd.Trainer(mpmd.Pipeline(mpmd.split(gpt(), 2), lambda y, t: y), optax.sgd(0.1), num_microbatches=2) as tr:
        with pytest.raises(ValueError, match=r"loss_fn must return a scalar"):
            tr.step(tokens(4), tokens(4))
