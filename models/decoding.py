"""Generating tokens from a decoder LM on this process: the window is run through the model
once (prefill), then each new token is one step of one token against the key-value cache
(models/kv_cache.py), instead of the whole window again per token.

    decoder = Decoder(model)                        # a GPT or Llama (anything with decode/empty_cache)
    rng = np.random.default_rng(seed)
    new = decoder.generate(prompt_tokens, 100, lambda logits: next_token(logits, 0.8, 40, rng))

The window: the model sees at most seq_len tokens. The prompt's last seq_len tokens fill the
first window. When a new token would not fit, the window shifts to the newest
`keep(seq_len)` tokens (half of it), which are prefilled again into a fresh cache: a GPT's
learned positions restart at 0 in the new window, so the old window's keys cannot be kept (a
Llama's rotations could be, but its deeper layers' keys saw the dropped tokens). So every
token's logits are those of the full forward of its window, which `window_start` says; a
shift costs one prefill per seq_len / 2 tokens. With `cache=False` the same tokens come from
a full forward of the window per token (the training forward: what the cache is measured
against, benchmarks/bench_generate.py).

Both compiled programs take fixed shapes: a prefill takes the window right-padded to seq_len
(attention is causal, so padding after the last token changes none of its logits, and the
slots it fills in the cache are overwritten before any query can see them), a step one token
at a traced position. So a generation compiles two programs (or one without the cache),
whatever the prompt's length. Dropout is off: the model is put in eval mode.
"""

from typing import Callable, Iterator

import jax
import numpy as np
from flax import nnx


def keep(seq_len: int) -> int:
    """Tokens a full window keeps when it shifts: the newest half (at least one)."""
    return max(1, seq_len // 2)


def window_start(start: int, num_tokens: int, seq_len: int) -> int:
    """The first position of the window that predicts token `num_tokens` (0-based), given the
    window the previous token was predicted from began at `start`."""
    return num_tokens - keep(seq_len) if num_tokens - start > seq_len else start


class Decoder:
    """One sequence's decoding from `model`'s parameters as they are now (copied: training the
    model further does not change this decoder)."""

    def __init__(self, model: nnx.Module):
        for name in ("decode", "empty_cache", "seq_len"):
            if not hasattr(model, name):
                raise ValueError(
                    f"{type(model).__name__} cannot generate: it has no `{name}` "
                    f"(the decoder LMs of mpmd.models have decode, empty_cache and seq_len)"
                )
        model.eval()  # no dropout
        self.seq_len = model.seq_len
        graphdef, state = nnx.split(model)
        # The state as a flat list of arrays: flattening an nnx.State on every call (Python)
        # would cost a token more than the step itself does on a small model.
        leaves, treedef = jax.tree.flatten(state)
        self._state = jax.device_put(leaves)
        self._empty = model.empty_cache(1)
        at = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        decode = lambda leaves, tokens, cache, start: at(leaves).decode(tokens, cache, start)
        self._prefill = jax.jit(decode)
        # A step's cache is consumed: its buffers are reused for the updated one.
        self._step = jax.jit(decode, donate_argnums=2)
        self._forward = jax.jit(lambda leaves, tokens: at(leaves)(tokens))

    def _padded(self, window: list[int]) -> np.ndarray:
        tokens = np.zeros((1, self.seq_len), np.int32)
        tokens[0, : len(window)] = window
        return tokens

    def prefill(self, window: list[int]):
        """(logits [V] after the window's last token, the cache holding the window)."""
        logits, cache = self._prefill(self._state, self._padded(window), self._empty, 0)
        return logits[0, len(window) - 1], cache

    def step(self, token: int, cache, position: int):
        """(logits [V] after `token`, the cache with it): `token` sits at window `position`."""
        logits, cache = self._step(self._state, np.array([[token]], np.int32), cache, np.int32(position))
        return logits[0, 0], cache

    def rerun(self, window: list[int]) -> jax.Array:
        """logits [V] after the window's last token from the full (training) forward of the window."""
        return self._forward(self._state, self._padded(window))[0, len(window) - 1]

    def warm_up(self, cache: bool = True) -> None:
        """Compiles the programs a generation runs (a prefill and a step; or the full forward)."""
        if cache:
            _, kv = self.prefill([0])
            jax.block_until_ready(self.step(0, kv, 1))
        else:
            jax.block_until_ready(self.rerun([0]))

    def stream(self, prompt, pick: Callable[[np.ndarray], int], cache: bool = True) -> Iterator[tuple[int, np.ndarray]]:
        """(token, the logits [V] it was picked from) per new token, without end: `pick` maps
        float32 logits to the next token. A step's logits are computed only when the next
        token is asked for."""
        tokens = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not tokens:
            raise ValueError("the prompt is empty: decoding needs at least one token to continue")
        start = max(0, len(tokens) - self.seq_len)
        logits, kv = self.prefill(tokens[start:]) if cache else (self.rerun(tokens[start:]), None)
        while True:
            logits = np.asarray(logits)
            token = int(pick(logits))
            yield token, logits
            tokens.append(token)
            shifted = window_start(start, len(tokens), self.seq_len)
            if not cache:
                start = shifted
                logits = self.rerun(tokens[start:])
            elif shifted != start:
                start = shifted
                logits, kv = self.prefill(tokens[start:])
            else:
                logits, kv = self.step(token, kv, len(tokens) - 1 - start)

    def generate(
        self, prompt, num_tokens: int, pick: Callable[[np.ndarray], int], cache: bool = True, stop: int | None = None
    ) -> list[int]:
        """The next num_tokens tokens after `prompt` (ints), each `pick`ed from its logits;
        fewer when `stop` is picked first (it ends the list, not in it)."""
        if num_tokens <= 0:
            return []
        out = []
        for token, _ in self.stream(prompt, pick, cache):
            if token == stop:
                return out
            out.append(token)
            if len(out) == num_tokens:
                return out


def next_token(logits, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """A token drawn from softmax(logits / temperature) over the top_k likeliest (0: all);
    temperature 0 is greedy. Exactly one draw from `rng` per call when sampling."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    if 0 < top_k < logits.size:
        logits = np.where(logits >= np.sort(logits)[-top_k], logits, -np.inf)
    scaled = (logits - logits.max()) / temperature
    probs = np.exp(scaled)
    return int(rng.choice(logits.size, p=probs / probs.sum()))
