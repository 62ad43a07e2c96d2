"""Decoding with a key-value cache (models/kv_cache.py, models/decoding.py) against the model's
own training forward: every new token of a cached greedy decoding is the argmax of the full
forward of its window, and its logits are that forward's within 1e-5 (float32), for the GPT
and the Llama (grouped-query attention, rotary positions), tied, with dropout (eval mode), and
across a window shift. The reference is nnx's plain `model(tokens)`, unjitted and unpadded."""

import numpy as np
import pytest
from flax import nnx

from mpmd import models
from mpmd.models import decoding
from mpmd.models.llama import Llama

VOCAB, SEQ = 32, 12
MODELS = {
    "gpt": lambda: models.GPT(VOCAB, 16, 2, 2, SEQ, rngs=nnx.Rngs(0)),
    "gpt-dropout": lambda: models.GPT(VOCAB, 16, 2, 2, SEQ, dropout_rate=0.3, dropout_seed=3, rngs=nnx.Rngs(1)),
    "llama-gqa": lambda: Llama(VOCAB, 16, 4, 2, SEQ, num_kv_heads=2, rngs=nnx.Rngs(2)),
    "llama-tied-dropout": lambda: Llama(
        VOCAB, 16, 2, 2, SEQ, tie_embeddings=True, dropout_rate=0.3, dropout_seed=3, rngs=nnx.Rngs(3)
    ),
}
PROMPT = [3, 1, 4, 1, 5]
# 5 + 20 tokens through a window of 12: cached steps, then two shifts (each a fresh prefill).
NUM_NEW = 20


def full_forward_logits(model, tokens: list[int]) -> np.ndarray:
    """The last position's logits of the training forward over `tokens` alone."""
    return np.asarray(model(np.array([tokens], np.int32)))[0, -1]


@pytest.mark.parametrize("name", MODELS)
def test_cached_greedy_decoding_is_the_full_forwards_argmax_at_every_step(name):
    model = MODELS[name]()
    decoder = decoding.Decoder(model)  # puts the model in eval mode: the reference drops nothing either
    tokens, start, shifts = list(PROMPT), 0, 0
    for i, (token, logits) in enumerate(decoder.stream(PROMPT, lambda l: int(np.argmax(l)))):
        if i == NUM_NEW:
            break
        want = full_forward_logits(model, tokens[start:])
        np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0, err_msg=f"{name}, new token {i}")
        assert token == int(np.argmax(want)), f"{name}, new token {i}"
        tokens.append(token)
        new_start = decoding.window_start(start, len(tokens), SEQ)
        shifts += new_start != start
        start = new_start
    assert shifts == 2 and len(tokens) == len(PROMPT) + NUM_NEW


def test_a_window_holds_at_most_seq_len_tokens_and_shifts_to_its_newest_half():
    starts = [0]
    for n in range(1, 40):
        starts.append(decoding.window_start(starts[-1], n, SEQ))
        assert 1 <= n - starts[-1] <= SEQ
    assert sorted(set(starts)) == [0, 7, 14, 21, 28]  # SEQ + 1 tokens -> the newest SEQ // 2 (6)


@pytest.mark.parametrize("name", ["gpt", "llama-gqa"])
def test_sampled_decoding_with_and_without_the_cache_draws_the_same_tokens(name):
    """Top-k sampling at temperature 1 from one seed: the cache changes only the cost, and a
    long prompt (more than seq_len tokens) starts from its last seq_len."""
    decoder = decoding.Decoder(MODELS[name]())
    prompt = list(np.random.default_rng(7).integers(0, VOCAB, SEQ + 5))

    def draw(cache: bool, seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return decoder.generate(prompt, 16, lambda l: decoding.next_token(l, 1.0, 8, rng), cache=cache)

    assert draw(True, 0) == draw(False, 0)
    assert draw(True, 0) != draw(True, 1)
    assert decoder.generate(prompt, 16, lambda l: int(np.argmax(l))) == decoder.generate(
        prompt[-SEQ:], 16, lambda l: int(np.argmax(l))
    )


def test_models_without_a_cache_and_empty_prompts_are_refused():
    with pytest.raises(ValueError, match="MLP cannot generate: it has no `decode`"):
        decoding.Decoder(models.MLP(4, 8, 2, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="the prompt is empty"):
        decoding.Decoder(MODELS["gpt"]()).generate([], 3, lambda l: 0)


def test_sampling_is_seeded_and_follows_temperature_and_top_k():
    logits = np.random.default_rng(0).normal(size=VOCAB) * 2
    draw = lambda seed, t, k: [
        decoding.next_token(logits, t, k, rng) for rng in [np.random.default_rng(seed)] for _ in range(64)
    ]
    assert draw(1, 0.8, 5) == draw(1, 0.8, 5)  # reproducible per seed
    assert draw(1, 0.8, 5) != draw(2, 0.8, 5)
    assert set(draw(1, 0.0, 0)) == {int(np.argmax(logits))}  # temperature 0: greedy
    assert set(draw(1, 1.0, 1)) == {int(np.argmax(logits))}  # top-1: greedy
    assert set(draw(1, 5.0, 3)) <= set(np.argsort(logits)[-3:].tolist())
    # a higher temperature spreads the draws over more tokens
    assert len(set(draw(1, 5.0, 0))) > len(set(draw(1, 0.3, 0)))
