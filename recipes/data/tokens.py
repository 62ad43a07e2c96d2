"""A tokenized corpus on disk: what `mpmd tokenize` writes and `data.source: tokens` reads.

The format (a directory), memory-mapped so that a corpus of 10^8 tokens starts in
milliseconds and is never read into memory whole:

    index.json            {"format": "mpmd-tokens", "version": 1, "dtype": "uint8"|"uint16"|"uint32",
                           "tokenizer": {"spec", "hash", "vocab_size", "eos_id"},
                           "num_documents", "num_tokens",
                           "shards": [{"tokens", "offsets", "num_documents", "num_tokens", "sha256"}],
                           "hash": 12 hex digits of sha256 over the rest of the index}
    tokenizer.json        the tokenizer's own file (none for bytes)
    shard-00000.tokens    the shard's tokens, little-endian `dtype`, documents back to back, each
                          followed by the tokenizer's end-of-text token when it has one
    shard-00000.offsets   little-endian int64 [num_documents + 1]: document j of the shard is
                          tokens[offsets[j]:offsets[j + 1]]

A document is a file, or a line of a .jsonl file (its `text` field). The index's hash covers
each shard's sha256 (taken as it was written), so a corpus tokenized again from other files or
with another tokenizer has another hash; a run records it in every checkpoint and refuses to
resume on another corpus. `Corpus.tokens(start, stop)` reads any range of the documents'
concatenation (across shards); recipes/data/grain.py serves windows and documents of it to
Grain as random-access data sources.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from mpmd.recipes.data import tokenizer as tokenizer_lib
from mpmd.recipes.config.loading import read_text
from mpmd.recipes.config.schema import ConfigError

INDEX = "index.json"
FORMAT, VERSION = "mpmd-tokens", 1
SHARD_TOKENS = 100_000_000  # a shard's size: ~200 MB of uint16, written and hashed in one go
_DOCS_PER_BATCH = 256  # documents encoded per call of the tokenizer's threads


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned integer every token id fits in."""
    return np.dtype(next(t for t in ("<u1", "<u2", "<u4") if vocab_size <= np.iinfo(t).max + 1))


def documents(files: Iterable[str | Path], text_key: str = "text") -> Iterator[str]:
    """Each file's text as one document, or for a .jsonl file each line's `text_key` field."""
    for file in files:
        path = Path(file)
        text = read_text(path, "text file")
        if path.suffix != ".jsonl":
            yield text
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                yield record[text_key]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    f"{path}:{number}: a .jsonl line must be a JSON object with a string {text_key!r} field"
                ) from None


def write(
    files: list[str | Path],
    out_dir: str | Path,
    tok: tokenizer_lib.Tokenizer,
    shard_tokens: int = SHARD_TOKENS,
    text_key: str = "text",
) -> dict:
    """Tokenizes the files' documents into a corpus at out_dir (the format above); returns
    its index. A shard is closed once it holds shard_tokens tokens (documents are not cut)."""
    if not files:
        raise ConfigError("no files to tokenize")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / INDEX).exists():
        (out / INDEX).unlink()  # a half-written corpus has no index: nothing reads it
    dtype = token_dtype(tok.vocab_size)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    shards, writer = [], None
    pending: list[str] = []

    def flush():
        nonlocal writer
        for ids in tok.encode_batch(pending):
            if writer is None:
                writer = _ShardWriter(out, len(shards), dtype)
            writer.add(np.concatenate([ids, np.asarray(eos, np.int32)]) if eos else ids)
            if writer.num_tokens >= shard_tokens:
                shards.append(writer.close())
                writer = None
        pending.clear()

    for text in documents(files, text_key):
        pending.append(text)
        if len(pending) == _DOCS_PER_BATCH:
            flush()
    flush()
    if writer is not None:
        shards.append(writer.close())
    text = tok.to_json()
    if text is not None:
        (out / tokenizer_lib.TOKENIZER_FILE).write_text(text, encoding="utf-8")
    index = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "tokenizer": {"spec": tok.spec, "hash": tok.hash, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
    }
    index["hash"] = _index_hash(index)
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(out / INDEX)  # the index last: a corpus is whole once it has one
    return index


class _ShardWriter:
    def __init__(self, out: Path, number: int, dtype: np.dtype):
        self.names = f"shard-{number:05d}.tokens", f"shard-{number:05d}.offsets"
        self.file = open(out / self.names[0], "wb")
        self.out, self.dtype, self.offsets, self.num_tokens = out, dtype, [0], 0
        self.sha = hashlib.sha256()

    def add(self, ids: np.ndarray) -> None:
        raw = ids.astype(self.dtype).tobytes()
        self.file.write(raw)
        self.sha.update(raw)
        self.num_tokens += len(ids)
        self.offsets.append(self.num_tokens)

    def close(self) -> dict:
        self.file.close()
        offsets = np.asarray(self.offsets, "<i8").tobytes()
        (self.out / self.names[1]).write_bytes(offsets)
        self.sha.update(offsets)
        return {
            "tokens": self.names[0],
            "offsets": self.names[1],
            "num_documents": len(self.offsets) - 1,
            "num_tokens": self.num_tokens,
            "sha256": self.sha.hexdigest(),
        }


def _index_hash(index: dict) -> str:
    rest = {k: v for k, v in index.items() if k != "hash"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:12]


class Corpus:
    """A corpus directory opened for reading: its index checked, its shards memory-mapped
    (nothing is read until asked for)."""

    def __init__(self, path: str | Path | None):
        if path is None:
            raise ConfigError("data.source='tokens' needs data.path: the directory `mpmd tokenize` wrote")
        self.path = Path(path)
        index_file = self.path / INDEX
        if not index_file.is_file():
            what = "does not exist" if not self.path.exists() else f"has no {INDEX}"
            raise ConfigError(
                f"data.path={str(path)!r} {what}: give the directory `mpmd tokenize FILES... -o DIR` wrote"
            )
        try:
            index = json.loads(index_file.read_text())
        except ValueError as e:
            raise ConfigError(f"{index_file} is not valid JSON: {e}") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ConfigError(f"{index_file} is not an {FORMAT} index of version {VERSION}")
        if index.get("hash") != _index_hash(index):
            raise ConfigError(f"{index_file} was changed after `mpmd tokenize` wrote it (its hash does not match)")
        self.index, self.hash = index, index["hash"]
        self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self.num_tokens, self.num_documents = index["num_tokens"], index["num_documents"]
        for shard in index["shards"]:
            for key, size in (
                ("tokens", shard["num_tokens"] * self.dtype.itemsize),
                ("offsets", (shard["num_documents"] + 1) * 8),
            ):
                file = self.path / shard[key]
                if not file.is_file() or file.stat().st_size != size:
                    raise ConfigError(
                        f"{file}: missing or not {size} bytes as {index_file} says; tokenize the corpus again"
                    )
        # Where each shard's tokens start in the concatenation of all of them.
        self.starts = np.cumsum([0] + [s["num_tokens"] for s in index["shards"]])
        self._maps: dict[int, np.ndarray] = {}

    def tokenizer(self) -> tokenizer_lib.Tokenizer:
        """The tokenizer the corpus was written with (its copy here), checked by hash."""
        want = self.index["tokenizer"]["hash"]
        if want == tokenizer_lib.BYTES:
            return tokenizer_lib.ByteTokenizer()
        tok = tokenizer_lib.load(str(self.path / tokenizer_lib.TOKENIZER_FILE))
        if tok.hash != want:
            raise ConfigError(
                f"{self.path / tokenizer_lib.TOKENIZER_FILE} has hash {tok.hash}, but the corpus "
                f"was tokenized with {want}: tokenize it again"
            )
        return tok

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            shard = self.index["shards"][k]
            self._maps[k] = (
                np.memmap(self.path / shard["tokens"], self.dtype, "r")
                if shard["num_tokens"]
                else np.zeros(0, self.dtype)
            )
        return self._maps[k]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the documents' concatenation, int32."""
        assert 0 <= start <= stop <= self.num_tokens, (start, stop, self.num_tokens)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            local = start - self.starts[first]
            end = min(stop, self.starts[first + 1])
            parts.append(self._shard(first)[local : end - self.starts[first]])
            start, first = end, first + 1
        return np.concatenate(parts or [np.zeros(0, self.dtype)]).astype(np.int32)

    def document_bounds(self) -> np.ndarray:
        """int64 [num_documents + 1]: document j is tokens(bounds[j], bounds[j + 1]) (8 bytes a
        document are read, none of the tokens)."""
        parts = [np.zeros(1, np.int64)]
        for k, shard in enumerate(self.index["shards"]):
            offsets = np.fromfile(self.path / shard["offsets"], "<i8")
            parts.append(offsets[1:] + self.starts[k])
        return np.concatenate(parts)
