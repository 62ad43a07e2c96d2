"""GRPO's loss (Group Relative Policy Optimization; Shao et al. 2024, DeepSeekMath), as a
pipeline's last stage computes it, and the learner batch it reads.

A prompt is sampled n times; each completion i of a group gets a reward r_i, and every token
of it the same advantage

    A_i = (r_i - mean(r)) / (std(r) + eps)        (mean, std over the n rewards of its group;
                                                   std the population one, ddof=0)

so A has no unit (rewards in any unit give the same A), a group with a spread has mean 0 and
std ~1, and a group whose rewards are all equal teaches nothing (A = 0). TRL divides by the
sample std (ddof=1) instead, which scales every advantage by sqrt((n-1)/n).

Per completion token t, with logp_t = log softmax(logits_t / temperature)[token] (nats) under
the policy being trained, old_t the same under the policy that sampled it (the sampler's
record, constant here) and ref_t under a frozen reference:

    ratio_t     = exp(logp_t - old_t)
    surrogate_t = min(ratio_t * A, clip(ratio_t, 1 - clip_eps, 1 + clip_eps) * A)
    k3_t        = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (>= 0, nats)
    loss_t      = -surrogate_t + kl_coef * k3_t

k3 is Schulman's estimator of KL(policy || reference) from a sample of the policy: unbiased,
never negative, with less variance than logp - ref. The clip stops a token's gradient once
its ratio has moved past 1 +- clip_eps in the direction its advantage pushes (PPO), so
several optimizer steps can reuse one batch of samples.

`grpo_loss` returns (sum of loss_t over completion tokens, their count): the pipeline divides
the step's summed loss by its summed weight (mpmd/stages/batch.py), so the objective is the
mean of loss_t over every completion token of the step, each token weighing the same whatever
completion, row or microbatch it sits in (DAPO's token-level normalisation). GRPO's paper
averages per completion first, which weighs a long completion's tokens less and makes the
step's loss depend on how rows are grouped into microbatches; the token mean does not.

Bind the options with functools.partial to get the `loss_fn(outputs, batch)` a Pipeline takes:

    loss = functools.partial(grpo_loss, clip_eps=0.2, kl_coef=0.04, temperature=1.0)
    trainer = mpmd.Trainer(mpmd.Pipeline(stages, loss), optax.adamw(1e-6), ...)

Only the batch keys the loss reads are sent to the last stage: `ref_logprobs` only when
kl_coef > 0.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def group_advantages(rewards, eps: float = 1e-6) -> jax.Array:
    """Advantages float32 [num_prompts * n] of rewards [num_prompts, n] (n samples of each
    prompt, row-major: sample j of prompt i is entry i * n + j): each (r - mean of its group)
    / (std of its group + eps); exactly 0 for a group whose rewards are all equal."""
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must be [num_prompts, n] with n >= 2 samples per prompt (a group of one "
            f"has no spread to compare against), got shape {rewards.shape}"
        )
    if not jnp.issubdtype(rewards.dtype, jnp.number) or jnp.issubdtype(rewards.dtype, jnp.complexfloating):
        raise ValueError(f"rewards must be real numbers, got dtype {rewards.dtype}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    r = rewards.astype(jnp.float32)
    centred = r - jnp.mean(r, axis=1, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(centred), axis=1, keepdims=True))
    # Equal rewards need the explicit test: their float mean can be an ulp off each of them,
    # and that ulp divided by eps alone would be a sizeable advantage.
    flat = (jnp.max(r, axis=1) == jnp.min(r, axis=1))[:, None]
    return jnp.where(flat, 0.0, centred / (std + eps)).reshape(-1)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature) at `targets`: [B, T] in float32 (or the logits' dtype
    if wider), nats. The sampler records this per sampled token and the loss recomputes it,
    so both sides' log-probabilities are one function of the logits (a vocabulary padded for
    the mesh must be sliced alike on both sides: the padding's logits are in the softmax)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the softmax of logits / temperature), got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} must be targets {targets.shape} plus a vocab axis")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    scaled = logits.astype(jnp.promote_types(logits.dtype, jnp.float32)) / temperature
    # The target's logit minus the log-normaliser: no [B, T, vocab] log_softmax is kept.
    picked = jnp.take_along_axis(scaled, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def grpo_loss(
    logits: jax.Array, batch: dict, *, clip_eps: float = 0.2, kl_coef: float = 0.0, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """(sum of loss_t over the completion tokens, their count): the module docstring's
    formula. `batch` holds targets [B, T] int, loss_mask [B, T] (1 on completion tokens),
    advantages [B], old_logprobs [B, T], and ref_logprobs [B, T] when kl_coef > 0.

    Tokens whose mask is 0 weigh nothing, and whatever their old or reference log-probability
    (0, -inf) they make no NaN: their log-ratios are set to 0 before any exp."""
    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0 (the ratio is clipped to [1 - clip_eps, 1 + clip_eps]), got {clip_eps}")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0 (the weight of the KL penalty), got {kl_coef}")
    need = ("targets", "loss_mask", "advantages", "old_logprobs") + (("ref_logprobs",) if kl_coef else ())
    missing = [k for k in need if k not in batch]
    if missing:
        why = " (kl_coef > 0 reads a frozen reference's log-probabilities)" if "ref_logprobs" in missing else ""
        raise ValueError(f"grpo_loss needs batch keys {list(need)}; missing {missing}{why}")
    targets, mask = batch["targets"], batch["loss_mask"]
    logp = token_logprobs(logits, targets, temperature)
    per_token = {k: batch[k] for k in ("loss_mask", "old_logprobs", "ref_logprobs") if k in need}
    for k, v in per_token.items():
        if v.shape != targets.shape:
            raise ValueError(f"{k} {v.shape} must have the targets' shape {targets.shape}")
    advantages = batch["advantages"]
    if advantages.shape != targets.shape[:1]:
        raise ValueError(f"advantages {advantages.shape} must be one per row, {targets.shape[:1]}")
    real = mask != 0
    mask = mask.astype(logp.dtype)
    a = advantages.astype(logp.dtype)[:, None]
    # Masked to 0 before the exp (not after): a padding token's garbage would otherwise make
    # an inf whose product with mask 0 is NaN, in the loss or in its gradient.
    log_ratio = jnp.where(real, logp - batch["old_logprobs"].astype(logp.dtype), 0.0)
    ratio = jnp.exp(log_ratio)
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    loss = -surrogate
    if kl_coef:  # a Python branch: with kl_coef 0 ref_logprobs is not read, so never sent
        d = jnp.where(real, batch["ref_logprobs"].astype(logp.dtype) - logp, 0.0)
        loss = loss + kl_coef * (jnp.exp(d) - d - 1)
    return jnp.sum(loss * mask), jnp.sum(mask)


def learner_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    old_logprobs: Sequence[Sequence[float]],
    advantages,
    *,
    seq_len: int,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """The batch grpo_loss trains on, one row per sample: {"inputs", "targets", "loss_mask",
    "advantages", "old_logprobs"[, "ref_logprobs"]} as numpy arrays, [B, seq_len] (advantages
    [B]).

    Row i is prompts[i] + completions[i] (the completion as sampled, with its end token if it
    stopped on one), right-padded with pad_id to seq_len + 1 tokens; inputs = row[:-1],
    targets = row[1:], so targets[t] is the token the model predicts from inputs[:t + 1].
    loss_mask is 1 exactly where targets[t] is a completion token, and old_logprobs (and
    ref_logprobs) hold that token's log-probability there and 0 elsewhere. A group's prompt
    appears once per sample, in the order of `advantages` (group_advantages' order).
    """
    num_rows = len(prompts)
    lists = {"completions": completions, "old_logprobs": old_logprobs}
    if ref_logprobs is not None:
        lists["ref_logprobs"] = ref_logprobs
    advantages = np.asarray(advantages, np.float32)
    if advantages.shape != (num_rows,) or any(len(v) != num_rows for v in lists.values()):
        raise ValueError(
            f"one entry per sample in each of prompts ({num_rows}), "
            + ", ".join(f"{k} ({len(v)})" for k, v in lists.items())
            + f" and advantages (shape {advantages.shape})"
        )
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    rows = np.full((num_rows, seq_len + 1), pad_id, np.int32)
    mask = np.zeros((num_rows, seq_len), np.float32)
    per_token = {k: np.zeros((num_rows, seq_len), np.float32) for k in lists if k != "completions"}
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        p, c = len(prompt), len(completion)
        if p < 1:
            raise ValueError(f"sample {i}: an empty prompt (the first completion token needs one before it)")
        if p + c > seq_len + 1:
            raise ValueError(
                f"sample {i}: prompt ({p}) + completion ({c}) tokens exceed seq_len + 1 = {seq_len + 1} "
                f"(a row's inputs and targets are its tokens shifted by one, seq_len each)"
            )
        for k, arr in per_token.items():
            if len(lists[k][i]) != c:
                raise ValueError(f"sample {i}: {len(lists[k][i])} {k} for a completion of {c} tokens")
            arr[i, p - 1 : p - 1 + c] = lists[k][i]
        rows[i, :p] = prompt
        rows[i, p : p + c] = completion
        mask[i, p - 1 : p - 1 + c] = 1.0  # target t is row[t + 1]: completion token j is target p - 1 + j
    if not mask.any():
        raise ValueError("no completion token in the batch: the loss's weight would be 0")
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": mask, "advantages": advantages, **per_token}
