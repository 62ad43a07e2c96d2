"""recipes/rl/rewards.py: the built-in rewards, and GRPO's reward of token ids made from one of
text (the completion cut at its end marker, `ended` as the sampler left it)."""

import math

import pytest

from mpmd.recipes.data import sft, tokenizer
from mpmd.recipes.rl import rewards

BYTES = tokenizer.load("bytes")
NEWLINE = sft.end_marker(BYTES)  # bytes has no end-of-text token: a newline ends a response


def test_exact_match_is_the_response_stripped():
    r = rewards.exact_match
    assert r("reverse kqzt:", "tzqk", response="tzqk", ended=True) == 1.0
    assert r("reverse kqzt:", " tzqk ", response="tzqk\n", ended=True) == 1.0
    assert r("reverse kqzt:", "tzq", response="tzqk", ended=True) == 0.0
    assert r("reverse kqzt:", "tzqkk", response="tzqk", ended=False) == 0.0


def test_format_is_a_non_blank_completion_that_ended():
    assert rewards.format("p", "abc", response="zzz", ended=True) == 1.0  # the response is not read
    assert rewards.format("p", "abc", response="abc", ended=False) == 0.0  # cut at max_new_tokens
    assert rewards.format("p", "  ", response="abc", ended=True) == 0.0


def test_resolve_gives_the_built_ins():
    assert rewards.resolve("mpmd.recipes.rl.rewards:exact_match") is rewards.exact_match
    assert rewards.resolve("mpmd.recipes.rl.rewards:format") is rewards.format


def seen_by(fn, marker, max_new_tokens, prompt, completion):
    """What a reward of text is called with for GRPO's (prompt, completion) of token ids."""
    calls = []

    def reward(prompt, completion, *, response, ended):
        calls.append((prompt, completion, response, ended))
        return fn(prompt, completion, response=response, ended=ended)

    token_reward = rewards.TokenReward(reward, BYTES, marker, max_new_tokens)
    tokens = list(BYTES.encode("reverse kqzt:"))
    token_reward.use([tokens], ["reverse kqzt:"], ["tzqk"])
    value = token_reward(tokens, list(BYTES.encode(completion)))
    return value, calls[0]


def test_a_one_token_marker_stops_the_sampler_and_ended_is_a_short_completion():
    """The loop hands the completion over without the end token the sampler stopped at: one of
    fewer than max_new_tokens tokens ended, one of max_new_tokens ran out."""
    assert rewards.TokenReward(rewards.exact_match, BYTES, NEWLINE, 8).end_token == ord("\n")
    value, call = seen_by(rewards.exact_match, NEWLINE, 8, "reverse kqzt:", "tzqk")
    assert value == 1.0 and call == ("reverse kqzt:", "tzqk", "tzqk", True)
    value, call = seen_by(rewards.format, NEWLINE, 8, "reverse kqzt:", "tzqkabcd")
    assert value == 0.0 and call[1:] == ("tzqkabcd", "tzqk", False)


def test_a_marker_of_several_tokens_cuts_the_completion_at_its_first_occurrence():
    marker = list(BYTES.encode("!!"))
    token_reward = rewards.TokenReward(rewards.exact_match, BYTES, marker, 12)
    assert token_reward.end_token is None  # the sampler draws every completion to max_new_tokens
    assert token_reward.cut(list(BYTES.encode("tzqk!!ab!!c!"))) == (list(BYTES.encode("tzqk")), True)
    assert token_reward.cut(list(BYTES.encode("tzqk!ab!cdef"))) == (list(BYTES.encode("tzqk!ab!cdef")), False)
    value, call = seen_by(rewards.exact_match, marker, 12, "reverse kqzt:", "tzqk!!zzzzzz")
    assert value == 1.0 and call[1:] == ("tzqk", "tzqk", True)


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1.0", None])
def test_a_reward_that_is_not_a_finite_number_stops_the_step_naming_it(bad):
    def broken(prompt, completion, **_):
        return bad

    token_reward = rewards.TokenReward(broken, BYTES, NEWLINE, 8)
    prompt = list(BYTES.encode("reverse kqzt:"))
    token_reward.use([prompt], ["reverse kqzt:"], ["tzqk"])
    with pytest.raises(ValueError, match=r"rl.reward .*broken returned .*a finite float"):
        token_reward(prompt, list(BYTES.encode("tzqk")))
