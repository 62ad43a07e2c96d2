"""model.kind='gpt': the GPT decoder LM (models/gpt.py) on byte tokens; also the decoder
section and checks that llama (and a custom model's tokens) share."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd.recipes.config import Config, ModelSection
from mpmd.recipes import registry
from mpmd.recipes.registry import (
    PROMPT_RESPONSE,
    TOKEN_WINDOWS,
    ModelSpec,
    flax_build,
    layers_problems,
    models_loss,
    register_model_spec,
)


class DecoderSection(ModelSection):
    """What every decoder LM here takes."""

    vocab_size: int = Field(256, gt=0, le=2**24, description="token vocabulary; 256 = one token per byte")
    d_model: int = Field(64, gt=0, le=2**18, description="residual stream width")
    num_heads: int = Field(2, gt=0, le=2**12, description="attention heads; must divide d_model")
    num_layers: int = Field(4, gt=0, le=2**12, description="transformer blocks")
    seq_len: int = Field(64, ge=2, le=2**24, description="context length in tokens")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout rate after the embedding and on each block's attention and "
        "MLP outputs, each layer with its own RNG stream seeded by `seed` (carried "
        "on its slice as stage state); 0 = none. Evaluation never drops",
    )


class GPTSection(DecoderSection):
    kind: Literal["gpt"] = Field("gpt", description="which model to build")
    mlp_ratio: int = Field(4, gt=0, le=64, description="feed-forward width as a multiple of d_model")


def byte_vocab_problems(cfg: Config) -> list[str]:
    """A model reading text as bytes needs a token for each of 256 byte values."""
    d, m = cfg.data, cfg.model
    if registry.get_data_source(d.source).byte_text and d.tokenizer == "bytes" and m.vocab_size < 256:
        return [
            f"data.source='{d.source}' yields byte tokens 0..255: model.vocab_size must be >= 256, got {m.vocab_size}"
        ]
    return []


def decoder_problems(cfg: Config) -> list[str]:
    m = cfg.model
    out = []
    if m.d_model % m.num_heads and getattr(m, "head_dim", None) is None:
        out.append(
            f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads}"
            + (" (or model.head_dim given)" if "head_dim" in type(m).model_fields else "")
        )
    out += layers_problems(cfg, m.num_layers + 2, f"embed + {m.num_layers} blocks + head")
    return out + byte_vocab_problems(cfg)


# What every decoder LM here trains on, and how: next-token cross-entropy on token sequences;
# on batches whose source masks the loss (packed rows, fine-tuning examples: the response
# tokens) token-weighted, over the tokens of loss_mask only.
_mean_loss, _masked_loss = models_loss("lm_loss"), models_loss("masked_lm_loss")
LM_READS = (TOKEN_WINDOWS, PROMPT_RESPONSE)


def lm_loss(cfg: Config):
    return (_masked_loss if registry.get_data_source(cfg.data.source).masks_loss(cfg) else _mean_loss)(cfg)


def seq_len(cfg: Config) -> int:
    return cfg.model.seq_len


def _gpt(cfg: Config, rngs):
    from mpmd import models

    m = cfg.model
    return models.GPT(
        m.vocab_size,
        m.d_model,
        m.num_heads,
        m.num_layers,
        m.seq_len,
        m.mlp_ratio,
        dropout_rate=m.dropout,
        dropout_seed=cfg.seed,
        rngs=rngs,
    )


SPEC = register_model_spec(
    ModelSpec(
        "gpt",
        GPTSection,
        build=flax_build(_gpt),
        loss=lm_loss,
        reads=LM_READS,
        tokens_per_example=seq_len,
        samples_text=True,
        problems=decoder_problems,
    )
)
