"""Arguments the commands share: a number range-checked when parsed, so that a bad value is
argparse's one usage line and exit 2 (`mpmd generate: error: argument --seed: must be a
whole number >= 0, got '-5'`), never a traceback later; the CONFIG and key=value arguments
of a command that reads a run's config, and its own section's keys for its epilog."""

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


def config_arguments(parser: argparse.ArgumentParser) -> None:
    """The CONFIG file and its key=value overrides, as a command that reads a run's config takes them."""
    parser.add_argument("config", metavar="CONFIG", help="YAML file of overrides of the defaults")
    parser.add_argument("overrides", metavar="key=value", nargs="*", help="dotted-key overrides of the file")


def section_keys(section: str, cls) -> str:
    """A command's own config section for its epilog: each key with its default and meaning."""
    from mpmd.recipes import config

    keys = "\n".join(f"  {section}." + line for line in config.describe(cls).splitlines())
    return f"{section}.* keys (default, meaning):\n{keys}"
