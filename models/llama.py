"""A Llama-style decoder built as an ordered list of single-array layers, like models/gpt.py.

Differences from the GPT: RMSNorm instead of LayerNorm, rotary position embeddings instead of
learned positions, a SwiGLU MLP, grouped-query attention (num_kv_heads key/value heads shared
by num_heads query heads), no biases. Rotary angles are computed inside each attention layer
from the sequence length, so nothing but the activation crosses a stage cut.

Packed sequences, as in models/gpt.py: keyword-only `segment_ids` (int [B, T]; attention
stays inside a segment) and `positions` (int [B, T]; the rotary angles' positions instead of
0..T-1) are taken by every Block and its Attention, fed from the batch to each stage that
holds blocks. Omitted (None), the model is exactly the unpacked one.

Mixed precision (`dtype="bfloat16"`): parameters are created and kept in float32 (so are
their gradients and the optimizer state); each layer casts its weights to `dtype` where it
uses them, as MaxText does. Activations, and so everything that crosses a stage cut, are in
`dtype`. Normalisation statistics, rotary angles and the attention softmax are computed in
float32; the logits are returned in float32, so the loss is float32.

Rematerialisation (`remat`): each Block's forward runs under `nnx.remat` (jax.checkpoint)
with a policy saying what its vjp may keep; the rest is recomputed in the backward pass.
  none           keep everything the vjp needs (fastest, most memory)
  block          keep only the block's input (jax.checkpoint_policies.nothing_saveable)
  dots_saveable  also keep the outputs of the projections (dots without batch dimensions);
                 attention scores, softmax, SwiGLU products and norms are recomputed
Under "none" in bfloat16 the vjp also keeps each bfloat16 copy of a weight (a matmul's input
gradient needs it) for every microbatch in flight; both remat policies recompute those casts.

Dropout (`dropout_rate` > 0): after the embedding and on each block's attention and MLP
outputs, each layer drawing from its own RNG stream (models/gpt.py `dropout`).

Tied embeddings (`tie_embeddings=True`, logits = h @ E^T): one weight used by the first and
the last layer. `layers()` cannot express that: mpmd.split turns each run of layers into its
own nnx.Module stage, and stages share no parameters, so the two copies would drift apart.
A tied model is instead cut at marks: pass `mark=mpmd.stage_boundary` and `stage_ends` (the
layer indices after which a stage ends); mpmd.split then makes the embedding a parameter of
both end stages and sums its gradients (mpmd.Pipeline.shared). models/ imports no mpmd, so
the mark comes in as an argument.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mpmd.models import kv_cache
from mpmd.models.gpt import (
    _EMBED_INIT,
    _check_per_token,
    _dropped,
    _linear,
    _require_positive,
    attention_mask,
    axes,
    dropout,
)

DTYPES = ("float32", "bfloat16")
# What a block's vjp keeps under each `remat` (None: no jax.checkpoint at all).
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _compute_dtype(dtype) -> jnp.dtype:
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return jnp.dtype(name)


class OffsetRMSNorm(nnx.Module):
    """RMSNorm scaling by (1 + scale), scale starting at 0 (Gemma's): the statistics and the
    product in float32, the result in `dtype`."""

    def __init__(self, dim: int, epsilon: float, dtype, axis: str | None, *, rngs: nnx.Rngs):
        self.epsilon, self.dtype = epsilon, dtype
        self.scale = nnx.Param(axes(nnx.initializers.zeros_init(), axis)(rngs.params(), (dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype or x.dtype)


def _rms_norm(
    d_model: int, dtype, epsilon: float = 1e-5, *, rngs: nnx.Rngs, axis: str | None = "embed", offset: bool = False
):
    if offset:
        return OffsetRMSNorm(d_model, epsilon, dtype, axis, rngs=rngs)
    # flax computes the mean square in float32 whatever the input dtype.
    return nnx.RMSNorm(
        d_model, epsilon=epsilon, dtype=dtype, scale_init=axes(nnx.initializers.ones_init(), axis), rngs=rngs
    )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Scaled rotary frequencies, as Hugging Face's `rope_parameters` name them: "linear"
    divides every frequency by `factor`; "llama3" (Llama 3.1 and later) divides the low ones
    by `factor`, keeps the high ones and blends between, by wavelength against
    `original_max_position_embeddings` / `low_freq_factor` and / `high_freq_factor`."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {', '.join(ROPE_TYPES)}, got {self.rope_type!r}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor!r} and {self.high_freq_factor!r}"
            )

    def scaled(self, inv_freq: jax.Array) -> jax.Array:
        if self.rope_type == "linear":
            return inv_freq / self.factor
        old = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        divided = jnp.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * divided / self.factor + smooth * divided
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, blended, divided)


ROPE_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    """What sets a family's attention apart from the plain Llama's (all off: Llama 2, or
    Llama 3.0). `head_dim`: per head, when not d_model / num_heads (Mistral-Nemo, Qwen 3);
    `qkv_bias`: biases on the q, k and v projections (Qwen 2.5); `qk_norm`: an RMSNorm over
    each head of q and of k before the rotation (Qwen 3); `rope_scaling`: RopeScaling or None;
    `sliding_window`: a query attends only to the last this many positions, itself included
    (Mistral 7B v0.1), None: all before it; `rope_theta`: this layer's rotary base in place of
    the model's (Gemma's local layers); `query_scale`: scores scaled by query_scale^-0.5 in
    place of head_dim^-0.5 (Gemma's query_pre_attn_scalar)."""

    head_dim: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    rope_theta: float | None = None
    query_scale: float | None = None

    def __post_init__(self):
        if self.head_dim is not None and (
            isinstance(self.head_dim, bool)
            or not isinstance(self.head_dim, int)
            or self.head_dim < 2
            or self.head_dim % 2
        ):
            raise ValueError(f"head_dim must be an even integer >= 2 (rotary pairs) or None, got {self.head_dim!r}")
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")


PLAIN = AttentionVariant()


@dataclasses.dataclass(frozen=True)
class BlockStyle:
    """What sets a family's blocks apart from the Llama's, model-wide (all off: Llama's).
    `norm_offset`: every RMSNorm scales by (1 + w), w starting at 0; `activation`: the gated
    MLP's, "silu" or "gelu_tanh"; `sandwich`: a norm after the attention and one after the
    MLP too, each before its residual add; `embed_scale`: the token embedding times
    sqrt(d_model). Gemma 3 has all four."""

    norm_offset: bool = False
    activation: str = "silu"
    sandwich: bool = False
    embed_scale: bool = False

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
LLAMA = BlockStyle()
GEMMA = BlockStyle(norm_offset=True, activation="gelu_tanh", sandwich=True, embed_scale=True)


def rotary(
    x: jax.Array, theta: float, positions: jax.Array | None = None, scaling: RopeScaling | None = None
) -> jax.Array:
    """Rotary position embedding of x [B, T, H, Dh] (Dh even) at positions 0..T-1, or at
    `positions` (int [B, T]: each row's own, for packed documents); frequencies scaled as
    `scaling` says (None: not).

    Pairs (i, i + Dh/2) rotate by angle t * theta^(-2i/Dh) (the GPT-NeoX / Hugging Face Llama
    layout), so q.k depends only on the positions' difference. Angles in float32: bf16 has
    8 bits of mantissa, too few for t * freq at positions in the thousands.
    """
    num_steps, head_dim = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [Dh/2]
    if scaling is not None:
        inv_freq = scaling.scaled(inv_freq)
    if positions is None:
        angles = jnp.arange(num_steps, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, Dh/2]
        cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    else:
        _check_per_token("positions", positions, x.shape[:2])
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
        cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Embed(nnx.Module):
    """int32 tokens [B, T] -> token embedding [B, T, D] in the compute dtype (no positions:
    they enter as rotations inside attention)."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        seq_len: int,
        dtype="float32",
        drop: nnx.Dropout | None = None,
        scaled: bool = False,
        *,
        rngs: nnx.Rngs,
    ):
        _require_positive(vocab_size=vocab_size, d_model=d_model, seq_len=seq_len)
        self.seq_len = seq_len
        # Gemma's: the embedding times sqrt(d_model) (BlockStyle.embed_scale).
        self.scale = math.sqrt(d_model) if scaled else None
        self.token = nnx.Embed(
            vocab_size,
            d_model,
            dtype=_compute_dtype(dtype),
            embedding_init=axes(_EMBED_INIT, "vocab", "embed"),
            rngs=rngs,
        )
        self.drop = drop

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, time], got {tokens.shape}")
        if tokens.shape[1] > self.seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's seq_len={self.seq_len}")
        x = self.token(tokens)
        if self.scale is not None:
            x = x * jnp.asarray(self.scale, jnp.float32).astype(x.dtype)
        return _dropped(self.drop, x)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions: num_heads query heads, in
    groups of num_heads // num_kv_heads sharing one key/value head; `variant`: a family's
    differences (AttentionVariant). `segment_ids` and `positions` [B, T]: packed rows
    (module doc)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        rope_theta: float = 10_000.0,
        dtype="float32",
        variant: AttentionVariant = PLAIN,
        norm_eps: float = 1e-5,
        norm_offset: bool = False,
        *,
        rngs: nnx.Rngs,
    ):
        _require_positive(d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if variant.head_dim is None and (d_model % num_heads or (d_model // num_heads) % 2):
            raise ValueError(
                f"d_model={d_model} must be num_heads={num_heads} x an even head size "
                f"(rotary embeddings rotate pairs of dimensions), or head_dim given"
            )
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.rope_theta = variant.rope_theta if variant.rope_theta is not None else rope_theta
        self.variant = variant
        self.head_dim = head_dim = variant.head_dim or d_model // num_heads
        dtype = _compute_dtype(dtype)
        bias = variant.qkv_bias
        proj = lambda d_out, names: _linear(d_model, d_out, names, use_bias=bias, dtype=dtype, rngs=rngs)
        self.q = proj(num_heads * head_dim, ("embed", "heads"))
        self.k = proj(num_kv_heads * head_dim, ("embed", "kv"))
        self.v = proj(num_kv_heads * head_dim, ("embed", "kv"))
        self.out = _linear(num_heads * head_dim, d_model, ("heads", "embed"), use_bias=False, dtype=dtype, rngs=rngs)
        if variant.qk_norm:
            self.q_norm = _rms_norm(head_dim, dtype, norm_eps, rngs=rngs, axis=None, offset=norm_offset)
            self.k_norm = _rms_norm(head_dim, dtype, norm_eps, rngs=rngs, axis=None, offset=norm_offset)

    def _heads(self, x: jax.Array, positions) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, T, H, Dh] and k [B, T, KV, Dh] normed (qk_norm) and rotated, v [B, T, KV, Dh]."""
        batch, num_steps, _ = x.shape
        q = self.q(x).reshape(batch, num_steps, self.num_heads, self.head_dim)
        k = self.k(x).reshape(batch, num_steps, self.num_kv_heads, self.head_dim)
        if self.variant.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        scaling = self.variant.rope_scaling
        q, k = rotary(q, self.rope_theta, positions, scaling), rotary(k, self.rope_theta, positions, scaling)
        return q, k, self.v(x).reshape(batch, num_steps, self.num_kv_heads, self.head_dim)

    def __call__(
        self, x: jax.Array, *, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        batch, num_steps, _ = x.shape
        kv, group, head_dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q, k, v = self._heads(x, positions)
        # Query head h = g_kv * group + j uses key/value head g_kv: [B, T, KV, G, Dh].
        q = q.reshape(batch, num_steps, kv, group, head_dim)
        # Scores [B, KV, G, Tq, Tk] in float32, scaled by 1/sqrt(Dh) (variance independent of Dh).
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(
            self.variant.query_scale or head_dim
        )
        mask = attention_mask(batch, num_steps, segment_ids)
        if self.variant.sliding_window is not None:
            mask = mask & ~jnp.tril(jnp.ones((num_steps, num_steps), dtype=bool), -self.variant.sliding_window)
        mask = mask if segment_ids is None else mask[:, None, None]  # [B, 1, 1, Tq, Tk]: every head
        # Every row keeps its diagonal; a finite minimum (not -inf) keeps gradients NaN-free.
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        attended = jnp.einsum("bkgqs,bskd->bqkgd", weights, v)
        return self.out(attended.reshape(batch, num_steps, self.num_heads * head_dim))

    def empty_cache(self, batch: int, num_slots: int) -> kv_cache.LayerCache:
        return kv_cache.empty(batch, num_slots, self.num_kv_heads, self.head_dim, self.q.dtype or jnp.float32)

    def decode(self, x: jax.Array, cache: kv_cache.LayerCache, start) -> tuple[jax.Array, kv_cache.LayerCache]:
        """(output [B, T, D], cache) of T new tokens at window positions start.. (rotated at
        those positions) attending to the cached keys and to themselves (models/kv_cache.py)."""
        q, k, v = self._heads(x, kv_cache.positions(x.shape[0], x.shape[1], start))
        attended, cache = kv_cache.attend(q, k, v, cache, start, self.variant.sliding_window, self.variant.query_scale)
        return self.out(attended), cache


class SwiGLU(nnx.Module):
    """down(act(gate(x)) * up(x)): D -> mlp_dim -> D; act SiLU (or `activation`: ACTIVATIONS')."""

    def __init__(self, d_model: int, mlp_dim: int, dtype="float32", activation: str = "silu", *, rngs: nnx.Rngs):
        _require_positive(d_model=d_model, mlp_dim=mlp_dim)
        dtype = _compute_dtype(dtype)
        self.gate = _linear(d_model, mlp_dim, ("embed", "mlp"), use_bias=False, dtype=dtype, rngs=rngs)
        self.up = _linear(d_model, mlp_dim, ("embed", "mlp"), use_bias=False, dtype=dtype, rngs=rngs)
        self.down = _linear(mlp_dim, d_model, ("mlp", "embed"), use_bias=False, dtype=dtype, rngs=rngs)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(ACTIVATIONS[self.activation](self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); [B, T, D] -> [B, T, D],
    rematerialised in the backward pass as `remat` says (REMAT_POLICIES). `drop`: residual
    dropout on the attention's and the MLP's outputs (a recompute redraws the same masks).
    `variant`: its attention's (AttentionVariant); `style`: BlockStyle (with `sandwich`,
    x + post_norm(attn(norm(x))) and likewise for the MLP)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        mlp_dim: int,
        rope_theta: float = 10_000.0,
        dtype="float32",
        remat: str = "none",
        drop: nnx.Dropout | None = None,
        norm_eps: float = 1e-5,
        variant: AttentionVariant = PLAIN,
        style: BlockStyle = LLAMA,
        *,
        rngs: nnx.Rngs,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")
        self.remat = remat
        dt, offset = _compute_dtype(dtype), style.norm_offset
        self.attn_norm = _rms_norm(d_model, dt, norm_eps, rngs=rngs, offset=offset)
        self.attn = Attention(d_model, num_heads, num_kv_heads, rope_theta, dtype, variant, norm_eps, offset, rngs=rngs)
        self.mlp_norm = _rms_norm(d_model, dt, norm_eps, rngs=rngs, offset=offset)
        self.mlp = SwiGLU(d_model, mlp_dim, dtype, style.activation, rngs=rngs)
        if style.sandwich:
            self.post_attn_norm = _rms_norm(d_model, dt, norm_eps, rngs=rngs, offset=offset)
            self.post_mlp_norm = _rms_norm(d_model, dt, norm_eps, rngs=rngs, offset=offset)
        self.sandwich = style.sandwich
        self.drop = drop

    def _residual(self, x: jax.Array, y: jax.Array, post: str) -> jax.Array:
        """x + y, y normed by the block's `post` norm first where it has one (sandwich)."""
        return x + _dropped(self.drop, getattr(self, post)(y) if self.sandwich else y)

    def forward(
        self, x: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        x = self._residual(
            x, self.attn(self.attn_norm(x), segment_ids=segment_ids, positions=positions), "post_attn_norm"
        )
        return self._residual(x, self.mlp(self.mlp_norm(x)), "post_mlp_norm")

    def __call__(
        self, x: jax.Array, *, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        if self.remat == "none":
            return self.forward(x, segment_ids, positions)
        return nnx.remat(Block.forward, policy=REMAT_POLICIES[self.remat])(self, x, segment_ids, positions)

    def decode(self, x: jax.Array, cache: kv_cache.LayerCache, start) -> tuple[jax.Array, kv_cache.LayerCache]:
        """forward for T new tokens at window positions start.., with the attention's cache
        (no remat: decoding takes no gradient)."""
        attended, cache = self.attn.decode(self.attn_norm(x), cache, start)
        x = self._residual(x, attended, "post_attn_norm")
        return self._residual(x, self.mlp(self.mlp_norm(x)), "post_mlp_norm"), cache


class Head(nnx.Module):
    """Final RMSNorm + LM head: [B, T, D] -> float32 logits [B, T, vocab_size]. `tied`: the
    token Embed whose table (transposed) is the head's weight, instead of a weight of its own."""

    def __init__(
        self,
        d_model: int,
        vocab_size: int,
        dtype="float32",
        tied: Embed | None = None,
        norm_eps: float = 1e-5,
        norm_offset: bool = False,
        *,
        rngs: nnx.Rngs,
    ):
        _require_positive(d_model=d_model, vocab_size=vocab_size)
        self.dtype = _compute_dtype(dtype)
        self.norm = _rms_norm(d_model, self.dtype, norm_eps, rngs=rngs, offset=norm_offset)
        # A shared nnx.Param: nnx.state lists it once, with the embedding.
        self.table = tied.token.embedding if tied is not None else None
        # Small init (0.02): unit-scale initial logits start the loss above ln(vocab_size).
        self.lm_head = (
            None
            if tied is not None
            else _linear(
                d_model,
                vocab_size,
                ("embed", "vocab"),
                use_bias=False,
                dtype=self.dtype,
                kernel_init=nnx.initializers.normal(0.02),
                rngs=rngs,
            )
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        logits = self.lm_head(x) if self.lm_head is not None else x @ self.table[...].astype(self.dtype).T
        return logits.astype(jnp.float32)


class Llama(nnx.Module):
    """Decoder-only LM: Embed, num_layers Blocks, Head. tokens [B, T] -> float32 logits [B, T, V].

    `norm_eps`: every RMSNorm's epsilon (Hugging Face Llamas use 1e-6 or 1e-5).
    `attention`: a family's differences in attention (AttentionVariant: head_dim, biases,
    q/k norms, scaled rotary frequencies, a sliding window; Mistral, Qwen 2.5 and 3), or one
    per block (Gemma 3's local and global layers); `style`: its blocks' (BlockStyle: Gemma's
    (1 + w) norms, GELU, sandwich norms, scaled embedding).
    `mlp_dim` None: the SwiGLU width whose three matrices hold about as many weights as a
    4 x d_model GELU MLP's two (8/3 x d_model), rounded up to a multiple of 64.
    `stage_ends`/`mark`: `mark(x)` is applied to the activation after each layer index in
    `stage_ends` (0 = the embedding; see the module doc); a tied model needs them to be split.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        seq_len: int,
        num_kv_heads: int | None = None,
        mlp_dim: int | None = None,
        rope_theta: float = 10_000.0,
        tie_embeddings: bool = False,
        dtype="float32",
        remat: str = "none",
        stage_ends=(),
        mark=None,
        dropout_rate: float = 0.0,
        dropout_seed: int = 0,
        norm_eps: float = 1e-5,
        attention: AttentionVariant | tuple = PLAIN,
        style: BlockStyle = LLAMA,
        *,
        rngs: nnx.Rngs,
    ):
        _require_positive(
            vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers, seq_len=seq_len
        )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        mlp_dim = mlp_dim if mlp_dim is not None else math.ceil(8 * d_model / 3 / 64) * 64
        variants = (attention,) * num_layers if isinstance(attention, AttentionVariant) else tuple(attention)
        if len(variants) != num_layers or not all(isinstance(v, AttentionVariant) for v in variants):
            raise ValueError(
                f"attention must be one AttentionVariant or one per block ({num_layers}), got {attention!r}"
            )
        drop0 = dropout(dropout_rate, dropout_seed, 0)
        self.embed = Embed(vocab_size, d_model, seq_len, dtype, drop0, style.embed_scale, rngs=rngs)
        # nnx.List: flax 0.12 tracks the params of modules held this way, not in plain lists.
        self.blocks = nnx.List(
            [
                Block(
                    d_model,
                    num_heads,
                    num_kv_heads,
                    mlp_dim,
                    rope_theta,
                    dtype,
                    remat,
                    dropout(dropout_rate, dropout_seed, i + 1),
                    norm_eps,
                    variants[i],
                    style,
                    rngs=rngs,
                )
                for i in range(num_layers)
            ]
        )
        tied = self.embed if tie_embeddings else None
        self.head = Head(d_model, vocab_size, dtype, tied, norm_eps, style.norm_offset, rngs=rngs)
        self.seq_len, self.tie_embeddings = seq_len, tie_embeddings
        self.cut_after(stage_ends, mark)

    def cut_after(self, stage_ends, mark) -> None:
        """From now on apply `mark` (e.g. mpmd.stage_boundary) after each layer index in
        `stage_ends` (0 = the embedding, len(blocks) = the last block)."""
        num_blocks = len(self.blocks)
        stage_ends = tuple(stage_ends)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= num_blocks for i in stage_ends):
            raise ValueError(
                f"stage_ends must be layer indices in 0..{num_blocks} (a stage ends after that layer), got {stage_ends}"
            )
        if stage_ends and not callable(mark):
            raise ValueError(f"stage_ends needs a callable mark (e.g. mpmd.stage_boundary), got {mark!r}")
        self.stage_ends, self.mark = tuple(sorted(set(stage_ends))), mark

    def sample_input(self, batch: int = 1) -> jax.Array:
        """A zero batch of full-length token rows: what cost analysis traces to balance a split."""
        return jnp.zeros((batch, self.seq_len), jnp.int32)

    def all_layers(self) -> list[nnx.Module]:
        """[Embed, Block_0.., Head] in application order, tied or not."""
        return [self.embed, *self.blocks, self.head]

    def layers(self) -> list[nnx.Module]:
        """The layers to cut into stages by position (mpmd.split with num_stages)."""
        if self.tie_embeddings:
            raise ValueError(
                "a Llama with tie_embeddings=True cannot be cut by layers(): its Embed and "
                "Head share the token table, and stages made of layers share no parameters "
                "(the two copies would train apart). Cut it at marks instead: "
                "Llama(..., stage_ends=(...), mark=mpmd.stage_boundary)"
            )
        return self.all_layers()

    def __call__(
        self, tokens: jax.Array, *, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """float32 logits [B, T, V]; `segment_ids`/`positions` [B, T] for packed rows (module doc)."""
        x = tokens
        for i, layer in enumerate(self.all_layers()):
            x = layer(x, segment_ids=segment_ids, positions=positions) if isinstance(layer, Block) else layer(x)
            if i in self.stage_ends:
                x = self.mark(x)
        return x

    def empty_cache(self, batch: int = 1) -> list[kv_cache.LayerCache]:
        """Per block, a key-value cache of seq_len slots (num_kv_heads wide) holding nothing yet."""
        return [block.attn.empty_cache(batch, self.seq_len) for block in self.blocks]

    def decode(self, tokens: jax.Array, cache: list, start) -> tuple[jax.Array, list]:
        """(float32 logits [B, T, V], cache) of T new tokens at window positions start ..
        start+T-1 (start + T <= seq_len), earlier positions' keys and values read from `cache`
        (models/gpt.py GPT.decode; `start` a scalar or int32 [B], each row rotated at its own
        positions). Decoding runs on one process: stage marks are not applied."""
        x = self.embed(tokens)
        x, cache = kv_cache.through(self.blocks, x, cache, start)
        return self.head(x), cache
