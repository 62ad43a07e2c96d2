"""A small MLP regressor built as an ordered list of single-array layers.

It exists as the simplest model a pipeline can be split over: `MLP.layers()` is
[Hidden_0, .., Hidden_{n-1}, output Linear], and `MLP.__call__` is a fold over that list.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from mpmd.models.gpt import _linear, _require_positive


class Hidden(nnx.Module):
    """Linear followed by GELU: [..., in_features] -> [..., out_features]."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        # Hidden widths split over `tensor` would cost a gather per layer; they go on fsdp.
        self.linear = _linear(in_features, out_features, ("embed", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(self.linear(x))


class MLP(nnx.Module):
    """num_layers GELU hidden layers of width hidden_features, then a linear output layer."""

    def __init__(self, in_features: int, hidden_features: int, num_layers: int, out_features: int, *, rngs: nnx.Rngs):
        _require_positive(
            in_features=in_features, hidden_features=hidden_features, num_layers=num_layers, out_features=out_features
        )
        widths = [in_features] + [hidden_features] * num_layers
        # nnx.List, not a plain list: flax 0.12 only tracks params of modules held this way.
        self.hidden = nnx.List([Hidden(n_in, n_out, rngs=rngs) for n_in, n_out in zip(widths[:-1], widths[1:])])
        # No activation on the output: a regressor must be able to produce any real value.
        self.output = _linear(hidden_features, out_features, ("embed", None), rngs=rngs)
        self.in_features = in_features

    def sample_input(self, batch: int = 1) -> jax.Array:
        """A zero batch of inputs: what cost analysis traces to balance a split."""
        return jnp.zeros((batch, self.in_features), jnp.float32)

    def layers(self) -> list[nnx.Module]:
        """The model's own submodules in application order: [Hidden_0.., output]."""
        return [*self.hidden, self.output]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers():
            x = layer(x)
        return x


def mse_loss(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over every element."""
    if pred.shape != target.shape:
        raise ValueError(f"pred {pred.shape} and target {target.shape} must have the same shape")
    return jnp.mean((pred - target) ** 2)
