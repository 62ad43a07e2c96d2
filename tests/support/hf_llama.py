"""Tiny random Hugging Face decoders made here with transformers (nothing downloaded), and
their logits: the reference the import and export tests hold mpmd to.

Each Llama case covers what the mapping must get right: grouped-query attention with a
non-default RoPE theta and RMSNorm epsilon, tied embeddings, a sharded checkpoint
(index.json) in bfloat16. FAMILY_CASES holds one model of each other family, each with what
sets it apart: Llama 3.1's scaled rotary frequencies (all three bands in use), Mistral's own
head_dim and a sliding window shorter than the sequence, Qwen 2.5's q/k/v biases (tied,
as its small models are), Qwen 3's per-head q/k norms with a head_dim of its own, Gemma 3's local and global layers
(its (1 + w) norms, GELU, sandwich norms, scaled embedding, query scale).
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


_SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILY_CASES = {
    # name: (model_type, config keywords)
    "llama31": (
        "llama",
        dict(
            _SMALL,
            rope_parameters=dict(
                # head_dim 8: wavelengths 6.3, 63, 628 and 6283 positions, against 16 / 2 = 8
                # and 16 / 0.1 = 160: one kept, one blended, two divided by the factor.
                rope_type="llama3",
                rope_theta=10_000.0,
                factor=8.0,
                low_freq_factor=0.1,
                high_freq_factor=2.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "mistral": ("mistral", dict(_SMALL, head_dim=16, sliding_window=6, rope_theta=1_000_000.0)),
    "qwen2": ("qwen2", dict(_SMALL, tie_word_embeddings=True, rope_theta=1_000_000.0)),
    "qwen3": ("qwen3", dict(_SMALL, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # Layers 1 and 3 local (a window of 6, base 10^4), 2 and 4 global (linear scaling by 2).
    "gemma3": (
        "gemma3_text",
        dict(
            _SMALL,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
}


def _classes(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoConfig.for_model(model_type).__class__, AutoModelForCausalLM


def make(case: str, out_dir, seed: int = 0, vocab: int = VOCAB):
    """Saves the case's random model (CASES: a LlamaForCausalLM; FAMILY_CASES: its family's)
    to out_dir; returns the torch model (float32)."""
    import torch

    if case in FAMILY_CASES:
        model_type, config_kw = FAMILY_CASES[case]
        save_kw = {}
    else:
        (model_type, (config_kw, save_kw)) = "llama", CASES[case]
    config_class, model_class = _classes(model_type)
    torch.manual_seed(seed)
    config = config_class(vocab_size=vocab, max_position_embeddings=2 * SEQ_LEN, **config_kw)
    model = model_class.from_config(config)
    # Norm weights start at 1 and biases at 0: perturb them so one mapped wrongly shows in
    # the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
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
    """Logits of the directory as transformers.AutoModelForCausalLM.from_pretrained loads it
    (the family config.json names)."""
    from transformers import AutoModelForCausalLM

    return logits(AutoModelForCausalLM.from_pretrained(hf_dir, dtype="float32").eval(), tokens)


def tokens(batch: int = 4, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ_LEN), dtype=np.int32)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over max |want|: the tolerance the issue states (f32, 1e-4)."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
