"""Helpers the tests share: reference models and runs, process helpers, recovery scenarios."""
