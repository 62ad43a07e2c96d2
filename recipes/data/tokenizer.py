"""Tokenizers: text <-> int32 tokens, by one interface whatever the kind.

    tok = tokenizer.load("bytes")                      # one token per UTF-8 byte (the default)
    tok = tokenizer.load("runs/tok")                   # a Hugging Face tokenizer.json, or its directory
    tok.encode("def f():")  -> np.ndarray int32 [n];   tok.decode(tokens) -> str
    tok.vocab_size, tok.eos_id (None for bytes), tok.hash (12 hex digits of its content)

`data.tokenizer` names one (recipes/config/schema.py); `model.vocab_size` follows it
(`resolve_vocab_size`: the tokenizer's size rounded up to a multiple of 128 x the mesh's tensor
ways, as Megatron-LM pads, so the embedding's rows split evenly). A run copies its tokenizer into
the run directory (`save_to_run`) and `run_tokenizer(run_dir)` loads it back, checked against the
hash the run recorded: what `mpmd generate RUN_DIR` decodes with. `train_bpe` makes a byte-level
BPE tokenizer from the user's files, offline (`mpmd tokenizer train`).

Imports no JAX: the config loader resolves the vocabulary before JAX starts.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterable

import numpy as np

from mpmd.recipes.config.schema import ConfigError
from mpmd.recipes.files import publish

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"  # the Hugging Face `tokenizers` serialisation
RUN_FILE = "tokenizer.json"  # the copy in a run directory (none for bytes)
# The end-of-text token `train_bpe` adds, and the names other tokenizers give theirs, in the
# order they are looked for when no tokenizer_config.json says which.
EOS_TOKEN = "<|endoftext|>"
_EOS_NAMES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by, times the tensor ways


class ByteTokenizer:
    """One token per UTF-8 byte, 0..255: the byte corpus's own coding (recipes/data/loaders.py's
    encode / decode, so a bytes run is bitwise what it was before tokenizers existed)."""

    spec, vocab_size, eos_id, hash = BYTES, 256, None, BYTES
    chat_template = None  # bytes have no chat template: chats render as recipes/data/sft.py does

    def encode(self, text: str) -> np.ndarray:
        from mpmd.recipes.data import loaders as data

        return data.encode(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_prompt(self, text: str) -> np.ndarray:
        """A prompt's tokens: bytes have no special tokens."""
        return self.encode(text)

    def decode(self, tokens) -> str:
        from mpmd.recipes.data import loaders as data

        return data.decode(tokens)

    def to_json(self) -> str | None:
        return None


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` read from a tokenizer.json. Tokens the model may
    emit beyond the tokenizer's vocabulary (the padded rows) decode to U+FFFD."""

    def __init__(self, path: Path, text: str, eos_id: int | None):
        import tokenizers

        try:
            self._tok = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # the Rust parser's error: not a tokenizer.json
            raise ConfigError(f"{path} is not a Hugging Face tokenizer.json: {e}") from None
        self.spec = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id
        self.hash = content_hash(text)
        self._text = text
        self._path = path
        self._chat = None  # the compiled chat template (False: none), read when first asked

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, each token's character span in `text`), no special tokens added (those in the
        text, such as a chat template's <|im_start|>, are kept whole)."""
        e = self._tok.encode(text, add_special_tokens=False)
        return list(e.ids), [tuple(o) for o in e.offsets]

    @property
    def chat_template(self):
        """tokenizer_config.json's chat template beside the file, compiled (recipes/data/chat.py
        Template), or None where it has none."""
        if self._chat is None:
            text = _config_token(self._path, "chat_template")
            if isinstance(text, list):  # [{"name", "template"}]: the default one
                text = next(
                    (t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None
                )
            if isinstance(text, str):
                from mpmd.recipes.data import chat

                bos, eos = _config_token(self._path, "bos_token"), _config_token(self._path, "eos_token")
                self._chat = chat.Template(text, bos, eos)
            else:
                self._chat = False
        return self._chat or None

    def encode_prompt(self, text: str) -> np.ndarray:
        """A prompt's tokens as transformers' tokenizer of the same directory makes them: with
        the special tokens its tokenizer.json's post-processor adds (Llama 3's
        <|begin_of_text|>, Gemma's <bos>). Training text is `encode`d without them."""
        return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Many texts at once, over the library's threads."""
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens) -> str:
        ids = np.asarray(tokens).reshape(-1).astype(np.int64)
        out, run = [], []
        for i in ids:  # runs of known ids decode together (merged bytes stay merged)
            if 0 <= i < self.vocab_size:
                run.append(int(i))
                continue
            out.append(self._tok.decode(run, skip_special_tokens=False))
            out.append("\ufffd")
            run = []
        out.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(out)

    def to_json(self) -> str:
        return self._text


Tokenizer = ByteTokenizer | HFTokenizer


def content_hash(text: str) -> str:
    """12 hex digits of sha256 over a tokenizer.json's text: equal hashes, equal tokens."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def load(spec: str) -> Tokenizer:
    """'bytes', or a path to a tokenizer.json or to a directory holding one (a Hugging Face
    tokenizer directory; its tokenizer_config.json's eos_token, where given, names the
    end-of-text token). ConfigError naming the path and what is allowed otherwise."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        what = f"the directory {path} holds no {TOKENIZER_FILE}" if path.is_dir() else f"{path} does not exist"
        raise ConfigError(
            f"tokenizer {spec!r}: {what}; give 'bytes', a {TOKENIZER_FILE} or a directory "
            f"holding one (make one with `mpmd tokenizer train FILES... --vocab-size N -o DIR`)"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"tokenizer {spec!r}: cannot read {file}: {e}") from None
    return HFTokenizer(file, text, _eos_id(file, text))


def _added(text: str) -> dict[str, int]:
    try:
        return {t["content"]: t["id"] for t in json.loads(text).get("added_tokens", [])}
    except (ValueError, AttributeError, TypeError, KeyError):
        return {}


def _config_token(file: Path, key: str):
    """tokenizer_config.json's `key` beside the file (a token's content for *_token keys), or None."""
    config = file.with_name("tokenizer_config.json")
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value.get("content") if isinstance(value, dict) else value


def _eos_id(file: Path, text: str) -> int | None:
    """The end-of-text token's id: tokenizer_config.json's eos_token beside the file, else the
    first added token with one of the usual names; None when there is none."""
    added = _added(text)
    eos = _config_token(file, "eos_token")
    if eos in added:
        return added[eos]
    return next((added[name] for name in _EOS_NAMES if name in added), None)


# -- the model's vocabulary ------------------------------------------------------------------
def vocab_multiple(tensor_ways: Iterable[int]) -> int:
    """What model.vocab_size is rounded up to: 128 x the least common multiple of every slice's
    tensor ways (the vocab axis is laid out on `tensor`, mpmd.stages.sharding.RULES)."""
    return VOCAB_MULTIPLE * math.lcm(1, *tensor_ways)


def padded(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def vocab_problem(tok: Tokenizer, model_vocab_size: int) -> str | None:
    """The sentence refusing a model.vocab_size too small for the tokenizer's tokens."""
    if model_vocab_size >= tok.vocab_size:
        return None
    return (
        f"model.vocab_size={model_vocab_size} is smaller than the tokenizer {tok.spec!r}'s "
        f"{tok.vocab_size} tokens: set model.vocab_size >= {tok.vocab_size}, or leave it out "
        f"and it follows the tokenizer"
    )


def vocab_note(tok: Tokenizer, model_vocab_size: int) -> str:
    """The one console line saying where model.vocab_size came from."""
    pad = model_vocab_size - tok.vocab_size
    return f"model.vocab_size={model_vocab_size}: the tokenizer {tok.spec!r} has {tok.vocab_size} tokens" + (
        f", padded by {pad} to a multiple the mesh splits" if pad else ""
    )


# -- a run's tokenizer -----------------------------------------------------------------------
def save_to_run(tok: Tokenizer, run_dir: str | Path) -> Path | None:
    """Copies the tokenizer into the run directory (<run_dir>/tokenizer.json; nothing for
    bytes), so the run can be decoded without the file it was trained with."""
    text = tok.to_json()
    if text is None:
        return None
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def run_tokenizer(run_dir: str | Path) -> Tokenizer:
    """The tokenizer a run trained with: its copy in the run directory, checked against the
    hash its run.json recorded; bytes for a run that recorded none (or bytes)."""
    from mpmd.report.record import read_run_info

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it has no config.yaml")
    recorded = read_run_info(run_dir).get("tokenizer") or {"hash": BYTES}
    if recorded["hash"] == BYTES:
        return ByteTokenizer()
    copy = run_dir / RUN_FILE
    if not copy.is_file():
        raise ConfigError(
            f"{run_dir} trained with the tokenizer {recorded.get('spec')!r} (hash "
            f"{recorded['hash']}) but holds no {RUN_FILE}"
        )
    tok = load(str(copy))
    if tok.hash != recorded["hash"]:
        raise ConfigError(
            f"{copy} has hash {tok.hash}, but the run trained with {recorded['hash']}: the file was changed"
        )
    return tok


# -- training one ----------------------------------------------------------------------------
def train_bpe(files: list[str | Path], vocab_size: int, out_dir: str | Path, min_frequency: int = 2) -> Path:
    """A byte-level BPE tokenizer (GPT-2's scheme: every byte is a token, so any text
    encodes) of vocab_size tokens, <|endoftext|> included, learnt from the files' text;
    written as <out_dir>/tokenizer.json. Nothing is downloaded."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError(
            f"--vocab-size {vocab_size}: a byte-level BPE needs at least "
            f"{len(alphabet) + 1} tokens (256 bytes and {EOS_TOKEN})"
        )
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing or not files:
        raise ConfigError(f"no such file: {', '.join(missing)}" if missing else "no files to train on")
    for file in files:  # every input read and checked before anything is written
        _check_utf8(Path(file))
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    try:
        tok.train([str(f) for f in files], trainer)
    except Exception as e:  # the Rust trainer's own error, one line
        raise ConfigError(f"training the tokenizer failed: {e}") from None
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"-o {out}: exists and is not a directory")
    # What save() writes; a tokenizer.json already there stays whole until the rename.
    return publish(out / TOKENIZER_FILE, tok.to_str(pretty=True))


def _check_utf8(file: Path, block: int = 1 << 24) -> None:
    """ConfigError naming the file and byte where it stops being UTF-8 (read in blocks)."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with open(file, "rb") as f:
            while True:
                data = f.read(block)
                decoder.decode(data, final=not data)
                if not data:
                    return
                offset += len(data)
    except UnicodeDecodeError as e:
        raise ConfigError(f"text file '{file}' is not UTF-8 text (byte {offset + e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError(f"cannot read text file '{file}': {e.strerror or e}") from None


# -- a config's tokenizer --------------------------------------------------------------------
def of_config(cfg) -> Tokenizer | None:
    """The tokenizer a config trains with: the one its data source fixes (a tokenized
    corpus's), else data.tokenizer. None only while the source cannot tell yet (a tokens
    source without data.path: a problem of the config's own)."""
    from mpmd.recipes import registry

    own = registry.get_data_source(cfg.data.source).tokenizer
    return load(cfg.data.tokenizer) if own is None else own(cfg)


def of_corpus(d) -> Tokenizer:
    """A tokenized corpus's tokenizer (data section `d`: data.path); a data.tokenizer given
    must be that one, by content."""
    from mpmd.recipes.data import tokens

    tok = tokens.Corpus(d.path, verify=False).tokenizer()  # the run's loaders verify the shards
    if "tokenizer" in d.model_fields_set and d.tokenizer != tok.spec and load(d.tokenizer).hash != tok.hash:
        raise ConfigError(
            f"data.tokenizer={d.tokenizer!r} is not the tokenizer the corpus data.path={d.path!r} "
            f"was tokenized with (hash {tok.hash}): leave data.tokenizer out, or tokenize again"
        )
    return tok


def resolve_vocab_size(cfg) -> None:
    """model.vocab_size follows the config's tokenizer when not given (the tokenizer's size
    padded to vocab_multiple of the slices' tensor ways); a given one too small is refused.
    The bytes tokenizer of a source that fixes none changes nothing (256 stays the default)."""
    from mpmd.recipes import registry

    d = cfg.data
    fixed = registry.get_data_source(d.source).tokenizer is not None
    if not hasattr(cfg.model, "vocab_size") or (d.tokenizer == BYTES and not fixed):
        return
    tok = of_config(cfg)
    if tok is None:
        return  # the problem is cross_field_problems' to name
    if "vocab_size" in cfg.model.model_fields_set:
        problem = vocab_problem(tok, cfg.model.vocab_size)
        if problem:
            raise ConfigError(problem)
        return
    cfg.model.vocab_size = padded(tok.vocab_size, vocab_multiple(s["tensor"] for s in cfg.slice_shapes()))
