"""A GPT-style decoder-only language model built as an ordered list of layers.

Every layer takes one array and returns one array, so the model can be cut between any two
layers into pipeline stages without threading extra state (masks, positions, caches) across
the cut: `GPT.layers()` is that list, and `GPT.__call__` applies it in order.

Packed sequences: several documents in one row, told apart by keyword-only `segment_ids`
(int [B, T]: a token attends only to earlier-or-same positions of its own segment, which
every Block takes) and `positions` (int [B, T]: each token's place in its document, which
Embed takes instead of 0..T-1). They come from the batch, not across a cut: a pipeline feeds
each stage the keys its layers declare. Omitted (None), the model is exactly the unpacked one.

Float32 throughout. Dropout (`dropout_rate` > 0) after the embedding and on each block's
attention and MLP outputs, each layer drawing from its own RNG stream (`dropout`); at rate 0
(the default) there is none and a forward pass is a pure function of params and tokens.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mpmd.models import kv_cache

# nanoGPT / GPT-2 initialise embeddings with N(0, 0.02); the nnx.Embed default (unit variance
# per row) makes the residual stream start far larger than the attention/MLP updates.
_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


def axes(init, *names: str | None):
    """`init` annotated with the logical axis names of the array it makes (one per dim), which
    mpmd.stages.sharding's rules map onto a slice's mesh. Metadata only: the values are unchanged,
    and nothing is sharded when the module is built (eager_sharding=False)."""
    return nnx.with_partitioning(init, names, eager_sharding=False)


def _linear(
    d_in: int, d_out: int, names: tuple, *, use_bias: bool = True, kernel_init=None, dtype=None, rngs: nnx.Rngs
):
    """nnx.Linear whose kernel has logical axes `names` (in, out) and bias `names[1]`; float32
    parameters, computed in `dtype` (None: the input's)."""
    kernel_init = kernel_init or nnx.nn.linear.default_kernel_init
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=use_bias,
        kernel_init=axes(kernel_init, *names),
        bias_init=axes(nnx.initializers.zeros_init(), names[1]),
        dtype=dtype,
        rngs=rngs,
    )


def _layer_norm(d_model: int, *, rngs: nnx.Rngs):
    return nnx.LayerNorm(
        d_model,
        scale_init=axes(nnx.initializers.ones_init(), "embed"),
        bias_init=axes(nnx.initializers.zeros_init(), "embed"),
        rngs=rngs,
    )


def _require_positive(**sizes: int) -> None:
    """Raises ValueError naming every argument that is not a positive int."""
    bad = [
        f"{name}={value!r}"
        for name, value in sizes.items()
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0
    ]
    if bad:
        raise ValueError(f"sizes must be positive integers, got {', '.join(bad)}")


class Embed(nnx.Module):
    """int32 tokens [B, T] -> token embedding + learned position embedding, float32 [B, T, D];
    `positions` int [B, T] (each < seq_len) replaces positions 0..T-1 (packed documents)."""

    def __init__(self, vocab_size: int, d_model: int, seq_len: int, drop: nnx.Dropout | None = None, *, rngs: nnx.Rngs):
        _require_positive(vocab_size=vocab_size, d_model=d_model, seq_len=seq_len)
        self.seq_len = seq_len
        self.token = nnx.Embed(vocab_size, d_model, embedding_init=axes(_EMBED_INIT, "vocab", "embed"), rngs=rngs)
        self.position = nnx.Embed(seq_len, d_model, embedding_init=axes(_EMBED_INIT, "positions", "embed"), rngs=rngs)
        self.drop = drop

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, time], got {tokens.shape}")
        num_steps = tokens.shape[1]
        # Shapes are static under jit, so this check costs nothing at run time.
        if num_steps > self.seq_len:
            raise ValueError(f"sequence length {num_steps} exceeds the model's seq_len={self.seq_len}")
        if positions is not None:
            _check_per_token("positions", positions, tokens.shape)
            return _dropped(self.drop, self.token(tokens) + self.position(positions))
        # Positions 0..T-1 broadcast over the batch: [T, D] + [B, T, D].
        return _dropped(self.drop, self.token(tokens) + self.position(jnp.arange(num_steps)))

    def decode(self, tokens: jax.Array, start) -> jax.Array:
        """The embedding of T new tokens at window positions start .. start+T-1 (decoding)."""
        return _dropped(self.drop, self.token(tokens) + self.position(kv_cache.positions(*tokens.shape, start)))


def dropout(rate: float, seed: int, index: int) -> nnx.Dropout | None:
    """A dropout layer drawing from its own RNG stream (`seed`'s key folded with `index`), or
    None at rate 0. Its own stream, not one nnx.Rngs shared by the model: cut into pipeline
    stages, each stage then owns the streams it draws from and draws the masks the whole
    model draws. Evaluation (`module.eval()`) drops nothing."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return None
    return nnx.Dropout(rate, rngs=nnx.Rngs(dropout=jax.random.fold_in(jax.random.key(seed), index)))


def _dropped(layer: nnx.Dropout | None, x: jax.Array) -> jax.Array:
    return x if layer is None else layer(x)


def _check_per_token(name: str, ids: jax.Array, shape: tuple) -> None:
    """ValueError unless `ids` is an int array of `shape` ([batch, time]: one id per token)."""
    if tuple(ids.shape) != tuple(shape) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be integers of shape [batch, time] = {tuple(shape)}, one per token; "
            f"got {ids.dtype} {tuple(ids.shape)}"
        )


def attention_mask(batch: int, num_steps: int, segment_ids: jax.Array | None) -> jax.Array:
    """bool [Tq, Tk], or [B, Tq, Tk] with segment_ids [B, T]: query q may attend to key k iff
    k <= q and (packed rows) both lie in the same segment. The diagonal is always kept."""
    causal = jnp.tril(jnp.ones((num_steps, num_steps), dtype=bool))
    if segment_ids is None:
        return causal
    _check_per_token("segment_ids", segment_ids, (batch, num_steps))
    return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


class CausalSelfAttention(nnx.Module):
    """Multi-head self-attention where position t attends only to positions <= t (of its own
    segment, given `segment_ids` [B, T])."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        _require_positive(d_model=d_model, num_heads=num_heads)
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        # One fused projection for q, k and v: a single [D, 3D] matmul instead of three.
        # No bias: a key bias adds q.b to every logit of a row, which softmax cancels, so its
        # exact gradient is zero and Adam would only amplify rounding noise into updates.
        self.qkv = _linear(d_model, 3 * d_model, ("embed", "heads"), use_bias=False, rngs=rngs)
        self.out = _linear(d_model, d_model, ("heads", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
        batch, num_steps, d_model = x.shape
        head_dim = d_model // self.num_heads
        # [B, T, 3D] -> three [B, T, H, Dh].
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (a.reshape(batch, num_steps, self.num_heads, head_dim) for a in (q, k, v))
        # Scores [B, H, Tq, Tk], scaled by 1/sqrt(Dh) so their variance does not grow with Dh.
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
        mask = attention_mask(batch, num_steps, segment_ids)
        mask = mask if segment_ids is None else mask[:, None]  # [B, 1, Tq, Tk]: every head
        # Every row keeps at least its diagonal, so the softmax never sees an all-masked row;
        # the finite minimum (not -inf) keeps gradients free of NaN regardless.
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.out(attended.reshape(batch, num_steps, d_model))

    def empty_cache(self, batch: int, num_slots: int) -> kv_cache.LayerCache:
        return kv_cache.empty(batch, num_slots, self.num_heads, self.qkv.in_features // self.num_heads, jnp.float32)

    def decode(self, x: jax.Array, cache: kv_cache.LayerCache, start) -> tuple[jax.Array, kv_cache.LayerCache]:
        """(output [B, T, D], cache) of T new tokens at window positions start.. attending to the
        cached ones and to themselves (models/kv_cache.py)."""
        batch, num_new, d_model = x.shape
        head_dim = d_model // self.num_heads
        q, k, v = (a.reshape(batch, num_new, self.num_heads, head_dim) for a in jnp.split(self.qkv(x), 3, axis=-1))
        attended, cache = kv_cache.attend(q, k, v, cache, start)
        return self.out(attended), cache


class FeedForward(nnx.Module):
    """Position-wise D -> mlp_ratio*D -> D with GELU (named so as not to clash with models.MLP)."""

    def __init__(self, d_model: int, mlp_ratio: int, *, rngs: nnx.Rngs):
        _require_positive(d_model=d_model, mlp_ratio=mlp_ratio)
        self.up = _linear(d_model, mlp_ratio * d_model, ("embed", "mlp"), rngs=rngs)
        self.down = _linear(mlp_ratio * d_model, d_model, ("mlp", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + mlp(LN(x)). [B, T, D] -> [B, T, D].
    `drop`: residual dropout on the attention's and the MLP's outputs (one stream, two draws)."""

    def __init__(
        self, d_model: int, num_heads: int, mlp_ratio: int = 4, drop: nnx.Dropout | None = None, *, rngs: nnx.Rngs
    ):
        self.ln_attn = _layer_norm(d_model, rngs=rngs)
        self.attn = CausalSelfAttention(d_model, num_heads, rngs=rngs)
        self.ln_mlp = _layer_norm(d_model, rngs=rngs)
        self.mlp = FeedForward(d_model, mlp_ratio, rngs=rngs)
        self.drop = drop

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
        x = x + _dropped(self.drop, self.attn(self.ln_attn(x), segment_ids=segment_ids))
        return x + _dropped(self.drop, self.mlp(self.ln_mlp(x)))

    def decode(self, x: jax.Array, cache: kv_cache.LayerCache, start) -> tuple[jax.Array, kv_cache.LayerCache]:
        """__call__ for T new tokens at window positions start.., with the attention's cache."""
        attended, cache = self.attn.decode(self.ln_attn(x), cache, start)
        x = x + _dropped(self.drop, attended)
        return x + _dropped(self.drop, self.mlp(self.ln_mlp(x))), cache


class Head(nnx.Module):
    """Final LayerNorm + linear LM head: [B, T, D] -> logits [B, T, vocab_size]."""

    def __init__(self, d_model: int, vocab_size: int, *, rngs: nnx.Rngs):
        _require_positive(d_model=d_model, vocab_size=vocab_size)
        self.ln = _layer_norm(d_model, rngs=rngs)
        # Small init (GPT-2's 0.02): unit-scale initial logits would start the loss well above
        # ln(vocab_size) and spend the first steps only shrinking them.
        self.lm_head = _linear(
            d_model, vocab_size, ("embed", "vocab"), kernel_init=nnx.initializers.normal(0.02), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.lm_head(self.ln(x))


class GPT(nnx.Module):
    """Decoder-only LM: Embed, num_layers Blocks, Head. tokens [B, T] -> logits [B, T, V].

    The token embedding and LM head are not tied. Tying is possible in mpmd, but not for
    this model's split: `.layers()` cuts it into nnx.Module stages, which share no
    parameters. A model cut at `mpmd.stage_boundary` marks may tie them: the weight becomes
    a parameter of both stages and its gradients are summed (Pipeline.shared), as the tied
    model in tests/support/marked_models.py does.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        seq_len: int,
        mlp_ratio: int = 4,
        dropout_rate: float = 0.0,
        dropout_seed: int = 0,
        *,
        rngs: nnx.Rngs,
    ):
        _require_positive(
            vocab_size=vocab_size,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            seq_len=seq_len,
            mlp_ratio=mlp_ratio,
        )
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.embed = Embed(vocab_size, d_model, seq_len, dropout(dropout_rate, dropout_seed, 0), rngs=rngs)
        # flax 0.12 rejects plain Python lists of modules as attributes; nnx.List registers
        # the blocks as graph children so nnx.state / nnx.split see their params.
        self.blocks = nnx.List(
            [
                Block(d_model, num_heads, mlp_ratio, dropout(dropout_rate, dropout_seed, i + 1), rngs=rngs)
                for i in range(num_layers)
            ]
        )
        self.head = Head(d_model, vocab_size, rngs=rngs)
        self.seq_len = seq_len

    def sample_input(self, batch: int = 1) -> jax.Array:
        """A zero batch of full-length token rows: what cost analysis traces to balance a split."""
        return jnp.zeros((batch, self.seq_len), jnp.int32)

    def layers(self) -> list[nnx.Module]:
        """The model's own submodules in application order: [Embed, Block_0.., Head]."""
        return [self.embed, *self.blocks, self.head]

    def __call__(
        self, tokens: jax.Array, *, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """Logits [B, T, V]; `segment_ids`/`positions` [B, T] for packed rows (module doc)."""
        x = self.embed(tokens, positions=positions)
        for block in self.blocks:
            x = block(x, segment_ids=segment_ids)
        return self.head(x)

    def empty_cache(self, batch: int = 1) -> list[kv_cache.LayerCache]:
        """Per block, a key-value cache of seq_len slots holding nothing yet."""
        return [block.attn.empty_cache(batch, self.seq_len) for block in self.blocks]

    def decode(self, tokens: jax.Array, cache: list, start) -> tuple[jax.Array, list]:
        """(logits [B, T, V], cache) of T new tokens at window positions start .. start+T-1
        (start + T <= seq_len), every earlier position's keys and values read from `cache`
        (models/kv_cache.py; models/decoding.py drives it). `start`: an int, a traced scalar,
        or int32 [B], each row at its own positions (learned positions and cache slots alike).
        In eval mode (`.eval()`) it gives the logits __call__ gives the window, within float
        rounding."""
        x = self.embed.decode(tokens, start)
        x, cache = kv_cache.through(self.blocks, x, cache, start)
        return self.head(x), cache


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats over batch and time, computed in float32 (or
    wider) whatever the logits' dtype.

    logits [B, T, V] float, targets [B, T] int (already shifted: targets[:, t] is the token
    that should follow position t).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} must be targets {targets.shape} plus a vocab axis")
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def masked_lm_loss(logits: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Token-weighted next-token cross-entropy of packed rows: (sum of nats over the tokens
    whose `batch["loss_mask"]` is 1, their count). A pipeline divides the step's summed
    loss by its summed weight, so every real token weighs the same whatever microbatch or
    row it sits in, and padding (mask 0) weighs nothing."""
    targets, mask = batch["targets"], batch["loss_mask"].astype(jnp.float32)
    if logits.shape[:-1] != targets.shape or mask.shape != targets.shape:
        raise ValueError(
            f"logits {logits.shape} must be targets {targets.shape} plus a vocab axis, and "
            f"loss_mask {mask.shape} the targets' shape"
        )
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(nll * mask), jnp.sum(mask)
