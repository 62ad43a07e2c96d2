"""recipes/data/exact_match.py on a real Llama fitted (plain JAX, Adam) to four reversal examples: its
greedy answers (key-value cache) are those of a full forward per token, cut at the end marker;
an answer that is the response scores 1, one that is not 0."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from mpmd import models
from mpmd.recipes.data import exact_match
from mpmd.recipes.data import sft
from mpmd.recipes.data import tokenizer

BYTES = tokenizer.load("bytes")
SEQ = 24


@pytest.fixture(scope="module")
def fitted():
    examples = [
        sft.Example(((f"reverse {w}:", False), (w[::-1], True)), f"x:{i}")
        for i, w in enumerate(["abc", "kqzt", "mnop", "xyz"])
    ]
    batch = sft.Rows.of(examples, BYTES, SEQ).arrays
    model = models.Llama(256, 32, 2, 2, SEQ, num_kv_heads=1, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adam(1e-2)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        def loss(params):
            total, weight = models.masked_lm_loss(nnx.merge(graph, params, rest)(batch["inputs"]), batch)
            return total / weight

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    for _ in range(200):
        params, state, value = step(params, state)
    assert value < 0.01, value
    return nnx.merge(graph, params, rest), examples


def test_answers_are_the_full_forwards_greedy_tokens_cut_at_the_end_marker(fitted):
    model, examples = fitted
    from mpmd.models import decoding

    decoder = decoding.Decoder(model)
    # The training forward of the window right-padded to SEQ (causal: the padding changes nothing before it).
    graph, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graph, state)(tokens))
    for ex in examples:
        ids, _ = sft.encode(ex, BYTES)
        tokens, new = list(ids[: len(ids) - len(ex.response) - 1]), []  # the prompt: all but response + "\n"
        while len(tokens) < SEQ:
            padded = np.zeros((1, SEQ), np.int32)
            padded[0, : len(tokens)] = tokens
            token = int(np.argmax(np.asarray(forward(state, padded))[0, len(tokens) - 1]))
            if token == ord("\n"):
                break
            tokens.append(token), new.append(token)
        assert exact_match.answer(decoder, BYTES, ex) == BYTES.decode(new) == ex.response


def test_a_hit_is_an_answer_equal_to_the_response(fitted):
    model, examples = fitted
    assert exact_match.score(model, BYTES, examples) == 1.0
    wrong = [sft.Example((ex.segments[0], (ex.response + "q", True)), ex.where) for ex in examples]
    assert exact_match.score(model, BYTES, wrong) == 0.0
    assert exact_match.score(model, BYTES, examples[:3] + wrong[3:]) == 0.75
