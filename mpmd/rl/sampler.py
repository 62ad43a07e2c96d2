"""The batched sampler of reinforcement learning: n completions of each of B prompts, as one
pure JAX function of arrays with fixed shapes, so it jits into one program and exports
(`jax.export`) to run on a sampler group's devices as any other program does.

    fn, params = program(model, num_samples=4, max_new_tokens=64, temperature=0.7, top_k=40,
                         end_token=eos)
    out = jax.jit(fn)(params, prompts, prompt_lens, prompt_ids, key)     # Samples
    out = Sampler(model).sample([[5, 3, 9], [7]], [17, 18], seed, num_samples=4, ...)   # one process

The rows: prompts int32 [B, P] right-padded, prompt_lens [B] (each in 1..P). The prompts are
prefilled once into the key-value cache (models/kv_cache.py), the cache repeated n times
(row r = b*n + j is sample j of prompt b), then each step feeds every row its last token at
its own position, prompt_lens[b] + t (the models' `decode` takes a start per row: a GPT's
learned positions and a Llama's rotations see each row's true positions, and a row reads
exactly what decoding its prompt alone reads). The loop is a lax.while_loop of at most
max_new_tokens - 1 steps after the prefill, leaving early once every row has ended.
Refused (ValueError naming the numbers): P + max_new_tokens > seq_len. There is no window
shifting here: the learner scores prompt + completion in one forward of at most seq_len.

Each token t of a row is drawn from softmax(logits / temperature) over the top_k likeliest
(top_k 0: all); temperature 0 is greedy (argmax, first index on ties). Its logprob is
log_softmax(logits / temperature)[token] under the full distribution (not the top-k one),
temperature 1 when greedy: what the learner's token_logprobs(logits, targets, temperature)
computes from the training forward, so with equal weights the importance ratio is 1 up to
float rounding (the cached decode and the full forward differ only in the order of sums).

A row ends at end_token: the end token is kept, `lengths` counts it, every later slot holds
PAD (0) with logprob 0; a row that never draws it has length max_new_tokens. Token 0 may be a
real token: use `lengths` (or `mask(samples)`) to tell the padding.

Randomness: `key` is the only source, and the draw of (prompt b, sample j, token t) uses
    fold_in(fold_in(fold_in(key, prompt_ids[b]), j), t)
so it depends on the caller's id of the prompt, not on where the prompt sits in the batch or
what else is in it: a resumed run that samples prompt 17 of step 40 again draws the same
randoms. The tokens are the same too unless two candidates are within the rounding by which
a batch's size can move the logits (XLA:CPU: a few 1e-7 between a batch of 2 and of 3).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PAD = 0  # what a row holds after its end token


class Samples(NamedTuple):
    tokens: jax.Array  # int32 [B*n, max_new_tokens]: row b*n + j is sample j of prompt b
    logprobs: jax.Array  # float32 [B*n, max_new_tokens]: 0 past a row's length
    lengths: jax.Array  # int32 [B*n]: tokens drawn, the end token included


# An exported program's outputs are a pytree: jax.export serializes a NamedTuple only by name.
jax.export.register_namedtuple_serialization(Samples, serialized_name="mpmd.rl.sampler.Samples")


def mask(samples: Samples) -> jax.Array:
    """bool [B*n, max_new_tokens]: the slots holding drawn tokens (before PAD)."""
    return jnp.arange(samples.tokens.shape[1]) < samples.lengths[:, None]


def _check_settings(num_samples, max_new_tokens, temperature, top_k, end_token) -> None:
    counts = {"num_samples": num_samples, "max_new_tokens": max_new_tokens}
    bad = [f"{k}={v!r}" for k, v in counts.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        bad.append(f"top_k={top_k!r} (0: all tokens)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < np.inf:
        bad.append(f"temperature={temperature!r} (0: greedy)")
    if end_token is not None and (isinstance(end_token, bool) or not isinstance(end_token, int) or end_token < 0):
        bad.append(f"end_token={end_token!r} (a token id, or None: no end)")
    if bad:
        raise ValueError(
            f"sampling needs positive counts, top_k >= 0 and a finite temperature >= 0; got {', '.join(bad)}"
        )


def _pick(logits: jax.Array, keys: jax.Array, temperature: float, top_k: int) -> tuple[jax.Array, jax.Array]:
    """(tokens int32 [R], logprobs float32 [R]) drawn from logits [R, V], one key per row."""
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        token = jnp.argmax(logits, axis=-1)
        scaled = logits  # the logprob of a greedy token is taken at temperature 1
    else:
        scaled = logits / jnp.float32(temperature)
        cut = scaled
        if 0 < top_k < logits.shape[-1]:
            # Keep tokens scoring at least the k-th largest (ties at it all kept, as next_token).
            kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
            cut = jnp.where(scaled >= kth, scaled, -jnp.inf)
        token = jax.vmap(jax.random.categorical)(keys, cut)
    token = token.astype(jnp.int32)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), token[:, None], axis=-1)[:, 0]
    return token, logprob


def sample(
    model: nnx.Module,
    prompts: jax.Array,
    prompt_lens: jax.Array,
    prompt_ids: jax.Array,
    key: jax.Array,
    *,
    num_samples: int = 1,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    end_token: int | None = None,
) -> Samples:
    """n = num_samples completions of each prompt (module doc), traceable: `model` (a GPT or
    Llama, dropout off: eval mode) may be one merged inside a jit. prompts int32 [B, P]
    right-padded, prompt_lens int32 [B] in 1..P, prompt_ids int32 [B] (the caller's ids of the
    prompts: what the randoms are derived from), key a PRNG key or its uint32 key data."""
    _check_settings(num_samples, max_new_tokens, temperature, top_k, end_token)
    num_prompts, width = prompts.shape
    if width + max_new_tokens > model.seq_len:
        raise ValueError(
            f"prompts padded to {width} tokens + max_new_tokens={max_new_tokens} = "
            f"{width + max_new_tokens} exceeds the model's seq_len={model.seq_len}: the sampler does not "
            f"shift windows; shorten the prompts or max_new_tokens"
        )
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    n, num_rows = num_samples, num_prompts * num_samples
    prompt_lens = prompt_lens.astype(jnp.int32)

    # Prefill each prompt once, all rows from position 0; the logits after prompt b's last
    # token predict its first new one. Slots past a prompt's end hold its padding's keys: row
    # r writes its token t at slot prompt_lens + t before any query can see that slot.
    logits, cache = model.decode(prompts.astype(jnp.int32), model.empty_cache(num_prompts), 0)
    logits = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    rows = lambda x: jnp.repeat(x, n, axis=0)  # [B, ...] -> [B*n, ...], row b*n + j
    logits, cache, starts = rows(logits), jax.tree.map(rows, cache), rows(prompt_lens)
    sample_of_row = jnp.tile(jnp.arange(n, dtype=jnp.int32), num_prompts)
    row_keys = jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(key, i), j))(
        rows(prompt_ids.astype(jnp.int32)), sample_of_row
    )

    def emit(t, logits, out):
        """Draws token t of every row into `out`; (the token each row feeds next, out)."""
        tokens, logprobs, lengths, done = out
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
        token, logprob = _pick(logits, keys, temperature, top_k)
        live = ~done
        token = jnp.where(live, token, PAD)
        tokens = tokens.at[:, t].set(token)
        logprobs = logprobs.at[:, t].set(jnp.where(live, logprob, 0.0))
        if end_token is not None:
            done = done | (token == end_token)
        return token, (tokens, logprobs, lengths + live, done)

    out = (
        jnp.full((num_rows, max_new_tokens), PAD, jnp.int32),
        jnp.zeros((num_rows, max_new_tokens), jnp.float32),
        jnp.zeros((num_rows,), jnp.int32),
        jnp.zeros((num_rows,), bool),
    )
    token, out = emit(jnp.int32(0), logits, out)

    def step(carry):
        # Feed token t-1 of every row at its position prompt_len + t - 1 (an ended row feeds
        # PAD: its logits are drawn from but never kept), then draw token t.
        t, token, cache, out = carry
        logits, cache = model.decode(token[:, None], cache, starts + t - 1)
        token, out = emit(t, logits[:, 0], out)
        return t + 1, token, cache, out

    def more(carry):
        t, _, _, out = carry
        return (t < max_new_tokens) & ~jnp.all(out[3])

    _, _, _, (tokens, logprobs, lengths, _) = jax.lax.while_loop(more, step, (jnp.int32(1), token, cache, out))
    return Samples(tokens, logprobs, lengths)


def _require_decoder(model: nnx.Module) -> None:
    for name in ("decode", "empty_cache", "seq_len"):
        if not hasattr(model, name):
            raise ValueError(
                f"{type(model).__name__} cannot be sampled from: it has no `{name}` "
                f"(the decoder LMs of mpmd.models have decode, empty_cache and seq_len)"
            )


def _bound(graphdef, treedef, **settings) -> Callable:
    """fn(params, prompts, prompt_lens, prompt_ids, key) -> Samples over the model of
    `graphdef` whose state's leaves are `params` (a flat list: nothing but arrays crosses
    into the program, so it exports and ships as one)."""

    def fn(params, prompts, prompt_lens, prompt_ids, key):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, list(params)))
        model.eval()  # no dropout; the merged copy only, not the caller's model
        return sample(model, prompts, prompt_lens, prompt_ids, key, **settings)

    return fn


def program(
    model: nnx.Module,
    *,
    num_samples: int = 1,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    end_token: int | None = None,
) -> tuple[Callable, list[jax.Array]]:
    """(fn, params): `fn(params, prompts, prompt_lens, prompt_ids, key) -> Samples` a pure
    function of arrays, the settings fixed into it, and params the model's state as a flat
    list of arrays (its parameters as they are now). jax.jit(fn) is one program per shape;
    jax.export.export(jax.jit(fn)) serializes it. Another model of the same structure (new
    weights) is the same program: pass `jax.tree.leaves(nnx.state(model))`."""
    _require_decoder(model)
    _check_settings(num_samples, max_new_tokens, temperature, top_k, end_token)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    settings = dict(
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        end_token=end_token,
    )
    return _bound(graphdef, treedef, **settings), leaves


class Sampler:
    """Sampling on this process from `model`'s parameters as they are now (copied; `update`
    takes newer ones of the same model). One compiled program per batch shape and settings."""

    def __init__(self, model: nnx.Module):
        _require_decoder(model)
        self.seq_len = model.seq_len
        self._graphdef, state = nnx.split(model)
        leaves, self._treedef = jax.tree.flatten(state)
        self._params = jax.device_put(leaves)
        self._programs: dict[tuple, Callable] = {}

    def update(self, model: nnx.Module) -> None:
        """Sample from `model`'s parameters from now on (the same structure: no recompile)."""
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        if graphdef != self._graphdef or treedef != self._treedef:
            raise ValueError("update takes a model of the structure this Sampler was built with")
        self._params = jax.device_put(leaves)

    def sample(
        self,
        prompts: list[list[int]],
        prompt_ids,
        key: int | jax.Array,
        *,
        num_samples: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        end_token: int | None = None,
    ) -> Samples:
        """Samples (numpy) of `prompts` (lists of token ids); `key` a PRNG key or an int seed.
        Prompts are right-padded to the next power of two at least the longest (at most
        seq_len - max_new_tokens), so a few widths serve every batch of B prompts."""
        settings = (num_samples, max_new_tokens, temperature, top_k, end_token)
        _check_settings(*settings)
        lens = [len(p) for p in prompts]
        prompt_ids = np.asarray(prompt_ids, np.int32).reshape(-1)
        if not prompts or min(lens) == 0 or len(prompt_ids) != len(prompts):
            raise ValueError(
                f"sampling needs at least one prompt, each of at least one token, and one id per "
                f"prompt; got {len(prompts)} prompts of lengths {lens} and {len(prompt_ids)} ids"
            )
        room = self.seq_len - max_new_tokens
        if max(lens) > room:
            raise ValueError(
                f"a prompt of {max(lens)} tokens + max_new_tokens={max_new_tokens} = "
                f"{max(lens) + max_new_tokens} exceeds the model's seq_len={self.seq_len}"
            )
        width = min(room, 1 << (max(lens) - 1).bit_length())
        padded = np.full((len(prompts), width), PAD, np.int32)
        for row, prompt in zip(padded, prompts):
            row[: len(prompt)] = prompt
        key = jax.random.key(key) if isinstance(key, int) else key
        if settings not in self._programs:
            names = ("num_samples", "max_new_tokens", "temperature", "top_k", "end_token")
            self._programs[settings] = jax.jit(_bound(self._graphdef, self._treedef, **dict(zip(names, settings))))
        out = self._programs[settings](self._params, padded, np.asarray(lens, np.int32), prompt_ids, key)
        return Samples(*(np.asarray(a) for a in out))
