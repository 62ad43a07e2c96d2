"""model.kind='llama', 'mistral', 'qwen2', 'qwen3': the decoder LM of models/llama.py
(grouped-query attention, SwiGLU, rotary embeddings, optional tied embeddings cut at stage
marks, bf16, remat) and the families that are it with a few switches (AttentionVariant):
Mistral (a head_dim of its own, a sliding window), Qwen 2.5 (biases on q, k and v), Qwen 3
(RMSNorm on each head of q and k); Llama 3.1+'s scaled rotary frequencies for any of them.
Each kind reads and writes its own Hugging Face format (mpmd/recipes/families/hf.py
FAMILIES)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from mpmd.recipes.families import hf
from mpmd.recipes.config import Config, ConfigError, ModelSection
from mpmd.recipes.families.gpt import DecoderSection, decoder_problems, lm_loss, seq_len, LM_READS
from mpmd.recipes.registry import ModelSpec, flax_build, register_model_spec


class ComputeSection(ModelSection):
    """How a model computes (a custom builder may read these too)."""

    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="compute and activation dtype (also what crosses slices); parameters, "
        "gradients, optimizer state and the loss stay float32",
    )
    remat: Literal["none", "block", "dots_saveable"] = Field(
        "none",
        description="rematerialisation of each block in the backward: none = keep every "
        "residual; block = keep only block inputs; dots_saveable = also keep projection "
        "outputs (recompute attention, norms, activations)",
    )


class LlamaSection(DecoderSection, ComputeSection):
    # The keys model.init_from gives (config.json's, or a run's config.yaml's: what the
    # parameters' shapes and meaning depend on, not seq_len: rotary positions take any
    # length); a recipe file's values for them yield to it (loading.yield_to_init_from).
    FROM_INIT: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "d_model",
        "num_heads",
        "num_layers",
        "num_kv_heads",
        "mlp_dim",
        "norm_eps",
        "tie_embeddings",
        "rope_theta",
        "rope_type",
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_positions",
        "head_dim",
        "qkv_bias",
        "qk_norm",
        "sliding_window",
    )
    kind: Literal["llama"] = Field("llama", description="which model to build")
    num_kv_heads: int | None = Field(
        None,
        gt=0,
        le=2**12,
        description="key/value heads (grouped-query attention), dividing num_heads; null = num_heads",
    )
    mlp_dim: int | None = Field(
        None, gt=0, le=2**20, description="SwiGLU hidden width; null = 8/3 x d_model rounded up to a multiple of 64"
    )
    tie_embeddings: bool = Field(
        False,
        description="the LM head is the token embedding transposed (the model is then cut "
        "at stage marks, and the embedding's gradients are summed across the two stages)",
    )
    rope_theta: float = Field(10_000.0, gt=0, description="rotary embedding base (Llama 3 uses 500000)")
    rope_type: Literal["default", "linear", "llama3"] = Field(
        "default",
        description="rotary frequencies: default; linear = all divided by rope_factor; llama3 = "
        "Llama 3.1's (low ones divided by rope_factor, high ones kept, blended between)",
    )
    rope_factor: float = Field(1.0, gt=0, le=2**20, description="rope_type linear/llama3: the scaling factor")
    rope_low_freq_factor: float = Field(1.0, gt=0, le=2**20, description="rope_type llama3: low_freq_factor")
    rope_high_freq_factor: float = Field(4.0, gt=0, le=2**20, description="rope_type llama3: high_freq_factor")
    rope_original_max_positions: int = Field(
        8192, gt=0, le=2**24, description="rope_type llama3: the context length the model was pretrained at"
    )
    head_dim: int | None = Field(
        None, gt=0, le=2**12, description="width of each attention head; null = d_model / num_heads"
    )
    qkv_bias: bool = Field(False, description="biases on the q, k and v projections (Qwen 2.5)")
    qk_norm: bool = Field(False, description="an RMSNorm over each head of q and of k (Qwen 3)")
    sliding_window: int | None = Field(
        None, gt=0, le=2**24, description="each position attends to at most this many (itself included); null = all"
    )
    norm_eps: float = Field(1e-5, gt=0, description="every RMSNorm's epsilon")
    init_from: str | None = Field(
        None,
        description="hf:<directory> = start from a Hugging Face Llama's config.json and safetensors "
        "(its sizes, GQA, rope_theta, norm_eps and tie_embeddings become these keys: one set "
        "otherwise is refused); run:<directory> = from the newest committed checkpoint of "
        "another llama run of mpmd train (its config.yaml's sizes, likewise); null = the "
        "seeded random init",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_hf(cls, values):
        """model.init_from's config.json (or run's config.yaml) sets the sizes; a key also given
        must agree with it."""
        if not isinstance(values, dict) or values.get("init_from") is None:
            return values
        init_from = values["init_from"]
        kind = values.get("kind", cls.model_fields["kind"].default)
        if isinstance(init_from, str) and init_from.startswith(RUN_PREFIX):
            keys, longest, source = _run_keys(init_from, kind, cls.FROM_INIT), None, "config.yaml"
            named = lambda key: f"model.{key}"
        else:
            hf_dir = hf.directory_of(init_from)
            try:
                family = hf.family_of(hf_dir)
                if kind != family.kind:
                    raise ValueError(
                        f"model.init_from={init_from!r} is a {family.architecture} (model_type "
                        f"{family.model_type!r}): set model.kind={family.kind}, not {kind!r}"
                    )
                keys, longest = hf.model_keys(hf_dir), hf.max_positions(hf_dir)
                hf.check_tensors(hf_dir, keys)  # before any model is built from the keys
            except hf.HFError as e:
                raise ValueError(f"model.init_from={init_from!r}: {e}") from None
            source, named = hf.CONFIG, lambda key: hf.KEYS.get(key, (key,))[0]
        for key, value in keys.items():
            if key in values and values[key] != value:
                raise ValueError(
                    f"model.{key}={values[key]!r} disagrees with model.init_from={init_from!r}, "
                    f"whose {source} gives {named(key)}={value!r}: leave "
                    f"model.{key} out (it comes from there)"
                )
        seq_len = values.get("seq_len", cls.model_fields["seq_len"].default)
        if longest is not None and isinstance(seq_len, int) and seq_len > longest:
            raise ValueError(
                f"model.seq_len={seq_len} exceeds max_position_embeddings={longest} of "
                f"model.init_from={values['init_from']!r}: set model.seq_len <= {longest}"
            )
        return {**values, **keys}


RUN_PREFIX = "run:"  # model.init_from = "run:<run directory of mpmd train>"


def _run_directory(init_from: str) -> Path:
    return Path(init_from[len(RUN_PREFIX) :]).expanduser()


def _run_keys(init_from: str, kind: str, keys: tuple[str, ...]) -> dict:
    """The model `keys` of the `kind` run `run:<dir>` names; ValueError naming what is wrong."""
    from mpmd.recipes import config

    file = _run_directory(init_from) / "config.yaml"
    if not file.is_file():
        raise ValueError(
            f"model.init_from={init_from!r}: {file} not found; 'run:<directory>' names a run directory of mpmd train"
        )
    model = config.values_of(file).get("model") or {}
    if model.get("kind") != kind:
        raise ValueError(
            f"model.init_from={init_from!r} trained model.kind={model.get('kind')!r}; a {kind} starts "
            f"only from a {kind} run"
        )
    return {key: model[key] for key in keys if key in model}


def _run_params(init_from: str):
    """Mpmd.Trainer's init_params reading the parameters of `run:<dir>`'s newest committed
    checkpoint by path (all of them into this process at the first call: for models one host holds)."""
    from mpmd.train.checkpoint_reader import committed_step, read_leaves

    run = _run_directory(init_from)
    try:
        step = committed_step(run.resolve())
    except ValueError as e:
        raise ConfigError(f"model.init_from={init_from!r}: {e}") from None
    leaves: dict = {}

    def read(paths):
        if not leaves:
            leaves.update(read_leaves(run, step, prefix="params/")[1])
        return [leaves[f"params/{path}"] for path in paths]

    return read


def _problems(cfg: Config) -> list[str]:
    m = cfg.model
    out = decoder_problems(cfg)
    if m.head_dim is not None and m.head_dim % 2:
        out.append(f"model.head_dim={m.head_dim} must be even (rotary embeddings rotate pairs of dimensions)")
    if m.head_dim is None and not m.d_model % m.num_heads and (m.d_model // m.num_heads) % 2:
        out.append(
            f"model.d_model / model.num_heads = {m.d_model // m.num_heads} must be even "
            f"(rotary embeddings rotate pairs of dimensions)"
        )
    if m.rope_type == "llama3" and not m.rope_low_freq_factor < m.rope_high_freq_factor:
        out.append(
            f"model.rope_low_freq_factor={m.rope_low_freq_factor} must be less than "
            f"model.rope_high_freq_factor={m.rope_high_freq_factor} (rope_type llama3)"
        )
    if m.num_kv_heads is not None and m.num_heads % m.num_kv_heads:
        out.append(f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}")
    return out


def attention_variant(m):
    """models/llama.py's AttentionVariant of a llama-like model section: one for every block,
    or (gemma3) a tuple of one per block, local and global."""
    from mpmd.models.llama import AttentionVariant, RopeScaling

    scaling = None
    if m.rope_type != "default":
        scaling = RopeScaling(
            m.rope_type, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_positions
        )
    if m.kind != "gemma3":
        return AttentionVariant(m.head_dim, m.qkv_bias, m.qk_norm, scaling, m.sliding_window)
    local = AttentionVariant(
        m.head_dim, m.qkv_bias, m.qk_norm, None, m.sliding_window, m.rope_local_theta, m.query_scale
    )
    full = AttentionVariant(m.head_dim, m.qkv_bias, m.qk_norm, scaling, None, None, m.query_scale)
    return tuple(full if (i + 1) % m.global_every == 0 else local for i in range(m.num_layers))


def block_style(m):
    """models/llama.py's BlockStyle of the section's kind (Gemma's, or the Llama's)."""
    from mpmd.models import llama

    return llama.GEMMA if m.kind == "gemma3" else llama.LLAMA


def _llama(cfg: Config, rngs):
    from mpmd import models

    m = cfg.model
    return models.Llama(
        m.vocab_size,
        m.d_model,
        m.num_heads,
        m.num_layers,
        m.seq_len,
        num_kv_heads=m.num_kv_heads,
        mlp_dim=m.mlp_dim,
        rope_theta=m.rope_theta,
        tie_embeddings=m.tie_embeddings,
        dtype=m.dtype,
        remat=m.remat,
        dropout_rate=m.dropout,
        dropout_seed=cfg.seed,
        norm_eps=m.norm_eps,
        attention=attention_variant(m),
        style=block_style(m),
        rngs=rngs,
    )


def _init_params(cfg: Config):
    """model.init_from's tensors, read stage by stage as each slice needs them (hf.Weights.read;
    a run's checkpoint: _run_params); None: the seeded init."""
    init_from = cfg.model.init_from
    if init_from is None:
        return None
    if init_from.startswith(RUN_PREFIX):
        return _run_params(init_from)
    weights = hf.open(hf.directory_of(init_from))
    if note := weights.dtype_note():
        print(note)
    return weights.read


def _split(cfg: Config, model, sample_input):
    """A tied Llama cut at marks after the layers that balance the stages' FLOPs (layers()
    cannot cut it: see models/llama.py); one stage needs no cut. None: the usual split."""
    if not cfg.model.tie_embeddings:
        return None
    import jax
    from flax import nnx

    import mpmd
    from mpmd.stages.costs import layer_costs
    from mpmd.stages.split import balanced_boundaries

    num_stages = cfg.pipeline.num_stages
    if cfg.pipeline.cuts is not None:
        raise ConfigError(
            "pipeline.cuts cannot cut a llama with model.tie_embeddings=true (it is cut at "
            "stage marks placed by cost); set pipeline.cuts=null"
        )
    if num_stages == 1:
        return [model]
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(nnx.state(model))):
        raise ConfigError(
            "model.tie_embeddings=true cuts the model at stage marks, which needs the model "
            "built (mpmd cannot yet cut an abstract model at marks)"
        )
    costs, _ = layer_costs(model.all_layers(), sample_input)
    bounds = balanced_boundaries(costs, num_stages)
    model.cut_after([b - 1 for b in bounds[1:-1]], mpmd.stage_boundary)
    return mpmd.split(model, num_stages, sample_input)  # Stages: they name each leaf by model path


def _units(cfg: Config, model):
    if cfg.model.tie_embeddings:
        raise ConfigError(
            "mpmd tune cannot cut a llama with model.tie_embeddings=true (its stages are "
            "cut at marks); tune with model.tie_embeddings=false"
        )
    return None


class MistralSection(LlamaSection):
    kind: Literal["mistral"] = Field("mistral", description="which model to build")


class Qwen2Section(LlamaSection):
    kind: Literal["qwen2"] = Field("qwen2", description="which model to build")
    qkv_bias: bool = Field(True, description="biases on the q, k and v projections (Qwen 2.5)")


class Qwen3Section(LlamaSection):
    kind: Literal["qwen3"] = Field("qwen3", description="which model to build")
    qk_norm: bool = Field(True, description="an RMSNorm over each head of q and of k (Qwen 3)")


class Gemma3Section(LlamaSection):
    """Gemma 3 (text): the decoder with (1 + w) RMSNorms, GELU-tanh, a norm after the attention
    and the MLP too, the embedding scaled by sqrt(d_model), q/k norms, and local layers (a
    sliding window, their own rotary base) with every global_every-th layer global."""

    FROM_INIT: ClassVar[tuple[str, ...]] = (*LlamaSection.FROM_INIT, "query_scale", "global_every", "rope_local_theta")
    kind: Literal["gemma3"] = Field("gemma3", description="which model to build")
    qk_norm: bool = Field(True, description="an RMSNorm over each head of q and of k")
    rope_theta: float = Field(1_000_000.0, gt=0, description="the global layers' rotary base")
    rope_local_theta: float = Field(10_000.0, gt=0, description="the local (sliding-window) layers' rotary base")
    sliding_window: int | None = Field(
        512, gt=0, le=2**24, description="the local layers' window: each position attends to this many"
    )
    global_every: int = Field(
        6, gt=0, le=4096, description="every global_every-th layer is global (full attention), the rest local"
    )
    query_scale: float = Field(
        256.0, gt=0, description="attention scores are scaled by query_scale^-0.5 (query_pre_attn_scalar)"
    )


def _spec(kind: str, section) -> ModelSpec:
    return ModelSpec(
        kind,
        section,
        build=flax_build(_llama),
        loss=lm_loss,
        reads=LM_READS,
        tokens_per_example=seq_len,
        split=_split,
        units=_units,
        init_params=_init_params,
        # mpmd cannot yet cut an abstract model at marks: a tied Llama is built for real.
        can_be_abstract=lambda cfg: not cfg.model.tie_embeddings,
        samples_text=True,
        problems=_problems,
    )


SPEC = register_model_spec(_spec("llama", LlamaSection))
for _kind, _section in (
    ("mistral", MistralSection),
    ("qwen2", Qwen2Section),
    ("qwen3", Qwen3Section),
    ("gemma3", Gemma3Section),
):
    register_model_spec(_spec(_kind, _section))
