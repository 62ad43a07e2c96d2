"""GRPO's loss (mpmd/rl/grpo.py): advantages, log-probabilities and the clipped, KL-penalised
token loss against numpy written here; on-policy, its gradient is the policy gradient's; and
a small GPT trained on a fixed batch of GRPO samples through a 2-slice pipeline (in process
under three schedules, and on two worker processes) equals the same model trained unpipelined
on the whole batch's token mean, though the microbatches hold different numbers of tokens."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpmd
from mpmd import models
from mpmd.rl.grpo import grpo_loss, group_advantages, learner_batch, token_logprobs
from mpmd.stages import batch as batches
from mpmd.stages.leaf_paths import path_string
from tests.support import reference as ref
from tests.support import workloads as wl

VOCAB, D, HEADS, BLOCKS, SEQ = 32, 16, 2, 2, 12
NUM_PROMPTS, N = 2, 4  # 8 rows: two prompts sampled 4 times each
M, STEPS = 4, 3  # microbatches of 2 rows; optimizer steps on the one batch, as GRPO reuses samples
CLIP, KL, TEMPERATURE = 0.2, 0.1, 0.9
LOSS = functools.partial(grpo_loss, clip_eps=CLIP, kl_coef=KL, temperature=TEMPERATURE)


def make_gpt():
    return models.GPT(VOCAB, D, HEADS, BLOCKS, SEQ, rngs=nnx.Rngs(0))


# -- numpy, written from the formulas, for the checks below -----------------------------------
def numpy_logprobs(logits, targets, temperature):
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(log_softmax, np.asarray(targets)[..., None], -1)[..., 0]


def numpy_grpo(logits, batch, clip_eps, kl_coef, temperature):
    """(sum of the token losses over the mask, the mask's sum, tokens clipped above, below)."""
    logp = numpy_logprobs(logits, batch["targets"], temperature)
    total, above, below = 0.0, 0, 0
    for b, t in zip(*np.nonzero(batch["loss_mask"])):
        a = float(batch["advantages"][b])
        ratio = math.exp(logp[b, t] - batch["old_logprobs"][b, t])
        clipped = min(max(ratio, 1 - clip_eps), 1 + clip_eps)
        above += a > 0 and ratio > 1 + clip_eps
        below += a < 0 and ratio < 1 - clip_eps
        loss = -min(ratio * a, clipped * a)
        if kl_coef:
            d = batch["ref_logprobs"][b, t] - logp[b, t]
            loss += kl_coef * (math.exp(d) - d - 1)
        total += loss * batch["loss_mask"][b, t]
    return total, float(np.sum(batch["loss_mask"])), above, below


# -- group advantages, log-probabilities, the learner batch ------------------------------------
def test_group_advantages_match_numpy_and_a_flat_group_gets_zeros():
    rewards = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    rewards[1] = 0.1  # all equal: its float mean is an ulp off 0.1, which / eps alone would not be 0
    got = np.asarray(group_advantages(rewards))
    r = rewards.astype(np.float64)
    want = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
    want[1] = 0.0
    assert got.dtype == np.float32 and got.shape == (15,)
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=1e-6)
    assert np.all(got[5:10] == 0.0)
    np.testing.assert_allclose(got.reshape(3, 5)[[0, 2]].std(1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("shape", [(6,), (3, 1), (2, 3, 4)])
def test_group_advantages_refuse_rewards_that_are_not_groups(shape):
    with pytest.raises(ValueError, match=r"rewards must be \[num_prompts, n\] with n >= 2"):
        group_advantages(np.zeros(shape, np.float32))


def test_token_logprobs_match_numpy_at_a_temperature():
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(3, 5, VOCAB)) * 4).astype(np.float32)
    targets = rng.integers(0, VOCAB, (3, 5)).astype(np.int32)
    got = token_logprobs(jnp.asarray(logits, jnp.bfloat16), targets, 0.7)
    assert got.dtype == jnp.float32  # a narrower dtype is widened
    want = numpy_logprobs(np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32), targets, 0.7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, 0.0)


def test_learner_batch_puts_each_completion_token_where_it_is_the_target():
    got = learner_batch(
        [[5, 6], [7], [8, 9, 10]],
        [[1, 2, 3], [], [4, 2]],  # the second row completed nothing: all padding
        [[-1.0, -2.0, -3.0], [], [-4.0, -5.0]],
        [0.5, 0.0, -1.5],
        seq_len=5,
        ref_logprobs=[[-0.1, -0.2, -0.3], [], [-0.4, -0.5]],
        pad_id=31,
    )
    np.testing.assert_array_equal(got["inputs"], [[5, 6, 1, 2, 3], [7, 31, 31, 31, 31], [8, 9, 10, 4, 2]])
    np.testing.assert_array_equal(got["targets"], [[6, 1, 2, 3, 31], [31, 31, 31, 31, 31], [9, 10, 4, 2, 31]])
    np.testing.assert_array_equal(got["loss_mask"], [[0, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 0]])
    np.testing.assert_array_equal(got["old_logprobs"], [[0, -1, -2, -3, 0], [0] * 5, [0, 0, -4, -5, 0]])
    np.testing.assert_allclose(got["ref_logprobs"], [[0, -0.1, -0.2, -0.3, 0], [0] * 5, [0, 0, -0.4, -0.5, 0]])
    np.testing.assert_array_equal(got["advantages"], [0.5, 0.0, -1.5])
    assert {k: v.dtype.name for k, v in got.items()} == {
        "inputs": "int32",
        "targets": "int32",
        "loss_mask": "float32",
        "advantages": "float32",
        "old_logprobs": "float32",
        "ref_logprobs": "float32",
    }


@pytest.mark.parametrize(
    "args,match",
    [
        (([[1, 2]], [[3, 4, 5, 6]], [[0.0] * 4], [1.0]), r"prompt \(2\) \+ completion \(4\) tokens exceed"),
        (([[1]], [[3, 4]], [[0.0]], [1.0]), r"sample 0: 1 old_logprobs for a completion of 2 tokens"),
        (([[1], [2]], [[3]], [[0.0]], [1.0, 1.0]), r"one entry per sample in each of prompts \(2\), completions \(1\)"),
        (([[]], [[3]], [[0.0]], [1.0]), "sample 0: an empty prompt"),
        (([[1]], [[]], [[]], [1.0]), "no completion token in the batch"),
    ],
)
def test_learner_batch_refuses_rows_that_do_not_fit(args, match):
    with pytest.raises(ValueError, match=match):
        learner_batch(*args, seq_len=4)


# -- the loss ----------------------------------------------------------------------------------
def random_rows(seed=1, rows=4, t=6):
    """Logits and a GRPO batch whose old log-probabilities lie far enough from the logits' to
    clip tokens on both sides; the last two tokens of each row are padding with garbage old
    and reference log-probabilities."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(rows, t, VOCAB)) * 2).astype(np.float32)
    targets = rng.integers(0, VOCAB, (rows, t)).astype(np.int32)
    logp = numpy_logprobs(logits, targets, TEMPERATURE)
    mask = np.ones((rows, t), np.float32)
    mask[:, -2:] = 0.0
    batch = {
        "targets": targets,
        "loss_mask": mask,
        "advantages": np.array([1.3, -0.7, 0.4, -1.6], np.float32)[:rows],
        "old_logprobs": (logp + rng.normal(scale=0.8, size=logp.shape)).astype(np.float32),
        "ref_logprobs": (logp + rng.normal(scale=0.5, size=logp.shape)).astype(np.float32),
    }
    return logits, batch


def test_the_loss_matches_numpy_with_clipping_on_both_sides_and_kl():
    logits, batch = random_rows()
    want, weight, above, below = numpy_grpo(logits, batch, CLIP, KL, TEMPERATURE)
    assert above >= 2 and below >= 2, (above, below)  # both clips are exercised
    loss_sum, got_weight = LOSS(logits, batch)
    assert float(got_weight) == weight == 16.0
    np.testing.assert_allclose(float(loss_sum), want, rtol=1e-5)
    # Without the penalty the sum changes by kl_coef times the k3 terms, each >= 0.
    plain, _, _, _ = numpy_grpo(logits, batch, CLIP, 0.0, TEMPERATURE)
    assert want > plain
    np.testing.assert_allclose(float(grpo_loss(logits, batch, temperature=TEMPERATURE)[0]), plain, rtol=1e-5)


def test_padding_weighs_nothing_whatever_its_log_probabilities():
    logits, batch = random_rows()
    pad = batch["loss_mask"] == 0
    garbage = {
        **batch,
        "old_logprobs": np.where(pad, -np.inf, batch["old_logprobs"]).astype(np.float32),
        "ref_logprobs": np.where(pad, 1e30, batch["ref_logprobs"]).astype(np.float32),
        "targets": np.where(pad, 0, batch["targets"]).astype(np.int32),
    }
    objective = lambda logits, b: (lambda s, w: s / w)(*LOSS(logits, b))
    want, want_grad = jax.value_and_grad(objective)(logits, batch)
    got, got_grad = jax.value_and_grad(objective)(logits, garbage)
    assert float(got) == float(want)
    assert np.all(np.isfinite(got_grad)) and np.array_equal(got_grad, want_grad)
    assert not np.any(got_grad[pad]) and np.any(got_grad[~pad])


def test_a_missing_reference_is_named_when_kl_is_on():
    logits, batch = random_rows()
    del batch["ref_logprobs"]
    grpo_loss(logits, batch)  # kl_coef 0 does not read it
    with pytest.raises(ValueError, match=r"missing \['ref_logprobs'\] \(kl_coef > 0 reads a frozen reference"):
        LOSS(logits, batch)


@pytest.mark.slow  # a GPT's gradient twice per case: seconds
@pytest.mark.every_jax
@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_on_policy_the_gradient_is_the_policy_gradient(kl_coef):
    """With old (and reference) log-probabilities the current policy's, every ratio is 1 and
    k3's gradient is 0 there: the gradient is that of -sum(A * logp * mask) / sum(mask), logp
    here from optax's cross-entropy."""
    batch = gpt_samples()
    graphdef, params, rest = nnx.split(make_gpt(), nnx.Param, ...)
    logits_of = lambda p: nnx.merge(graphdef, p, rest)(batch["inputs"])
    now = np.asarray(token_logprobs(logits_of(params), batch["targets"], TEMPERATURE))
    on_policy = {**batch, "old_logprobs": now, "ref_logprobs": now}
    loss = functools.partial(grpo_loss, kl_coef=kl_coef, temperature=TEMPERATURE)
    objective = lambda p: (lambda s, w: s / w)(*loss(logits_of(p), on_policy))

    def policy_gradient(p):
        logp = -optax.softmax_cross_entropy_with_integer_labels(logits_of(p) / TEMPERATURE, batch["targets"])
        mask = batch["loss_mask"]
        return -jnp.sum(batch["advantages"][:, None] * logp * mask) / jnp.sum(mask)

    value, grads = jax.jit(jax.value_and_grad(objective))(params)
    _, want = jax.jit(jax.value_and_grad(policy_gradient))(params)
    mask = batch["loss_mask"]
    # Ratio 1: the loss is -mean(A) over the tokens, whatever the policy's log-probabilities.
    np.testing.assert_allclose(float(value), -np.sum(batch["advantages"][:, None] * mask) / np.sum(mask), rtol=1e-5)
    leaves = lambda tree: [np.asarray(g) for g in jax.tree.leaves(tree)]
    ref.assert_leaves_close(leaves(grads), leaves(want), 1e-5, "gradients")


# -- pipelined equals unpipelined --------------------------------------------------------------
def gpt_samples() -> dict:
    """A fixed learner batch: NUM_PROMPTS prompts of 2 to 4 tokens, each sampled N times with
    completions from 1 token to as many as fill the row, advantages of random rewards; old and
    reference log-probabilities the initial model's plus noise, so ratios start around 1 and
    some tokens are clipped."""
    rng = np.random.default_rng(5)
    prompt_of = [list(rng.integers(0, VOCAB, rng.integers(2, 5))) for _ in range(NUM_PROMPTS)]
    prompts = [prompt_of[i] for i in range(NUM_PROMPTS) for _ in range(N)]
    completions = [list(rng.integers(0, VOCAB, rng.integers(1, SEQ + 2 - len(p)))) for p in prompts]
    zeros = [[0.0] * len(c) for c in completions]
    advantages = group_advantages(rng.normal(size=(NUM_PROMPTS, N)))
    batch = learner_batch(prompts, completions, zeros, advantages, seq_len=SEQ, ref_logprobs=zeros)
    logp = np.asarray(token_logprobs(make_gpt()(batch["inputs"]), batch["targets"], TEMPERATURE))
    for key, scale in (("old_logprobs", 0.5), ("ref_logprobs", 0.5)):
        batch[key] = ((logp + rng.normal(scale=scale, size=logp.shape)) * batch["loss_mask"]).astype(np.float32)
    return batch


@pytest.fixture(scope="module")
def samples():
    batch = gpt_samples()
    # Token weighting matters here: the microbatches hold different numbers of completion
    # tokens, and the mean of their means is far from the token mean the step must take.
    counts = batch["loss_mask"].reshape(M, -1).sum(1)
    assert len(set(counts)) > 1, counts
    logits = make_gpt()(batch["inputs"])
    rows = len(batch["inputs"]) // M
    sums = np.array([LOSS(logits[j * rows : (j + 1) * rows], micro(batch, j, rows))[0] for j in range(M)])
    token_mean = sums.sum() / counts.sum()
    assert abs(np.mean(sums / counts) - token_mean) > 1e-2 * abs(token_mean), (sums, counts)
    # ... and the first step clips tokens on both sides.
    _, _, above, below = numpy_grpo(np.asarray(logits), batch, CLIP, KL, TEMPERATURE)
    assert above and below, (above, below)
    return batch


def micro(batch: dict, j: int, rows: int) -> dict:
    return {k: v[j * rows : (j + 1) * rows] for k, v in batch.items()}


@pytest.fixture(scope="module")
def unpipelined(samples):
    """(losses, first-step gradients, final parameters) of the whole GPT trained on the batch
    with SGD and momentum in plain JAX: jax.grad of sum(loss_sum) / sum(weight) over the whole
    batch in one call; leaves keyed by model path."""
    graphdef, params, rest = nnx.split(make_gpt(), nnx.Param, ...)
    paths = [path_string(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def objective(params, batch):
        loss_sum, weight = LOSS(nnx.merge(graphdef, params, rest)(batch["inputs"]), batch)
        return loss_sum / weight

    losses, grads, final = ref.descend(objective, params, [(samples,)] * STEPS, wl.sgd())
    return losses, dict(zip(paths, grads)), dict(zip(paths, final))


def assert_pipelined_equals(unpipelined, samples, schedule, v=None, cluster=None):
    split = lambda: mpmd.split(make_gpt(), num_stages=2 * (v or 1))
    paths = [p for stage in split().param_paths for p in stage]
    want_losses, want_grads, want_params = unpipelined
    assert sorted(paths) == sorted(want_grads)  # the split's leaves are the model's
    losses, grads, params, _ = wl.pipelined(
        split, LOSS, [samples] * STEPS, M, schedule, cluster=cluster, virtual_stages=v, close=cluster is None
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    ref.assert_leaves_close(grads, [want_grads[p] for p in paths], 1e-5, "first-step gradients")
    ref.assert_leaves_close(params, [want_params[p] for p in paths], 1e-5, f"parameters after {STEPS} steps")
    # The steps moved the policy: the losses change, so equal parameters are no coincidence.
    assert len(set(losses)) == STEPS


@pytest.mark.slow
@pytest.mark.every_jax
@pytest.mark.parametrize("schedule,v", [("gpipe", None), ("1f1b", None), ("interleaved-1f1b", 2)])
def test_pipelined_grpo_training_equals_the_unpipelined_model(unpipelined, samples, schedule, v):
    assert_pipelined_equals(unpipelined, samples, schedule, v)


@pytest.mark.slow
@pytest.mark.every_jax
def test_pipelined_grpo_training_on_two_workers_equals_the_unpipelined_model(unpipelined, samples, workers):
    assert_pipelined_equals(unpipelined, samples, "1f1b", cluster=workers)


def test_the_last_stage_is_sent_only_the_keys_the_loss_reads(samples):
    """The Trainer traces the loss to find its keys: the reference log-probabilities are sent
    only when the KL penalty reads them, and the weight (the mask's sum) is the batch's."""
    plain = functools.partial(grpo_loss, temperature=TEMPERATURE)
    for loss, extra in ((plain, ()), (LOSS, ("ref_logprobs",))):
        pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), loss)
        plan = batches.plan(pipe, batches.micro_specs(samples, M), pair=False)
        assert plan.weighted
        assert plan.loss_keys == tuple(sorted(("advantages", "loss_mask", "old_logprobs", "targets") + extra))
