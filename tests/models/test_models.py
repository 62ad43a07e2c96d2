"""Behaviour of models/: shapes, causality, layer lists that really are the model, training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mpmd.models import GPT, MLP, lm_loss, mse_loss

VOCAB, D_MODEL, NUM_HEADS, NUM_LAYERS, SEQ_LEN, BATCH = 32, 16, 2, 2, 8, 4


def _gpt(seed: int = 0) -> GPT:
    return GPT(VOCAB, D_MODEL, NUM_HEADS, NUM_LAYERS, SEQ_LEN, rngs=nnx.Rngs(seed))


def _tokens(seed: int = 1, num_steps: int = SEQ_LEN) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (BATCH, num_steps), 0, VOCAB, jnp.int32)


def _apply_layers(model, x):
    for layer in model.layers():
        x = layer(x)
    return x


def _num_param_leaves(module) -> tuple[int, int]:
    """(number of param arrays, number of scalars) held by module."""
    leaves = jax.tree.leaves(nnx.state(module, nnx.Param))
    return len(leaves), sum(leaf.size for leaf in leaves)


@pytest.mark.parametrize("num_steps", [SEQ_LEN, 3])
def test_gpt_output_shape(num_steps):
    logits = nnx.jit(lambda m, x: m(x))(_gpt(), _tokens(num_steps=num_steps))
    assert logits.shape == (BATCH, num_steps, VOCAB)
    assert logits.dtype == jnp.float32


def test_gpt_is_causal():
    model = _gpt()
    tokens = _tokens()
    t = 5
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % VOCAB)
    before, after = model(tokens), model(changed)
    np.testing.assert_array_equal(before[:, :t], after[:, :t])
    # Guards against a vacuous pass (e.g. a model that ignores its input).
    assert not np.allclose(before[:, t:], after[:, t:])


def test_gpt_layers_compose_to_model_exactly():
    model = _gpt()
    tokens = _tokens()
    layers = model.layers()
    assert len(layers) == NUM_LAYERS + 2
    np.testing.assert_array_equal(model(tokens), _apply_layers(model, tokens))


def test_mlp_layers_compose_to_model_exactly():
    model = MLP(3, 8, 2, 2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (5, 3))
    assert len(model.layers()) == 3
    assert model(x).shape == (5, 2)
    np.testing.assert_array_equal(model(x), _apply_layers(model, x))


@pytest.mark.parametrize(
    "make_model, make_input",
    [
        (_gpt, _tokens),
        (lambda: MLP(3, 8, 2, 2, rngs=nnx.Rngs(0)), lambda: jnp.ones((2, 3))),
    ],
    ids=["gpt", "mlp"],
)
def test_layer_params_are_exactly_the_model_params(make_model, make_input):
    model, x = make_model(), make_input()
    per_layer = [_num_param_leaves(layer) for layer in model.layers()]
    assert all(count > 0 for count, _ in per_layer)
    assert _num_param_leaves(model) == tuple(map(sum, zip(*per_layer)))
    # The layers are the model's own objects, not copies: editing one changes the model.
    first = model.layers()[0]
    before = model(x)
    params = nnx.state(first, nnx.Param)
    nnx.update(first, jax.tree.map(lambda p: p + 1.0, params))
    after = model(x)
    assert not np.allclose(before, after)


def test_gpt_grad_is_finite_and_nonzero():
    model = _gpt()
    tokens = _tokens()

    def loss_fn(m):
        return lm_loss(m(tokens[:, :-1]), tokens[:, 1:])

    # jit: eager op-by-op differentiation of even this tiny model takes seconds.
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
    leaves = jax.tree.leaves(grads)
    assert np.isfinite(loss)
    # Untrained logits are near-uniform, so the loss starts near log(vocab).
    assert abs(float(loss) - np.log(VOCAB)) < 0.5
    assert all(np.all(np.isfinite(g)) for g in leaves)
    assert any(np.any(g != 0) for g in leaves)


def _train(model, loss_fn, num_steps: int) -> list[float]:
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(num_steps)]


def test_gpt_adamw_reduces_loss_on_repeated_batch():
    tokens = _tokens()
    losses = _train(_gpt(), lambda m: lm_loss(m(tokens[:, :-1]), tokens[:, 1:]), 20)
    assert losses[-1] < 0.7 * losses[0], losses


def test_mlp_adamw_reduces_loss_on_repeated_batch():
    x = jax.random.normal(jax.random.key(0), (16, 3))
    y = jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=-1)
    losses = _train(MLP(3, 16, 2, 2, rngs=nnx.Rngs(0)), lambda m: mse_loss(m(x), y), 30)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(d_model=15),  # not divisible by num_heads=2
        dict(num_heads=0),
        dict(num_layers=0),
        dict(vocab_size=-1),
        dict(seq_len=0),
        dict(mlp_ratio=0),
    ],
)
def test_gpt_rejects_bad_arguments(kwargs):
    args = dict(vocab_size=VOCAB, d_model=D_MODEL, num_heads=NUM_HEADS, num_layers=NUM_LAYERS, seq_len=SEQ_LEN) | kwargs
    with pytest.raises(ValueError):
        GPT(**args, rngs=nnx.Rngs(0))


def test_gpt_rejects_sequence_longer_than_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        _gpt()(_tokens(num_steps=SEQ_LEN + 1))


@pytest.mark.parametrize("args", [(0, 8, 2, 2), (3, 8, 0, 2), (3, 8, 2, 0), (3, -8, 2, 2)])
def test_mlp_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        MLP(*args, rngs=nnx.Rngs(0))


def test_losses_reject_mismatched_shapes():
    with pytest.raises(ValueError):
        lm_loss(jnp.zeros((2, 4, VOCAB)), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError):
        mse_loss(jnp.zeros((2, 3)), jnp.zeros((2, 2)))
