"""Exact-match accuracy of a fine-tuned model on held-out prompt/response examples: the greedy
continuation of each prompt, up to the end marker (recipes/data/sft.py end_marker), equals the
response (both stripped of surrounding whitespace).

    accuracy = exact_match.score(model, tok, examples)       # in [0, 1]
    scorer = exact_match.Scorer(cfg)                          # the run's held-out examples (train.exact_match)
    scorer(trainer)                                           # the trainer's parameters as they are now

Decoded with mpmd.models.decoding.Decoder (the key-value cache, greedy: next_token at
temperature 0), from the prompt's tokens as training encoded them (each segment alone), so
the model is asked exactly what it was taught to answer. A continuation is cut at the end
marker or after twice the response's tokens plus 8, whichever comes first.
"""

from __future__ import annotations

import numpy as np

from mpmd.recipes.data import sft


def answer(decoder, tok, example: sft.Example) -> str:
    """The greedy continuation of the example's prompt, up to (not including) the end marker."""
    from mpmd.models import decoding

    ids, _ = sft.encode(example, tok)
    end = sft.end_marker(tok)
    num_answer = len(tok.encode(example.response)) + len(end)  # the last segment and its end
    prompt = ids[: len(ids) - num_answer]
    out: list[int] = []
    vocab_size = tok.vocab_size  # rows past it are padding for the mesh: never drawn
    greedy = lambda logits: decoding.next_token(logits[:vocab_size], 0, 0, None)
    for token, _ in decoder.stream(prompt, greedy):
        out.append(token)
        if out[-len(end) :] == end:
            out = out[: -len(end)]
            break
        if len(out) >= 2 * num_answer + 8:
            break
    return tok.decode(out)


def answers_chat(decoder, tok, example: sft.Example) -> bool:
    """A chat rendered by the tokenizer's chat template: whether the greedy continuation of
    everything before its last assistant span is that span's tokens, exactly."""
    from mpmd.models import decoding

    ids, trained = sft.encode(example, tok)
    end = int(np.flatnonzero(trained)[-1]) + 1
    start = end
    while start > 0 and trained[start - 1]:
        start -= 1
    want = ids[start:end].tolist()
    vocab_size = tok.vocab_size
    out: list[int] = []
    for token, _ in decoder.stream(ids[:start], lambda logits: decoding.next_token(logits[:vocab_size], 0, 0, None)):
        out.append(token)
        if len(out) == len(want) or out[-1] != want[len(out) - 1]:
            break
    return out == want


def score(model, tok, examples: list[sft.Example]) -> float:
    """The fraction of `examples` whose greedy answer (`answer`) is their response; a chat
    rendered by a chat template: whose last assistant span it reproduces (`answers_chat`)."""
    from mpmd.models import decoding

    decoder = decoding.Decoder(model)
    templated = getattr(tok, "chat_template", None) is not None
    hits = [
        answers_chat(decoder, tok, ex)
        if templated and ex.messages is not None
        else answer(decoder, tok, ex).strip() == ex.response.strip()
        for ex in examples
    ]
    return float(np.mean(hits))


class Scorer:
    """The run's exact-match accuracy on its first train.exact_match held-out examples, from a
    trainer's parameters fetched to this process."""

    def __init__(self, cfg):
        from mpmd.recipes.data import tokenizer

        self.cfg = cfg
        self.tok = tokenizer.of_config(cfg)
        self.examples = sft.splits(cfg)[1][: cfg.train.exact_match]

    def __call__(self, trainer) -> float:
        from mpmd.recipes.run import generate

        return score(generate.model_with(self.cfg, generate.trainer_params(trainer)), self.tok, self.examples)
