"""Rewards of text for `rl.reward`, and the adapter that gives one to GRPO as a reward of token ids.

A reward is a function

    def reward(prompt: str, completion: str, *, response: str, ended: bool) -> float

- prompt: the example's prompt, as the jsonl file wrote it;
- completion: what the policy wrote, decoded by the run's tokenizer, up to its end marker
  (recipes/data/sft.py end_marker: the end-of-text token, or a newline for bytes), the marker
  itself not included;
- response: the example's response: the reference answer (a reward may ignore it);
- ended: whether the completion ended with the end marker within rl.max_new_tokens (one that
  did not was cut there, mid-answer).

The reference answer and `ended` are keyword arguments so that a reward which needs neither is
still `def reward(prompt, completion, **_)`. `rl.reward` names one as 'module:function'; the
module is imported while the config loads (a user's module next to the config imports as
`imports` do), and a name that does not import, is not callable or does not take these
arguments is refused then, before any worker starts.

This module imports nothing heavy: the config loads it before JAX.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from typing import Callable, Sequence

from mpmd.recipes import registry
from mpmd.recipes.config.sections import ConfigError

_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def exact_match(prompt: str, completion: str, *, response: str, ended: bool) -> float:
    """1.0 when the completion equals the response, both stripped of surrounding whitespace
    (the held-out score's rule, recipes/data/exact_match.py), else 0.0."""
    return float(completion.strip() == response.strip())


def format(prompt: str, completion: str, *, response: str, ended: bool) -> float:
    """1.0 when the completion is well-formed: non-blank and ended by the end marker within
    rl.max_new_tokens (the model answers and stops), else 0.0. The response is not read."""
    return float(ended and bool(completion.strip()))


def resolve(spec: str, key: str = "rl.reward") -> Callable[..., float]:
    """The function 'module:function' names; ConfigError naming `key` when it is not one that
    takes (prompt, completion, *, response, ended)."""
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise ConfigError(f"{key}={spec!r} must be 'module:function', e.g. 'mpmd.recipes.rl.rewards:exact_match'")
    module_name, name = spec.split(":")
    try:
        module = registry.import_module(module_name, key)
    except ConfigError:
        raise
    except Exception as e:  # the module's own code failed: still the config's value that is wrong
        raise ConfigError(f"{key}={spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{key}={spec!r}: module {module_name!r} has no {name!r}")
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return fn
    try:
        signature.bind("", "", response="", ended=True)
    except TypeError as e:
        raise ConfigError(
            f"{key}={spec!r} must take (prompt, completion, *, response, ended) (docs/rl-recipe.md): {e}"
        ) from None
    return fn


class TokenReward:
    """GRPO's reward of token ids (mpmd/rl/loop.py calls it with a prompt's and a completion's
    tokens) from a reward of text (module docstring).

    With a one-token end marker the sampler stops at it and the loop hands over the completion
    without it, so a completion ended exactly when it is shorter than max_new_tokens (one that
    never drew the marker has all max_new_tokens). A marker of several tokens cannot stop the
    sampler (it stops at one token id): every completion is drawn to max_new_tokens, and here it
    is cut at the marker's first occurrence; the tokens after it are still trained, with the
    completion's advantage (they never reach a reader: decoding stops at the marker)."""

    def __init__(self, fn: Callable[..., float], tok, end_marker: Sequence[int], max_new_tokens: int):
        self.fn, self.tok, self.max_new_tokens = fn, tok, max_new_tokens
        self.end_marker = [int(t) for t in end_marker]
        self._step: dict[tuple[int, ...], tuple[str, str]] = {}

    @property
    def end_token(self) -> int | None:
        """The token the sampler stops at: the marker's, when it is one token."""
        return self.end_marker[0] if len(self.end_marker) == 1 else None

    def use(self, prompts: Sequence[Sequence[int]], texts: Sequence[str], responses: Sequence[str]) -> None:
        """Prompts (token ids) with their text and response, added to those rewards can be
        computed for (a step's, the next one's drawn ahead, a replayed one's). Two prompts of
        equal tokens share one entry: GRPO's reward is a function of the prompt and the
        completion only."""
        self._step.update({tuple(int(t) for t in p): (x, r) for p, x, r in zip(prompts, texts, responses)})

    def cut(self, completion: Sequence[int]) -> tuple[list[int], bool]:
        """(the completion's tokens before its end marker, whether it ended with one)."""
        tokens = [int(t) for t in completion]
        if self.end_token is not None:
            return tokens, len(tokens) < self.max_new_tokens
        m = len(self.end_marker)
        at = next((i for i in range(len(tokens) - m + 1) if tokens[i : i + m] == self.end_marker), None)
        return (tokens, False) if at is None else (tokens[:at], True)

    def __call__(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        text, response = self._step[tuple(int(t) for t in prompt)]
        tokens, ended = self.cut(completion)
        value = self.fn(text, self.tok.decode(tokens), response=response, ended=ended)
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            name = getattr(self.fn, "__qualname__", repr(self.fn))
            raise ValueError(f"rl.reward {name} returned {value!r}: a reward is a finite float")
        return float(value)
