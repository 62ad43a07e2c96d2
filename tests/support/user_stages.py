"""Hand-written stages (not made by mpmd.split), and the token data they train on."""

import jax
import numpy as np
from flax import nnx


class EmbedStage(nnx.Module):
    def __init__(self, vocab, width, rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)

    def __call__(self, tokens):
        return self.embed(tokens)


class WidenStage(nnx.Module):
    """Changes the width, so the next stage's input differs from this one's."""

    def __init__(self, d_in, d_out, rngs):
        self.norm = nnx.LayerNorm(d_in, rngs=rngs)
        self.proj = nnx.Linear(d_in, d_out, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.proj(self.norm(x)))


class HeadStage(nnx.Module):
    def __init__(self, width, vocab, rngs):
        self.out = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


class UserModel:
    """Only so the reference can walk the same stages as layers."""

    def __init__(self):
        rngs = nnx.Rngs(3)
        self.stages = [
            EmbedStage(32, 12, rngs),
            WidenStage(12, 20, rngs),
            WidenStage(20, 28, rngs),
            HeadStage(28, 32, rngs),
        ]

    def layers(self):
        return self.stages


def token_batches(steps=3, batch=8, seq=6):
    rng = np.random.default_rng(7)
    return [
        (rng.integers(0, 32, (batch, seq)).astype(np.int32), rng.integers(0, 32, (batch, seq)).astype(np.int32))
        for _ in range(steps)
    ]
