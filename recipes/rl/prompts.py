"""The training examples of a jsonl file (recipes/data/sft.py) as GRPO's prompts.

    prompts = Prompts.of(examples, tok, room=seq_len - max_new_tokens)
    ids = prompts.of_step(step, prompts_per_step, seed)      # example indices in the file
    tokens = [prompts.tokens[i] for i in ids]

A prompt's tokens are those the fine-tuning run trained the response after: the example
encoded as training encodes it (sft.encode), cut where its last trained span (the response and
its end marker) begins. So a policy fine-tuned on the file is asked exactly what it learnt to
answer. Its id, which the sampler keys its draws by (mpmd/rl/sampler.py), is the example's
index in the training file: a prompt draws the same randoms whatever step or batch it is in.

The order: epoch e visits every example once, in a permutation drawn from (seed, e); step s
takes positions s * k .. s * k + k - 1 of the epochs laid end to end (k prompts a step), so
an epoch's last step may take prompts from the next one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mpmd.recipes.config import ConfigError
from mpmd.recipes.data import sft


@dataclasses.dataclass
class Prompts:
    tokens: list[list[int]]  # per example, its prompt's token ids
    texts: list[str]  # its prompt as the file wrote it (the context before its last response)
    responses: list[str]  # its last response: the reference answer
    _orders: dict[tuple[int, int], np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, examples: list[sft.Example], tok, room: int) -> "Prompts":
        """The examples' prompts; ConfigError naming the line of one longer than `room` tokens
        (model.seq_len - rl.max_new_tokens: a prompt and its completion are one row)."""
        tokens, texts = [], []
        for ex in examples:
            ids, trained = sft.encode(ex, tok)
            start = int(np.flatnonzero(trained)[-1]) + 1  # the last trained span's end ...
            while start > 0 and trained[start - 1]:  # ... and back to where it begins
                start -= 1
            if not 1 <= start <= room:
                raise ConfigError(
                    f"{ex.where}: the prompt is {start} tokens; with rl.max_new_tokens it must fit "
                    f"model.seq_len, so at most {room}: lower rl.max_new_tokens or raise model.seq_len"
                )
            tokens.append(ids[:start].tolist())
            last = max(i for i, (_, trained) in enumerate(ex.segments) if trained)
            texts.append("".join(text for text, _ in ex.segments[:last]))
        return cls(tokens, texts, [ex.response for ex in examples])

    def take(self, ids) -> tuple[list[list[int]], list[str], list[str]]:
        """(tokens, texts, responses) of the examples `ids`."""
        return [self.tokens[i] for i in ids], [self.texts[i] for i in ids], [self.responses[i] for i in ids]

    def __len__(self) -> int:
        return len(self.tokens)

    def _order(self, seed: int, epoch: int) -> np.ndarray:
        if (seed, epoch) not in self._orders:
            self._orders = {(seed, epoch): np.random.default_rng([seed, epoch]).permutation(len(self))}
        return self._orders[(seed, epoch)]

    def of_step(self, step: int, count: int, seed: int) -> list[int]:
        """The example indices of 0-based step `step`, `count` of them (module docstring)."""
        out = []
        for position in range(step * count, (step + 1) * count):
            epoch, k = divmod(position, len(self))
            out.append(int(self._order(seed, epoch)[k]))
        return out
