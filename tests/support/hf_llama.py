"""Tiny random Hugging Face Llamas made here with transformers (nothing downloaded), and their
logits: the reference the import and export tests hold mpmd to.

Each case covers what the mapping must get right: grouped-query attention with a non-default
RoPE theta and RMSNorm epsilon, tied embeddings, a sharded checkpoint (index.json) in bfloat16.
"""

from __future__ import annotations

import numpy as np

VOCAB = 256  # byte tokens: the recipes' stdlib corpus trains on them
SEQ_LEN = 16

CASES = {
    # name: (LlamaConfig keywords, save_pretrained keywords)
    "gqa": (
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        {},
    ),
    "tied": (
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_theta=10_000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        {},
    ),
    "sharded_bf16": (
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_theta=250_000.0,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
        dict(max_shard_size="20KB"),
    ),
}


def make(case: str, out_dir, seed: int = 0):
    """Saves the case's random LlamaForCausalLM to out_dir; returns the torch model (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_kw, save_kw = CASES[case]
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2 * SEQ_LEN, **config_kw)
    model = LlamaForCausalLM(config)
    # Norm weights start at 1: perturb them so a norm mapped wrongly shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if "dtype" in config_kw:
        model = model.to(getattr(torch, config_kw["dtype"]))
    model.save_pretrained(out_dir, **save_kw)
    return model.float().eval()


def logits(model, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of transformers' own forward (its default attention)."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def load_logits(hf_dir, tokens: np.ndarray) -> np.ndarray:
    """Logits of the directory as transformers.LlamaForCausalLM.from_pretrained loads it."""
    from transformers import LlamaForCausalLM

    return logits(LlamaForCausalLM.from_pretrained(hf_dir, dtype="float32").eval(), tokens)


def tokens(batch: int = 4, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ_LEN), dtype=np.int32)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over max |want|: the tolerance the issue states (f32, 1e-4)."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
