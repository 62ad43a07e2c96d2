"""Reinforcement learning across slice groups: a sampler, GRPO's loss, rewards."""
