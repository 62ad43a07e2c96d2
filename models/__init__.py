"""Models built as ordered lists of single-array layers, so they can be cut into stages.

Each model exposes `layers()` (its own submodules, in order) and a `__call__` that applies
them in that order. This package knows nothing about pipelines.
"""

from mpmd.models.gpt import GPT, Block, CausalSelfAttention, Embed, FeedForward, Head, lm_loss, masked_lm_loss
from mpmd.models.llama import Llama
from mpmd.models.mlp import MLP, Hidden, mse_loss

__all__ = [
    "GPT",
    "Embed",
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "Head",
    "lm_loss",
    "masked_lm_loss",
    "Llama",
    "MLP",
    "Hidden",
    "mse_loss",
]
