"""recipes/rl/prompts.py: the fine-tuning examples as GRPO's prompts (the tokens training put
before each response) and the seeded order they are visited in."""

import numpy as np
import pytest

from mpmd.recipes.config import ConfigError
from mpmd.recipes.data import sft, tokenizer
from mpmd.recipes.rl.prompts import Prompts

BYTES = tokenizer.load("bytes")


def examples(n=5):
    return [sft.parse({"prompt": f"reverse w{i}x:", "response": f"x{i}w"}, f"train.jsonl:{i + 1}") for i in range(n)]


def test_a_prompt_is_what_training_put_before_the_response():
    prompts = Prompts.of(examples(), BYTES, room=16)
    for i, ex in enumerate(examples()):
        ids, trained = sft.encode(ex, BYTES)
        assert prompts.tokens[i] == list(BYTES.encode(f"reverse w{i}x:"))
        assert not trained[: len(prompts.tokens[i])].any() and trained[len(prompts.tokens[i])]
        assert prompts.texts[i] == f"reverse w{i}x:" and prompts.responses[i] == f"x{i}w"
    # A chat: everything before its last assistant message is the prompt.
    chat = sft.parse(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "c.jsonl:1"
    )
    (tokens,), (text,), (response,) = Prompts.of([chat], BYTES, room=32).take([0])
    assert BYTES.decode(tokens) == text == "user: hi\nassistant: " and response == "yo"


def test_a_prompt_with_no_room_for_the_completion_is_refused_naming_its_line():
    long = sft.parse({"prompt": "reverse abcdef:", "response": "fedcba"}, "train.jsonl:3")
    assert len(Prompts.of(examples()[:2], BYTES, room=12)) == 2  # 12 tokens each: they fit
    with pytest.raises(ConfigError, match=r"train.jsonl:3: the prompt is 15 tokens; .* at most 12"):
        Prompts.of(examples()[:2] + [long], BYTES, room=12)


def test_each_epoch_visits_every_prompt_once_in_a_seeded_order():
    prompts = Prompts.of(examples(5), BYTES, room=16)
    steps = [prompts.of_step(s, 2, seed=3) for s in range(5)]  # 10 positions: two epochs of 5
    flat = [i for ids in steps for i in ids]
    assert sorted(flat[:5]) == sorted(flat[5:]) == list(range(5))
    assert flat[:5] != flat[5:] or flat[:5] != sorted(flat[:5])  # reshuffled (or not the identity)
    assert [prompts.of_step(s, 2, seed=3) for s in range(5)] == steps  # a function of (seed, step)
    assert [i for s in range(5) for i in prompts.of_step(s, 2, seed=4)] != flat
    assert np.array_equal(prompts.of_step(2, 2, seed=3), flat[4:6])  # step 2 spans both epochs
