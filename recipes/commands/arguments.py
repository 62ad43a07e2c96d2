"""Argument types the commands share: a number range-checked when parsed, so that a bad value
is argparse's one usage line and exit 2 (`mpmd generate: error: argument --seed: must be a
whole number >= 0, got '-5'`), never a traceback later."""

from __future__ import annotations

import argparse
import math


def _number(kind, positive: bool):
    what = "a whole number" if kind is int else "a finite number"
    bound = "> 0" if positive else ">= 0"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text!r}")
        return value

    return parse


def non_negative(kind):
    """An argparse type: a finite `kind` (int or float), 0 or more."""
    return _number(kind, positive=False)


def positive(kind):
    """An argparse type: a finite `kind` (int or float), more than 0."""
    return _number(kind, positive=True)
