"""The Hugging Face formats mpmd reads and writes, as data: FAMILIES (one row per family:
model.kind, model_type, architecture, its switches), config.json <-> the family's model.*
keys (model_keys, hf_config), and each parameter's model path <-> its tensor name and shape
(param_paths, tensor_name). No file but config.json is read here (mpmd/recipes/families/hf.py
reads and writes the weights). Nothing here imports JAX: the config's check reads config.json
before JAX starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


from mpmd.recipes.config.sections import ConfigError

PREFIX = "hf:"  # model.init_from = "hf:<directory>"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face family the decoder computes: `kind` (model.kind), `model_type` and
    `architecture` (config.json's), `fixed` (model.* switches the family always has), and
    whether config.json's `sliding_window` applies to every layer (`window`: Mistral's) or
    is refused unless `use_sliding_window` is false (Qwen's, per layer)."""

    kind: str
    model_type: str
    architecture: str
    fixed: dict = dataclasses.field(default_factory=dict)
    window: str = "none"  # "none" (no such key), "all" (every layer), "qwen" (use_sliding_window), "gemma"
    # model path (after blocks.<i>.) -> tensor (after model.layers.<i>.) where not _BLOCK's
    renamed: dict = dataclasses.field(default_factory=dict)
    sandwich: bool = False  # its blocks have the norms after attention and MLP (_SANDWICH)
    # config.json defaults where not LlamaConfig's (KEYS)
    defaults: dict = dataclasses.field(default_factory=dict)
    activation: tuple[str, str] = ("hidden_act", "silu")  # config.json's key and the one value read


FAMILIES = {
    f.kind: f
    for f in (
        Family("llama", "llama", "LlamaForCausalLM"),
        Family("mistral", "mistral", "MistralForCausalLM", window="all"),
        Family("qwen2", "qwen2", "Qwen2ForCausalLM", {"qkv_bias": True}, window="qwen"),
        Family("qwen3", "qwen3", "Qwen3ForCausalLM", {"qk_norm": True}, window="qwen"),
        Family(
            "gemma3",
            "gemma3_text",
            "Gemma3ForCausalLM",
            {"qk_norm": True},
            window="gemma",
            renamed={"mlp_norm.scale": "pre_feedforward_layernorm.weight"},
            sandwich=True,
            defaults={"tie_word_embeddings": True},
            activation=("hidden_activation", "gelu_pytorch_tanh"),
        ),
    )
}
# Gemma 3's keys (model.* <- config.json, default): its query scale, local layers' window and
# rotary base, and which layers are global (every global_every-th: layer_types).
GEMMA_KEYS = {"query_scale": ("query_pre_attn_scalar", 256), "sliding_window": ("sliding_window", 4096)}
ARCHITECTURE = FAMILIES["llama"].architecture

# model.* key -> config.json key, and config.json's default when the key is absent (those of
# transformers' LlamaConfig). rope_theta has its own rule (rope_theta_of).
KEYS = {
    "vocab_size": ("vocab_size", None),
    "d_model": ("hidden_size", None),
    "num_heads": ("num_attention_heads", None),
    "num_layers": ("num_hidden_layers", None),
    "num_kv_heads": ("num_key_value_heads", None),
    "mlp_dim": ("intermediate_size", None),
    "norm_eps": ("rms_norm_eps", 1e-6),
    "tie_embeddings": ("tie_word_embeddings", False),
}
DEFAULT_ROPE_THETA = 10_000.0
_INT_KEYS = ("vocab_size", "d_model", "num_heads", "num_layers", "num_kv_heads", "mlp_dim")
# The rope scaling keys (model.rope_*) <- rope_parameters' names, and their defaults.
ROPE_KEYS = {
    "rope_factor": ("factor", 1.0),
    "rope_low_freq_factor": ("low_freq_factor", 1.0),
    "rope_high_freq_factor": ("high_freq_factor", 4.0),
    "rope_original_max_positions": ("original_max_position_embeddings", 8192),
}
ROPE_TYPES = ("default", "linear", "llama3")

# A block's parameter (path after blocks.<i>.) -> its tensor after model.layers.<i>., and
# whether the kernel is the tensor transposed.
_BLOCK = {
    "attn.q.kernel": ("self_attn.q_proj.weight", True),
    "attn.k.kernel": ("self_attn.k_proj.weight", True),
    "attn.v.kernel": ("self_attn.v_proj.weight", True),
    "attn.out.kernel": ("self_attn.o_proj.weight", True),
    "mlp.gate.kernel": ("mlp.gate_proj.weight", True),
    "mlp.up.kernel": ("mlp.up_proj.weight", True),
    "mlp.down.kernel": ("mlp.down_proj.weight", True),
    "attn_norm.scale": ("input_layernorm.weight", False),
    "mlp_norm.scale": ("post_attention_layernorm.weight", False),
}
# Present only where the family's switches say (qkv_bias, qk_norm).
_BIASES = {
    "attn.q.bias": ("self_attn.q_proj.bias", False),
    "attn.k.bias": ("self_attn.k_proj.bias", False),
    "attn.v.bias": ("self_attn.v_proj.bias", False),
}
_QK_NORMS = {
    "attn.q_norm.scale": ("self_attn.q_norm.weight", False),
    "attn.k_norm.scale": ("self_attn.k_norm.weight", False),
}
_SANDWICH = {
    "post_attn_norm.scale": ("post_attention_layernorm.weight", False),
    "post_mlp_norm.scale": ("post_feedforward_layernorm.weight", False),
}
_OPTIONAL = {**_BIASES, **_QK_NORMS, **_SANDWICH}
_OUTER = {
    "embed.token.embedding": ("model.embed_tokens.weight", False),
    "head.norm.scale": ("model.norm.weight", False),
    "head.lm_head.kernel": ("lm_head.weight", True),
}


class HFError(ConfigError):
    """A Hugging Face directory mpmd cannot read as a Llama; the message names the file and key
    (a ConfigError: the commands print it as one line and exit 2)."""


def directory_of(init_from: str) -> Path:
    """The directory of model.init_from = "hf:<directory>"; HFError saying the form otherwise."""
    if not isinstance(init_from, str) or not init_from.startswith(PREFIX) or not init_from[len(PREFIX) :]:
        raise HFError(
            f"model.init_from must be 'hf:<directory>' (a Hugging Face Llama's config.json and "
            f"safetensors) or 'run:<directory>' (a llama run of mpmd train), got {init_from!r}"
        )
    return Path(os.path.expanduser(init_from[len(PREFIX) :]))


def read_config(hf_dir) -> dict:
    """config.json of `hf_dir` as a dict; HFError naming the file when it is missing or not JSON."""
    path = Path(hf_dir) / CONFIG
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFError(
            f"{path} not found: a Hugging Face model directory holds config.json and its "
            f"safetensors (save one with model.save_pretrained(dir))"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise HFError(f"{path} must hold a JSON object, got {type(values).__name__}")
    return values


def family_of(hf_dir) -> Family:
    """The row of FAMILIES config.json's model_type (or architectures) names; HFError naming
    the ones mpmd reads otherwise."""
    c, path = read_config(hf_dir), Path(hf_dir) / CONFIG
    for family in FAMILIES.values():
        if c.get("model_type") == family.model_type or family.architecture in (c.get("architectures") or ()):
            return family
    known = ", ".join(f"{f.model_type!r} ({f.architecture})" for f in FAMILIES.values())
    raise HFError(
        f"{path}: model_type={c.get('model_type')!r}, architectures={c.get('architectures')!r}; "
        f"mpmd imports model_type {known}"
    )


def model_keys(hf_dir) -> dict:
    """The family's model.* keys config.json sets, with "kind" (the family's): sizes, GQA,
    head_dim, RoPE theta and scaling, RMSNorm epsilon, tied embeddings, the family's switches,
    a sliding window, Gemma 3's layer pattern (not seq_len: max_positions says how long it may
    be). HFError naming the key of what models/llama.py cannot compute."""
    c, path = read_config(hf_dir), Path(hf_dir) / CONFIG
    family = family_of(hf_dir)
    act_key, act = family.activation
    refused = {
        act_key: (act, c.get(act_key, act) != act),
        "attention_bias": (False, bool(c.get("attention_bias", False))),
        "mlp_bias": (False, bool(c.get("mlp_bias", False))),
    }
    if family.window == "qwen":
        refused["use_sliding_window"] = (False, bool(c.get("use_sliding_window", False)))
    if family.window == "gemma":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            refused[key] = (None, c.get(key) is not None)
        refused["use_bidirectional_attention"] = (False, bool(c.get("use_bidirectional_attention", False)))
    for key, (allowed, bad) in refused.items():
        if bad:
            raise HFError(f"{path}: {key}={c[key]!r}; models/llama.py computes only {key}={allowed!r}")
    out = {"kind": family.kind}
    for ours, (theirs, default) in KEYS.items():
        value = c.get(theirs, family.defaults.get(theirs, default))
        if value is None and ours == "num_kv_heads":
            value = c.get("num_attention_heads")
        if value is None:
            raise HFError(f"{path} has no {theirs!r} (model.{ours})")
        if ours in _INT_KEYS and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise HFError(f"{path}: {theirs}={value!r} must be a positive integer (model.{ours})")
        out[ours] = float(value) if ours == "norm_eps" else value
    head_dim = c.get("head_dim")
    if head_dim is not None and (
        isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2
    ):
        raise HFError(f"{path}: head_dim={head_dim!r} must be an even integer >= 2 (rotary pairs)")
    # head_dim is kept only where it is not hidden_size / num_attention_heads.
    out["head_dim"] = None if head_dim is None or head_dim * out["num_heads"] == out["d_model"] else head_dim
    if out["head_dim"] is None and (out["d_model"] % out["num_heads"] or (out["d_model"] // out["num_heads"]) % 2):
        raise HFError(
            f"{path}: hidden_size / num_attention_heads = {out['d_model']} / {out['num_heads']} is no "
            f"even head size, and config.json gives no head_dim"
        )
    out["qkv_bias"] = bool(family.fixed.get("qkv_bias", False))
    out["qk_norm"] = bool(family.fixed.get("qk_norm", False))
    window = c.get("sliding_window") if family.window == "all" else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise HFError(f"{path}: sliding_window={window!r} must be a positive integer or null")
    out["sliding_window"] = window
    if family.window == "gemma":
        out.update(_gemma_keys(c, path, out["num_layers"]))
        return out
    out["rope_theta"] = rope_theta_of(c, path)
    out.update(rope_scaling_of(c, path))
    return out


def _gemma_keys(c: dict, path, num_layers: int) -> dict:
    """Gemma 3's: query_scale, the local layers' sliding_window and rope_local_theta, the
    global ones' rope_theta and scaling, and global_every (every global_every-th layer is
    global, as layer_types says; HFError for any other pattern)."""
    out = {}
    for ours, (theirs, default) in GEMMA_KEYS.items():
        value = c.get(theirs, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise HFError(f"{path}: {theirs}={value!r} must be a positive number (model.{ours})")
        out[ours] = float(value) if ours == "query_scale" else value
    types = c.get("layer_types")
    every = c.get("sliding_window_pattern", 6)
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise HFError(f"{path}: layer_types must list one type per layer ({num_layers}), got {types!r}")
        globals_ = [i for i, t in enumerate(types) if t == "full_attention"]
        every = globals_[0] + 1 if globals_ else max(every, num_layers + 1)
        want = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)]
        if types != want:
            raise HFError(
                f"{path}: layer_types {types} is not every n-th layer global (full_attention), the "
                f"rest sliding_attention; models/llama.py computes only that pattern"
            )
    out["global_every"] = every
    rope = c.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    else:  # transformers 4.x: rope_theta, rope_scaling (global layers), rope_local_base_freq
        full = {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta", 1_000_000.0)}
        local = {"rope_type": "default", "rope_theta": c.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise HFError(f"{path}: the sliding_attention layers' rope type {local.get('rope_type')!r}; only 'default'")
    out["rope_theta"] = float(full.get("rope_theta", 1_000_000.0))
    out["rope_local_theta"] = float(local.get("rope_theta", 10_000.0))
    out.update(rope_scaling_of({"rope_parameters": full}, path))
    return out


def _hf_shapes(keys: dict) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor's shape ([out, in] for a projection) of each Llama parameter of
    model.* `keys`, by its model path without the layer (`blocks.<i>.`), as _BLOCK and _OUTER
    name them."""
    d, heads, kv, vocab, mlp = (keys[k] for k in ("d_model", "num_heads", "num_kv_heads", "vocab_size", "mlp_dim"))
    head_dim = keys.get("head_dim") or d // heads
    return {
        "attn.q.bias": (heads * head_dim,),
        "attn.k.bias": (kv * head_dim,),
        "attn.v.bias": (kv * head_dim,),
        "attn.q_norm.scale": (head_dim,),
        "attn.k_norm.scale": (head_dim,),
        "post_attn_norm.scale": (d,),
        "post_mlp_norm.scale": (d,),
        "attn.q.kernel": (heads * head_dim, d),
        "attn.k.kernel": (kv * head_dim, d),
        "attn.v.kernel": (kv * head_dim, d),
        "attn.out.kernel": (d, heads * head_dim),
        "mlp.gate.kernel": (mlp, d),
        "mlp.up.kernel": (mlp, d),
        "mlp.down.kernel": (d, mlp),
        "attn_norm.scale": (d,),
        "mlp_norm.scale": (d,),
        "embed.token.embedding": (vocab, d),
        "head.norm.scale": (d,),
        "head.lm_head.kernel": (vocab, d),
    }


def max_positions(hf_dir) -> int | None:
    """config.json's max_position_embeddings: the longest model.seq_len it was trained for."""
    return read_config(hf_dir).get("max_position_embeddings")


def _rope_parameters(c: dict) -> dict:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return rope if isinstance(rope, dict) else {"rope_type": rope}


def rope_theta_of(c: dict, path) -> float:
    """RoPE's base: `rope_parameters.rope_theta` (transformers >= 5) or `rope_theta`."""
    return float(_rope_parameters(c).get("rope_theta", c.get("rope_theta", DEFAULT_ROPE_THETA)))


def rope_scaling_of(c: dict, path) -> dict:
    """model.rope_type and, scaled, its model.rope_* factors (ROPE_KEYS) from config.json's
    `rope_parameters` (transformers >= 5) or `rope_scaling`; HFError naming a rope type
    models/llama.py does not compute (dynamic, yarn, longrope, ...)."""
    rope = _rope_parameters(c)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFError(
            f"{path}: rope type {kind!r} ({'rope_parameters' if 'rope_parameters' in c else 'rope_scaling'}); "
            f"models/llama.py computes the rope types {', '.join(map(repr, ROPE_TYPES))}"
        )
    out = {"rope_type": kind}
    if kind == "default":
        return out
    for ours, (theirs, default) in ROPE_KEYS.items():
        value = rope.get(theirs, default if kind == "llama3" or ours == "rope_factor" else None)
        if ours == "rope_factor" and theirs not in rope:
            raise HFError(f"{path}: rope type {kind!r} without a 'factor'")
        if value is not None:
            out[ours] = value
    return out


def hf_config(keys: dict, kind: str = "llama") -> dict:  # noqa: C901
    """config.json for model.kind `kind`'s family (FAMILIES) of the model.* keys `keys`
    (mlp_dim and num_kv_heads resolved: not None), float32 weights; max_position_embeddings
    = seq_len. RoPE's theta and the dtype are written as transformers 5 names them and,
    beside, as 4.x did (rope_theta, torch_dtype), so either reads them."""
    family = FAMILIES[kind]
    theta = float(keys["rope_theta"])
    rope = {"rope_type": keys.get("rope_type", "default"), "rope_theta": theta}
    if rope["rope_type"] != "default":
        rope.update({theirs: keys[ours] for ours, (theirs, _) in ROPE_KEYS.items() if keys.get(ours) is not None})
        if rope["rope_type"] == "linear":
            rope = {k: v for k, v in rope.items() if k in ("rope_type", "rope_theta", "factor")}
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        family.activation[0]: family.activation[1],
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
        "torch_dtype": "float32",
        "head_dim": keys.get("head_dim") or keys["d_model"] // keys["num_heads"],
        "max_position_embeddings": keys["seq_len"],
        "rope_parameters": rope,
        "rope_theta": theta,
    }
    if family.window == "all":
        out["sliding_window"] = keys.get("sliding_window")
    elif family.window == "qwen":
        out["use_sliding_window"] = False
    elif family.window == "gemma":
        every, n = keys["global_every"], keys["num_layers"]
        out["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
        out["sliding_window_pattern"] = every
        out["rope_parameters"] = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(keys["rope_local_theta"])},
        }
        out["rope_local_base_freq"] = float(keys["rope_local_theta"])
        out.update({theirs: keys[ours] for ours, (theirs, _) in GEMMA_KEYS.items()})
        scalar = float(keys["query_scale"])  # transformers' Gemma3TextConfig takes an int where it is one
        out["query_pre_attn_scalar"] = int(scalar) if scalar.is_integer() else scalar
        out.update(final_logit_softcapping=None, attn_logit_softcapping=None)
    out.update({theirs: keys[ours] for ours, (theirs, _) in KEYS.items()})
    return out


def param_paths(keys: dict) -> list[str]:
    """Every parameter's model path of a decoder of model.* `keys` (num_layers,
    tie_embeddings: a tied one has no lm_head; qkv_bias, qk_norm, and a family whose tensors
    include sandwich norms: their tensors)."""
    family = FAMILIES[keys.get("kind", "llama")]
    block = [*_BLOCK]
    block += [*_BIASES] if keys.get("qkv_bias") else []
    block += [*_QK_NORMS] if keys.get("qk_norm") else []
    block += [*_SANDWICH] if family.sandwich else []
    blocks = [f"blocks.{i}.{p}" for i in range(keys["num_layers"]) for p in block]
    tied = keys["tie_embeddings"]
    return ["embed.token.embedding", *blocks, "head.norm.scale", *([] if tied else ["head.lm_head.kernel"])]


def tensor_name(path: str, kind: str = "llama") -> tuple[str, bool]:
    """(Hugging Face tensor name, transposed) of a parameter's model path in model.kind
    `kind`'s format; HFError for a path that is no parameter of the decoder."""
    if path in _OUTER:
        return _OUTER[path]
    head, _, rest = path.partition(".")
    index, _, inner = rest.partition(".")
    if head == "blocks" and index.isdigit() and (inner in _BLOCK or inner in _OPTIONAL):
        renamed = FAMILIES[kind].renamed.get(inner)
        name, transposed = (renamed, False) if renamed else (_BLOCK.get(inner) or _OPTIONAL[inner])
        return f"model.layers.{index}.{name}", transposed
    raise HFError(f"{path!r} is not a parameter of models/llama.py's decoder")
