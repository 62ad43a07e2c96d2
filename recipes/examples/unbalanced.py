"""A deliberately unbalanced model for `mpmd tune` (benchmarks/bench_tune.py): its first
layer costs about four blocks, its last about three, so equal layer counts per stage are a
poor split and the tuner's measured costs matter.

    model:
      kind: custom
      module: mpmd.recipes.examples.unbalanced:build

`build(cfg)` returns `(model, loss_fn)`; the model exposes `.layers()`, so mpmd.split (and
pipeline.cuts) cut it like a GPT: [HeavyEmbed, model.num_layers x ResidualMLP, HeavyHead].
Position-wise (no attention), like recipes/examples/custom_stages.py, whose pieces it uses.
"""

from flax import nnx

from mpmd import models
from mpmd.recipes.examples.custom_stages import Embed, Head, ResidualMLP


class HeavyEmbed(nnx.Module):
    """A byte embedding followed by four blocks' worth of work: one layer, four costs."""

    def __init__(self, vocab_size: int, d_model: int, hidden: int, rngs: nnx.Rngs):
        self.embed = Embed(vocab_size, d_model, rngs)
        self.mix = nnx.List([ResidualMLP(d_model, hidden, rngs) for _ in range(4)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.mix:
            x = block(x)
        return x


class HeavyHead(nnx.Module):
    """Two blocks' worth of work and the LM head: about three blocks."""

    def __init__(self, d_model: int, hidden: int, vocab_size: int, rngs: nnx.Rngs):
        self.mix = nnx.List([ResidualMLP(d_model, hidden, rngs) for _ in range(2)])
        self.head = Head(d_model, vocab_size, rngs)

    def __call__(self, x):
        for block in self.mix:
            x = block(x)
        return self.head(x)


class Unbalanced(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, hidden: int, num_layers: int, rngs: nnx.Rngs):
        self.first = HeavyEmbed(vocab_size, d_model, hidden, rngs)
        self.blocks = nnx.List([ResidualMLP(d_model, hidden, rngs) for _ in range(num_layers)])
        self.last = HeavyHead(d_model, hidden, vocab_size, rngs)

    def layers(self) -> list[nnx.Module]:
        return [self.first, *self.blocks, self.last]

    def __call__(self, tokens):
        x = tokens
        for layer in self.layers():
            x = layer(x)
        return x


def build(cfg):
    m = cfg.model
    return Unbalanced(
        m.vocab_size, m.d_model, m.mlp_ratio * m.d_model, m.num_layers, nnx.Rngs(cfg.seed)
    ), models.lm_loss
