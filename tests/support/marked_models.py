"""Ordinary Flax models that end their pipeline stages with `mpmd.stage_boundary` marks.

They live with the tests, not in models/, because models/ knows nothing of mpmd.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import mpmd
from mpmd.models.gpt import _EMBED_INIT, Block


class MarkedGPT(nnx.Module):
    """A small GPT cut by marks: tokens [B, T] -> logits [B, T, V].

    - the token embedding is TIED with the LM head (logits = h @ E^T), so stage 0 and the last
      stage share one weight (tie=False gives the head its own matrix);
    - blocks are looped over in Python and marked after the blocks listed in `boundaries`;
    - the embedding output is added back before the final norm: a skip connection crossing
      every boundary.
    """

    def __init__(
        self, vocab=32, d_model=16, num_heads=2, num_blocks=4, seq_len=8, boundaries=(1, 3), tie=True, *, rngs: nnx.Rngs
    ):
        self.embed = nnx.Embed(vocab, d_model, embedding_init=_EMBED_INIT, rngs=rngs)
        self.position = nnx.Embed(seq_len, d_model, embedding_init=_EMBED_INIT, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, num_heads, rngs=rngs) for _ in range(num_blocks)])
        self.ln = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = (
            None
            if tie
            else nnx.Linear(d_model, vocab, use_bias=False, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        )
        self.boundaries = tuple(boundaries)
        self.seq_len = seq_len

    def sample_input(self, batch: int = 1):
        return jnp.zeros((batch, self.seq_len), jnp.int32)

    def __call__(self, tokens):
        skip = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))
        x = skip
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in self.boundaries:
                x = mpmd.stage_boundary(x)
        x = self.ln(x + skip)
        if self.head is None:
            return x @ self.embed.embedding[...].T
        return self.head(x)


class Down(nnx.Module):
    """A nested module that ends a stage inside its own __call__."""

    def __init__(self, d_in, d_out, rngs):
        self.proj = nnx.Linear(d_in, d_out, rngs=rngs)

    def __call__(self, x):
        return mpmd.stage_boundary(jax.nn.gelu(self.proj(x)))


class MarkedUNet(nnx.Module):
    """U-Net-like MLP: x [B, F] -> [B, F]. Stage 0: `inp` then Down (mark inside it); stage 1:
    the bottleneck, marked; stage 2: up-projection joined with the encoder's first features
    `h1`, which skip stage 1 entirely (they pass through it)."""

    def __init__(self, features=6, width=12, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.inp = nnx.Linear(features, width, rngs=rngs)
        self.down = Down(width, width // 2, rngs)
        self.mid = nnx.Linear(width // 2, width // 2, rngs=rngs)
        self.up = nnx.Linear(width // 2, width, rngs=rngs)
        self.out = nnx.Linear(width, features, rngs=rngs)
        self.features = features

    def sample_input(self, batch: int = 2):
        return jnp.zeros((batch, self.features), jnp.float32)

    def __call__(self, x):
        h1 = jax.nn.gelu(self.inp(x))
        h2 = self.down(h1)
        h3 = mpmd.stage_boundary(jnp.tanh(self.mid(h2)))
        return self.out(jax.nn.gelu(self.up(h3)) + h1)
