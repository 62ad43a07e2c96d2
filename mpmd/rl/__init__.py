"""Reinforcement learning across slice groups: the batched sampler (a program for a sampler
group), GRPO's loss and advantages, weight sync learner -> sampler, and the GRPO loop.

    from mpmd import rl
    run = rl.GRPO(groups, model, optax.sgd(0.05), reward=..., num_stages=2, max_new_tokens=64)

docs/rl.md is the guide.
"""

from mpmd.rl.grpo import group_advantages, grpo_loss, learner_batch, token_logprobs
from mpmd.rl.loop import GRPO, GroupSampler, padded
from mpmd.rl.sampler import Sampler, Samples, program
from mpmd.rl.sync import WeightSync

__all__ = [
    "GRPO",
    "GroupSampler",
    "Sampler",
    "Samples",
    "WeightSync",
    "group_advantages",
    "grpo_loss",
    "learner_batch",
    "padded",
    "program",
    "token_logprobs",
]
