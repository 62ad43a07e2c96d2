"""A key-value cache for decoding: each attention layer's keys and values of the tokens seen
so far, so a new token attends to them without running the context through the model again.

A layer's cache is a `LayerCache` of two arrays [B, S, KV, Dh]: slot s holds the key (after
its rotary rotation, for a Llama) and the value of the token at position s of the window, S
= the model's seq_len. A call writes its T new tokens' keys and values into slots start ..
start+T-1 and lets query t (at position start+t) attend to slots 0 .. start+t: slots past
that hold zeros or an older window's keys, and are masked like the future in training.
`start` is one position for the whole batch (a scalar) or each row's own (int32 [B]): rows
whose prompts differ in length then step together, each at its own next position
(mpmd/rl/sampler.py), and every row reads exactly what it would decoding alone.

The training forward (models/gpt.py, models/llama.py `__call__`) does not use any of this: the
models' `decode` methods sit beside it, so training's numerics stay as they were. The masked
slots weigh exactly zero after the softmax (exp of the float minimum minus the row maximum
underflows to 0), so a cached call differs from the full forward only by the order of
floating-point sums (tests/models/test_decoding.py: within 1e-5 in float32).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LayerCache(NamedTuple):
    keys: jax.Array  # [B, S, KV, Dh], in the layer's compute dtype
    values: jax.Array  # [B, S, KV, Dh]


def empty(batch: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype) -> LayerCache:
    """A layer's cache holding nothing yet (zeros: every slot is masked until written)."""
    zeros = jnp.zeros((batch, num_slots, num_kv_heads, head_dim), dtype)
    return LayerCache(zeros, zeros)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: LayerCache,
    start,
    window: int | None = None,
    query_scale: float | None = None,
) -> tuple[jax.Array, LayerCache]:
    """(attended [B, T, H * Dh], the cache with k and v written at slots start .. start+T-1).

    q [B, T, H, Dh] (rotated already where the model rotates), k and v [B, T, KV, Dh]; query
    head h uses key/value head h // (H / KV) (grouped-query attention; KV = H for plain
    multi-head). `start`: the window position of the first new token, an int or a traced
    int32 scalar (one compiled step serves every position), or int32 [B], each row's own. Scores and softmax in float32,
    scaled by 1/sqrt(Dh), as the models' training attention computes them. `window`: a query
    sees only the last this many slots, itself included (sliding-window attention);
    `query_scale`: scores scaled by its inverse square root in place of Dh's.
    """
    batch, num_new, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    group = num_heads // num_kv
    keys, values = _write(cache.keys, k, start), _write(cache.values, v, start)
    num_slots = keys.shape[1]
    q = q.reshape(batch, num_new, num_kv, group, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, keys, preferred_element_type=jnp.float32) / jnp.sqrt(
        jnp.float32(query_scale or head_dim)
    )
    # Query t sits at position start + t and sees slots 0 .. start + t: [Tq, S], or [B, Tq, S]
    # with a start per row (then [B, 1, 1, Tq, S] against the scores: every head).
    at = jnp.asarray(start)[..., None, None] + jnp.arange(num_new)[:, None]
    visible = jnp.arange(num_slots) <= at
    if window is not None:
        visible = visible & (jnp.arange(num_slots) > at - window)
    visible = visible if visible.ndim == 2 else visible[:, None, None]
    scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    attended = jnp.einsum("bkgqs,bskd->bqkgd", weights, values)
    return attended.reshape(batch, num_new, num_heads * head_dim), LayerCache(keys, values)


def _write(slots: jax.Array, new: jax.Array, start) -> jax.Array:
    """slots [B, S, KV, Dh] with new [B, T, KV, Dh] written at slots start .. start+T-1 of
    every row (start a scalar), or of row b at start[b] (start [B])."""
    new = new.astype(slots.dtype)
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_update_slice_in_dim(slots, new, start, axis=1)
    write_row = lambda row, new_row, at: jax.lax.dynamic_update_slice_in_dim(row, new_row, at, axis=0)
    return jax.vmap(write_row)(slots, new, start)


def positions(batch: int, num_new: int, start) -> jax.Array:
    """int32 [B, T]: the window positions start .. start+T-1 of T new tokens, per row (start a
    scalar, or [B]: row b's tokens at start[b] ..)."""
    at = jnp.asarray(start, jnp.int32)[..., None] + jnp.arange(num_new, dtype=jnp.int32)
    return jnp.broadcast_to(at, (batch, num_new))


def through(blocks, x: jax.Array, cache: list, start) -> tuple[jax.Array, list]:
    """x through each block's `decode` with its layer's cache: (output, the updated caches)."""
    out = []
    for block, layer_cache in zip(blocks, cache):
        x, layer_cache = block.decode(x, layer_cache, start)
        out.append(layer_cache)
    return x, out
