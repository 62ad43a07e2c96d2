"""Dropout in the GPT and Llama models (`dropout_rate`, `model.dropout` in the recipes): each
layer draws from its own RNG stream, which the pipeline carries on the layer's slice, so a
pipelined run draws the masks NNX itself draws stepping through microbatches 0..m-1 in order.
The reference is NNX's own training of the same model (tests/support/workloads.nnx_reference).
"""

import jax
import numpy as np
import pytest
from flax import nnx

import mpmd
from mpmd import models
from mpmd.models.llama import Llama
from tests.support import reference as ref
from tests.support import workloads as wl

VOCAB, SEQ, RATE = 32, 8, 0.2
MODELS = {
    "gpt": lambda rate=RATE: models.GPT(VOCAB, 16, 2, 2, SEQ, dropout_rate=rate, dropout_seed=5, rngs=nnx.Rngs(0)),
    "llama-remat": lambda rate=RATE: Llama(
        VOCAB, 16, 2, 2, SEQ, remat="block", dropout_rate=rate, dropout_seed=5, rngs=nnx.Rngs(0)
    ),
}


def token_batches(steps: int = 3, rows: int = 16, seed: int = 4) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32), rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32))
        for _ in range(steps)
    ]


@pytest.mark.parametrize("name", ["gpt", pytest.param("llama-remat", marks=(pytest.mark.slow, pytest.mark.every_jax))])
def test_pipelined_dropout_trains_as_nnx_does(name):
    """An abstract model (shapes only; parameters and RNG streams made on the slices, as the
    recipes build it) cut into 3 stages, zb-h1 over 4 microbatches: losses, parameters and
    every stream's count equal NNX's own run of the concrete model."""
    data, m = token_batches(), 4
    want_losses, want_params, model = wl.nnx_reference(lambda: MODELS[name]().layers(), models.lm_loss, data, m)
    stages = mpmd.split(mpmd.abstract(MODELS[name]), num_stages=3)
    with mpmd.Trainer(
        mpmd.Pipeline(stages, models.lm_loss),
        wl.sgd(),
        schedule="zb-h1",
        num_microbatches=m,
        cluster=mpmd.InProcessCluster(),
    ) as t:
        losses = [t.step(x, y)["loss"] for x, y in data]
        params, state = [np.asarray(l) for s in t.params() for l in jax.tree.leaves(s)], t.state()
        x, y = data[0]
        evaluated = t.evaluate(x, y)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    ref.assert_leaves_close(params, want_params, 1e-5, "parameters after 3 steps")
    # Embed draws once per microbatch, each block twice (after attention and after the MLP),
    # and NNX's streams say the same.
    counts = sorted(int(v) for s in state for n, v in s.items() if n.endswith("rngs.count"))
    nnx_counts = sorted(int(layer.drop.rngs.count[...]) for layer in model.layers if getattr(layer, "drop", None))
    assert counts == nnx_counts == [m * len(data), 2 * m * len(data), 2 * m * len(data)], (counts, nnx_counts)
    # Evaluation drops nothing: the loss of the trained model in eval mode.
    model.eval()
    np.testing.assert_allclose(evaluated, float(models.lm_loss(model(x), y)), rtol=1e-5)


def test_rate_zero_builds_no_dropout_and_training_drops():
    """Rate 0 is the model without dropout (no layers, no stage state); a positive rate changes
    the training loss, not the evaluation of the same weights."""
    x, y = token_batches(steps=1)[0]
    plain, dropping = MODELS["gpt"](0.0), MODELS["gpt"](0.5)
    assert plain.embed.drop is None and all(b.drop is None for b in plain.blocks)
    assert not jax.tree.leaves(nnx.state(plain, nnx.Not(nnx.Param)))
    assert float(models.lm_loss(dropping(x), y)) != float(models.lm_loss(plain(x), y))
    dropping.eval()
    np.testing.assert_array_equal(np.asarray(dropping(x)), np.asarray(plain(x)))


@pytest.mark.parametrize("rate", [-0.1, 1.0])
def test_refuses_a_rate_outside_0_to_1(rate):
    with pytest.raises(ValueError, match=r"dropout rate must be in \[0, 1\), got"):
        MODELS["gpt"](rate)
