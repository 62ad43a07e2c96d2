"""Hand-written pipeline stages trained from a config (configs/custom_stages.yaml).

    model:
      kind: custom
      module: mpmd.recipes.examples.custom_stages:build

`build(cfg)` returns `(stages, loss_fn)`: one nnx.Module per pipeline stage, in order, and
the loss on the last stage's output. mpmd never looks inside a stage; it only needs each to
be a function of one pytree (the previous stage's output) with no state mutated in forward.
Here: a byte embedding, two residual MLP blocks and an LM head, i.e. a position-wise model
(no attention) that learns the next byte from the current one.
"""

import jax
from flax import nnx

from mpmd import models


class Embed(nnx.Module):
    """int32 bytes [B, T] -> float32 [B, T, D]."""

    def __init__(self, vocab_size: int, d_model: int, rngs: nnx.Rngs):
        # N(0, 0.02) like GPT: keeps the residual stream small next to the blocks' updates.
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs, embedding_init=nnx.initializers.normal(0.02))

    def __call__(self, tokens):
        return self.embed(tokens)


class ResidualMLP(nnx.Module):
    """x + W2 gelu(W1 LN(x)): [B, T, D] -> [B, T, D]."""

    def __init__(self, d_model: int, hidden: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d_model, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Head(nnx.Module):
    """[B, T, D] -> logits [B, T, V]."""

    def __init__(self, d_model: int, vocab_size: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.out = nnx.Linear(d_model, vocab_size, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(x))


def build(cfg):
    """Four stages sized by the config's model.* keys; pipeline.num_stages must be 4."""
    m, rngs = cfg.model, nnx.Rngs(cfg.seed)
    stages = [
        Embed(m.vocab_size, m.d_model, rngs),
        ResidualMLP(m.d_model, m.mlp_ratio * m.d_model, rngs),
        ResidualMLP(m.d_model, m.mlp_ratio * m.d_model, rngs),
        Head(m.d_model, m.vocab_size, rngs),
    ]
    return stages, models.lm_loss
