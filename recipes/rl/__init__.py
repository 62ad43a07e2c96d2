"""The recipe side of reinforcement learning: rewards of text (rewards.py) and the fine-tuning
examples as prompts (prompts.py); recipes/run/rl.py runs GRPO on them (docs/rl-recipe.md)."""
