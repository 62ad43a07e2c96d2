"""Supervised fine-tuning data: `data.source: jsonl`, prompt/response pairs (or chat messages)
whose loss counts the response tokens only.

    examples = sft.read("data/sft/train.jsonl")          # [Example], each a list of (text, trained) segments
    rows = sft.Rows.of(examples, tok, seq_len)           # tokens + loss mask, one example a row
    train, eval = sft.loaders(cfg)                       # data.Loader of batch dicts

A line of the file is one JSON object: `{"prompt": str, "response": str}`, or
`{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}` with at least one
assistant message. A chat is rendered by the tokenizer's own chat template where its
tokenizer_config.json has one (recipes/data/chat.py: the assistant spans are trained, as
transformers' return_assistant_tokens_mask marks them), else as `<role>: <content>\\n` per
message, the assistant's contents (and their end marker) trained, everything else context. A bad line is refused
with a ConfigError naming the file, the line and the field.

Each example ends with an end marker the model learns to emit after a response: the tokenizer's
end-of-text token, or, for the bytes tokenizer (which has none), a newline. So a response the
bytes tokenizer scores (recipes/data/exact_match.py) is read up to its first newline.

Batches are dicts: `inputs`, `targets` (the tokens shifted by one), `loss_mask` (1.0 where the
target is a trained token) and, with `data.pack`, `segment_ids` and `positions`. The loss is
mpmd.models.masked_lm_loss, token-weighted: a step's objective is the mean over every trained
token of its global batch, whatever the microbatching. Unpacked, each example is one row
right-padded to seq_len (attention is causal: the padding changes no real token's logits);
packed, examples are placed first-fit, in a seeded shuffled order, into rows of seq_len tokens
once when the data is read. Rows are then served as windows are (recipes/data/loaders.py Shuffled:
a fresh permutation every epoch, a pure function of the seed and the batch index), so a resumed
run reads the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from mpmd.recipes.config import Config, ConfigError
from mpmd.recipes.data import chat
from mpmd.recipes.data.loaders import Loader, Shuffled
from mpmd.recipes.registry import one_of

ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class Example:
    """One training example: text segments in order, each trained (a response) or context."""

    segments: tuple[tuple[str, bool], ...]
    where: str  # "file:line", for messages naming it
    # A chat's messages as (role, content): rendered by the tokenizer's chat template where it
    # has one (recipes/data/chat.py), else as `segments`.
    messages: tuple[tuple[str, str], ...] | None = None

    @property
    def response(self) -> str:
        """The last trained segment: what exact-match scoring expects."""
        return [text for text, trained in self.segments if trained][-1]


def _string(value, where: str, field: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {field} must be a string, got {type(value).__name__} {value!r:.60}")
    if not allow_empty and not value.strip():
        raise ConfigError(f"{where}: {field} is empty: a prompt needs text to continue and a response text to train on")
    return value


def parse(record, where: str) -> Example:
    """One line's object as an Example; ConfigError naming `where` (file:line) and the field."""
    if not isinstance(record, dict):
        raise ConfigError(
            f"{where}: a line must be a JSON object with 'prompt' and 'response' (or "
            f"'messages'), got {type(record).__name__}"
        )
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects")
        segments = []
        for i, m in enumerate(messages):
            field = f"messages[{i}]"
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ConfigError(f"{where}: {field} must be an object with 'role' and 'content', got {m!r:.80}")
            role = m["role"]
            if role not in ROLES:
                raise ConfigError(f"{where}: {field}.role must be one of {one_of(ROLES)}, got {role!r}")
            content = _string(m["content"], where, f"{field}.content", allow_empty=role != "assistant")
            if role == "assistant":
                segments += [(f"{role}: ", False), (content, True)]
            else:
                segments.append((f"{role}: {content}\n", False))
        if not any(trained for _, trained in segments):
            raise ConfigError(f"{where}: messages has no 'assistant' message: nothing to train on")
        return Example(tuple(segments), where, tuple((m["role"], m["content"]) for m in messages))
    for field in ("prompt", "response"):
        if field not in record:
            raise ConfigError(
                f"{where}: no {field!r} field (a line holds 'prompt' and 'response', or "
                f"'messages'); it has {', '.join(map(repr, record)) or 'none'}"
            )
    prompt = _string(record["prompt"], where, "prompt", allow_empty=False)
    response = _string(record["response"], where, "response", allow_empty=False)
    return Example(((prompt, False), (response, True)), where)


def read(path) -> list[Example]:
    """Every example of a .jsonl file, in file order (blank lines skipped); ConfigError naming
    the file, line and field of the first bad one."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist (make a train and a held-out file with `mpmd sft-data -o DIR`)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        out.append(parse(record, where))
    if not out:
        raise ConfigError(f"{path} holds no examples (one JSON object a line)")
    return out


def end_marker(tok) -> list[int]:
    """The tokens that end a response: the tokenizer's end-of-text token, else a newline."""
    return [tok.eos_id] if tok.eos_id is not None else [int(t) for t in tok.encode("\n")]


def encode(example: Example, tok) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n] int32, trained [n] bool) of an example: a chat rendered by the tokenizer's
    chat template, its assistant spans trained (recipes/data/chat.py); otherwise each segment
    encoded alone (so the prompt's tokens are those scoring feeds), a trained segment
    followed by the end marker."""
    template = getattr(tok, "chat_template", None)
    if example.messages is not None and template is not None:
        return chat.encode(template, [{"role": r, "content": c} for r, c in example.messages], tok)
    ids, trained = [], []
    for text, is_response in example.segments:
        part = [int(t) for t in tok.encode(text)] + (end_marker(tok) if is_response else [])
        ids += part
        trained += [is_response] * len(part)
    return np.asarray(ids, np.int32), np.asarray(trained, bool)


@dataclasses.dataclass
class Rows:
    """Examples as rows of seq_len: the batch keys' arrays, [num_rows, seq_len] each."""

    arrays: dict[str, np.ndarray]

    @classmethod
    def of(cls, examples: list[Example], tok, seq_len: int, pack: bool = False, seed: int = 0) -> "Rows":
        """One example a row, or (pack) examples placed first-fit into rows, visited in an order
        shuffled from `seed`. ConfigError naming the line of an example longer than seq_len + 1."""
        encoded = []
        for ex in examples:
            ids, trained = encode(ex, tok)
            if len(ids) > seq_len + 1:
                raise ConfigError(
                    f"{ex.where}: the example is {len(ids)} tokens (end marker included), more than "
                    f"model.seq_len + 1 = {seq_len + 1}: shorten it or raise model.seq_len"
                )
            encoded.append((ids, trained))
        if not pack:
            bins = [[i] for i in range(len(encoded))]
        else:
            order = np.random.default_rng(seed).permutation(len(encoded))
            bins, free = [], []
            for i in order:  # first fit: each example into the first row with room for its inputs
                need = len(encoded[i][0]) - 1
                row = next((r for r, room in enumerate(free) if room >= need), None)
                if row is None:
                    row = len(bins)
                    bins.append([])
                    free.append(seq_len)
                bins[row].append(int(i))
                free[row] -= need
        keys = ["inputs", "targets", "loss_mask"] + (["segment_ids", "positions"] if pack else [])
        arrays = {k: np.zeros((len(bins), seq_len), np.float32 if k == "loss_mask" else np.int32) for k in keys}
        for r, members in enumerate(bins):
            at = 0
            for segment, i in enumerate(members, 1):
                ids, trained = encoded[i]
                n = len(ids) - 1
                arrays["inputs"][r, at : at + n] = ids[:-1]
                arrays["targets"][r, at : at + n] = ids[1:]
                arrays["loss_mask"][r, at : at + n] = trained[1:]  # the target is a response token
                if pack:
                    arrays["segment_ids"][r, at : at + n] = segment
                    arrays["positions"][r, at : at + n] = np.arange(n)
                at += n
        return cls(arrays)

    @property
    def num_rows(self) -> int:
        return len(self.arrays["inputs"])


class RowSource(Shuffled):
    """A data source (recipes/data/loaders.py) of Rows: batch i is rows of epoch permutation(seed, e)."""

    def __init__(self, rows: Rows):
        super().__init__(rows.num_rows)
        self.rows = rows

    def batch(self, seed: int, index: int, batch_size: int) -> dict:
        ids = self.epoch_ids(seed, index, batch_size)
        return {k: v[ids] for k, v in self.rows.arrays.items()}


def splits(cfg: Config) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples: data.path's, and data.eval_path's or else data.path's last
    data.eval_fraction (at least one)."""
    d = cfg.data
    examples = read(d.path)
    if d.eval_path is not None:
        return examples, read(d.eval_path)
    held = max(1, int(len(examples) * d.eval_fraction))
    if held >= len(examples):
        raise ConfigError(
            f"data.path={d.path!r} holds {len(examples)} example(s): too few to hold out "
            f"data.eval_fraction={d.eval_fraction} of them; add examples or give data.eval_path"
        )
    return examples[:-held], examples[-held:]


def loaders(cfg: Config) -> tuple[Loader, Loader]:
    """(train, eval) loaders of batch dicts over the train and held-out examples' rows."""
    from mpmd.recipes.data import tokenizer

    tok = tokenizer.of_config(cfg)
    out = []
    for name, examples in zip(("train", "held-out"), splits(cfg)):
        rows = Rows.of(examples, tok, cfg.model.seq_len, cfg.data.pack, cfg.seed)
        if rows.num_rows < cfg.train.batch_size:
            raise ConfigError(
                f"the {name} examples ({len(examples)}, {examples[0].where.rsplit(':', 1)[0]}) make "
                f"{rows.num_rows} rows of model.seq_len={cfg.model.seq_len}, fewer than "
                f"train.batch_size={cfg.train.batch_size}: add examples or lower train.batch_size"
            )
        out.append(Loader(RowSource(rows), cfg.train.batch_size, cfg.seed))
    return out[0], out[1]


def metadata(cfg: Config) -> dict:
    """What every manifest of a jsonl run records of its data: the files' content hash (a
    resume on changed files is refused, recipes/run/train.py) and the tokenizer's."""
    from mpmd.recipes.data import tokenizer

    digest = hashlib.sha256()
    for path in (cfg.data.path, cfg.data.eval_path):
        if path is not None:
            digest.update(Path(path).read_bytes())
    out = {"corpus_hash": digest.hexdigest()[:12]}
    if cfg.data.tokenizer != tokenizer.BYTES:
        out["tokenizer_hash"] = tokenizer.load(cfg.data.tokenizer).hash
    return out
