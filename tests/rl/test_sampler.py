"""The batched sampler (mpmd/rl/sampler.py) against references it does not use: greedy rows
against models.decoding.Decoder decoding each prompt alone, logprobs and top-k against the
model's training forward (`model(tokens)`, unjitted) over prompt + completion, ends against
the same draws without an end token, and the exported program against the jitted one.

Prompts of lengths 5, 2 and 9 share one batch, so rows step at different positions; the
models are tiny and randomly initialised (GPT; Llama with grouped-query and sliding-window
attention)."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from mpmd import models
from mpmd.models import decoding
from mpmd.models.llama import AttentionVariant, Llama
from mpmd.rl import sampler
from mpmd.runtime.worker import programs

VOCAB, SEQ, NEW = 32, 24, 8
PROMPTS = [[3, 1, 4, 1, 5], [2, 7], [9, 9, 9, 1, 2, 3, 4, 5, 6]]
IDS = [10, 11, 12]
SAMPLED = dict(num_samples=3, max_new_tokens=NEW, temperature=0.7, top_k=5)
SLIDING = AttentionVariant(sliding_window=6)  # a per-row window too: prompts reach 9 + 8 tokens
MODELS = {
    "gpt": lambda: models.GPT(VOCAB, 16, 2, 2, SEQ, rngs=nnx.Rngs(0)),
    "llama": lambda: Llama(VOCAB, 16, 4, 2, SEQ, num_kv_heads=2, attention=SLIDING, rngs=nnx.Rngs(2)),
}


@functools.cache
def built(name: str):
    """(model, its Sampler, the SAMPLED draws of PROMPTS with seed 0), once per module run."""
    model = MODELS[name]()
    s = sampler.Sampler(model)
    return model, s, s.sample(PROMPTS, IDS, 0, **SAMPLED)


@pytest.fixture(params=list(MODELS))
def setup(request):
    return built(request.param)


@pytest.fixture
def gpt():
    """The GPT only: what these tests check is the sampler's, not the model's."""
    return built("gpt")


def forward_logits(model, samples: sampler.Samples, n: int) -> np.ndarray:
    """float64 [R, NEW, V]: logits[r, t] = the training forward's logits that predict token t of
    row r (at position len(prompt) + t - 1 of prompt + completion, right-padded to SEQ: causal
    attention, so the padding changes none of them)."""
    rows = np.zeros((len(samples.tokens), SEQ), np.int32)
    for r, (tokens, length) in enumerate(zip(samples.tokens, samples.lengths)):
        prompt = PROMPTS[r // n]
        rows[r, : len(prompt) + length] = prompt + list(tokens[:length])
    logits = np.asarray(model(rows), np.float64)
    return np.stack([logits[r, len(PROMPTS[r // n]) - 1 :][:NEW] for r in range(len(rows))])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow  # compiles a Decoder per prompt beside the sampler: seconds per model
@pytest.mark.every_jax
def test_greedy_rows_are_each_prompt_decoded_alone(setup):
    model, s, _ = setup
    out = s.sample(PROMPTS, IDS, 0, num_samples=2, max_new_tokens=NEW, temperature=0)
    decoder = decoding.Decoder(model)
    for b, prompt in enumerate(PROMPTS):
        want = decoder.generate(prompt, NEW, lambda logits: int(np.argmax(logits)))
        for j in range(2):  # row b*n + j
            assert out.tokens[2 * b + j].tolist() == want, f"prompt {b}, sample {j}"
    assert out.lengths.tolist() == [NEW] * 6
    # A greedy token's logprob is taken at temperature 1.
    want = np.take_along_axis(log_softmax(forward_logits(model, out, 2)), out.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.logprobs, want, atol=1e-5, rtol=0)


def test_logprobs_are_the_training_forwards_at_the_drawn_tokens(setup):
    model, _, out = setup
    scaled = forward_logits(model, out, 3) / SAMPLED["temperature"]
    want = np.take_along_axis(log_softmax(scaled), out.tokens[..., None], -1)[..., 0]
    assert (out.lengths == NEW).all()  # no end token: every slot holds a drawn token
    np.testing.assert_allclose(out.logprobs, want, atol=1e-5, rtol=0)


def test_every_drawn_token_is_among_the_top_k_of_its_step(setup):
    model, _, out = setup
    logits = forward_logits(model, out, 3)
    kth = np.sort(logits, -1)[..., -SAMPLED["top_k"]]
    drawn = np.take_along_axis(logits, out.tokens[..., None], -1)[..., 0]
    assert (drawn >= kth - 1e-5).all()  # decode and forward differ by float rounding only
    assert len(np.unique(out.tokens)) > SAMPLED["top_k"]  # ... and the k are not always the same


def test_samples_of_one_prompt_differ_and_sample_j_does_not_depend_on_n(gpt):
    _, s, out = gpt
    for b in range(len(PROMPTS)):
        rows = {tuple(out.tokens[3 * b + j]) for j in range(3)}
        assert len(rows) == 3, f"prompt {b}'s samples repeat: {rows}"
    # Row b*n + j is sample j of prompt b, drawn from (prompt id, j) whatever n and the batch:
    # prompts 2 and 0 alone, 2 samples each, are the first two samples of the run with all three.
    fewer = s.sample([PROMPTS[2], PROMPTS[0]], [IDS[2], IDS[0]], 0, **{**SAMPLED, "num_samples": 2})
    np.testing.assert_array_equal(fewer.tokens, out.tokens[[6, 7, 0, 1]])
    # The logits themselves may differ in their last bits with the batch's size (XLA:CPU).
    np.testing.assert_allclose(fewer.logprobs, out.logprobs[[6, 7, 0, 1]], atol=1e-6, rtol=0)


def test_draws_are_reproducible_and_follow_the_prompt_ids_not_the_batch(gpt):
    _, s, out = gpt
    again = s.sample(PROMPTS, IDS, 0, **SAMPLED)
    np.testing.assert_array_equal(again.tokens, out.tokens)
    np.testing.assert_array_equal(again.logprobs, out.logprobs)
    order = [1, 2, 0]
    moved = s.sample([PROMPTS[i] for i in order], [IDS[i] for i in order], 0, **SAMPLED)
    rows = [3 * i + j for i in order for j in range(3)]
    np.testing.assert_array_equal(moved.tokens, out.tokens[rows])
    # Another key, or the same prompts under other ids, draw otherwise.
    assert (s.sample(PROMPTS, IDS, 1, **SAMPLED).tokens != out.tokens).any()
    assert (s.sample(PROMPTS, [20, 21, 22], 0, **SAMPLED).tokens != out.tokens).any()


def test_a_row_ends_at_its_end_token_with_padding_after(gpt):
    """The same draws with an end token: each row is its unended row up to and including the
    token's first occurrence, then PAD (logprob 0); a row without it runs to max_new_tokens."""
    _, s, out = gpt
    # The token whose first occurrence ends the most rows early (after at least one token).
    firsts = lambda tok: [list(row).index(tok) for row in out.tokens if tok in row[1:] and tok not in row[:1]]
    end = max(range(VOCAB), key=lambda tok: len(firsts(tok)))
    ended = s.sample(PROMPTS, IDS, 0, **SAMPLED, end_token=end)
    num_ended = 0
    for r, row in enumerate(out.tokens.tolist()):
        length = row.index(end) + 1 if end in row else NEW
        num_ended += length < NEW
        assert ended.lengths[r] == length, f"row {r}"
        assert ended.tokens[r].tolist() == row[:length] + [sampler.PAD] * (NEW - length), f"row {r}"
        # Another program (the end's test fused in): a float32 ulp apart at most.
        np.testing.assert_allclose(ended.logprobs[r, :length], out.logprobs[r, :length], atol=1e-6, rtol=0)
        assert (ended.logprobs[r, length:] == 0).all()
    assert num_ended >= 2
    np.testing.assert_array_equal(sampler.mask(ended), np.arange(NEW) < ended.lengths[:, None])


def test_top_1_sampling_is_greedy(gpt):
    _, s, _ = gpt
    greedy = s.sample(PROMPTS, IDS, 0, max_new_tokens=NEW, temperature=0)
    top1 = s.sample(PROMPTS, IDS, 3, max_new_tokens=NEW, temperature=2.0, top_k=1)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


def test_the_exported_program_draws_what_the_jitted_one_draws(gpt):
    """jax.export on abstract shapes, serialized and deserialized as a worker receives it (its
    custom calls ones a worker accepts), and the key as uint32 data as it crosses the wire."""
    model, _, out = gpt
    fn, params = sampler.program(model, **SAMPLED)
    width = 16  # Sampler's: the next power of two >= 9, at most SEQ - NEW
    prompts = np.zeros((3, width), np.int32)
    for row, prompt in zip(prompts, PROMPTS):
        row[: len(prompt)] = prompt
    args = (
        params,
        prompts,
        np.array([5, 2, 9], np.int32),
        np.array(IDS, np.int32),
        jax.random.key_data(jax.random.key(0)),
    )
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    exported = jax.export.export(jax.jit(fn))(*abstract)
    programs.check_custom_calls(exported.mlir_module())
    got = jax.export.deserialize(exported.serialize()).call(*args)
    assert isinstance(got, sampler.Samples)
    for name in sampler.Samples._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), getattr(out, name), err_msg=name)


def test_prompts_that_leave_no_room_and_bad_settings_are_refused(gpt):
    model, s, _ = gpt
    with pytest.raises(
        ValueError, match=r"a prompt of 9 tokens \+ max_new_tokens=16 = 25 exceeds the model's seq_len=24"
    ):
        s.sample(PROMPTS, IDS, 0, max_new_tokens=16)
    fn, params = sampler.program(model, max_new_tokens=9)
    with pytest.raises(ValueError, match=r"prompts padded to 16 tokens \+ max_new_tokens=9 = 25 exceeds"):
        fn(params, np.zeros((1, 16), np.int32), np.ones(1, np.int32), np.zeros(1, np.int32), jax.random.key(0))
    with pytest.raises(ValueError, match=r"num_samples=0, top_k=-1 \(0: all tokens\), temperature=-1"):
        s.sample(PROMPTS, IDS, 0, num_samples=0, max_new_tokens=4, top_k=-1, temperature=-1)
    with pytest.raises(ValueError, match=r"got 3 prompts of lengths \[5, 0, 9\] and 3 ids"):
        s.sample([PROMPTS[0], [], PROMPTS[2]], IDS, 0, max_new_tokens=4)
    with pytest.raises(ValueError, match="MLP cannot be sampled from: it has no `decode`"):
        sampler.Sampler(models.MLP(4, 8, 2, 4, rngs=nnx.Rngs(0)))
