"""Recipes: config files -> a training run."""
