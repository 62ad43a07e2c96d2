"""A tokenized corpus on disk: what `mpmd tokenize` writes and `data.source: tokens` reads.

The format (a directory), memory-mapped so that a corpus of 10^8 tokens starts in
milliseconds and is never read into memory whole:

    index.json            {"format": "mpmd-tokens", "version": 1, "dtype": "uint8"|"uint16"|"uint32",
                           "tokenizer": {"spec", "hash", "vocab_size", "eos_id", "file"},
                           "num_documents", "num_tokens",
                           "shards": [{"tokens", "offsets", "num_documents", "num_tokens", "sha256"}],
                           "hash": 12 hex digits of sha256 over the rest of the index}
    tokenizer-HASH.json   the tokenizer's own file (none for bytes); its name is the index's
                          tokenizer.file (a corpus written before that key: tokenizer.json)
    shard-00000-DIGEST.tokens   the shard's tokens, little-endian `dtype`, documents back to back,
                          each followed by the tokenizer's end-of-text token when it has one
                          (DIGEST: 12 hex digits of the shard's sha256)
    shard-00000-DIGEST.offsets  little-endian int64 [num_documents + 1]: document j of the
                          shard is tokens[offsets[j]:offsets[j + 1]]

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
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from mpmd.recipes.data import tokenizer as tokenizer_lib
from mpmd.recipes.config.loading import read_text
from mpmd.recipes.config.schema import ConfigError
from mpmd.recipes.files import PARTIAL, publish

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
    its index. A shard is closed once it holds shard_tokens tokens (documents are not cut).

    A corpus already at out_dir stays whole until the new one is: every file is written
    under a new name (its digest in it), index.json is replaced last in one rename (the
    commit), and only then are the old corpus's files removed. A write that fails on bad
    input removes what it wrote; one killed midway leaves `*.partial` files, which the next
    write to the directory removes."""
    if not files:
        raise ConfigError("no files to tokenize")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"-o {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    shards, writer = [], None
    pending: list[str] = []
    written: list[Path] = []  # published under their final names, not yet in an index

    def flush():
        nonlocal writer
        for ids in tok.encode_batch(pending):
            if writer is None:
                writer = _ShardWriter(out, len(shards), dtype)
            writer.add(np.concatenate([ids, np.asarray(eos, np.int32)]) if eos else ids)
            if writer.num_tokens >= shard_tokens:
                shards.append(writer.close(written))
                writer = None
        pending.clear()

    try:
        for text in documents(files, text_key):
            pending.append(text)
            if len(pending) == _DOCS_PER_BATCH:
                flush()
        flush()
        if writer is not None:
            shards.append(writer.close(written))
            writer = None
        described = {"spec": tok.spec, "hash": tok.hash, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}
        text = tok.to_json()
        if text is not None:
            described["file"] = f"tokenizer-{tok.hash}.json"
            written.append(publish(out / described["file"], text.encode("utf-8")))
        index = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "tokenizer": described,
            "num_documents": sum(s["num_documents"] for s in shards),
            "num_tokens": sum(s["num_tokens"] for s in shards),
            "shards": shards,
        }
        index["hash"] = _index_hash(index)
        publish(out / INDEX, json.dumps(index, indent=1).encode())  # the commit
    except BaseException:
        if writer is not None:
            writer.abandon()
        keep = _referenced(out)  # the corpus that was there (none if there was none)
        for path in written:
            if path.name not in keep:
                path.unlink(missing_ok=True)
        raise
    _remove_unreferenced(out, _referenced(out))
    return index


def _referenced(out: Path) -> set[str]:
    """The file names the directory's index.json refers to (empty without a readable one)."""
    try:
        index = json.loads((out / INDEX).read_text())
        described = index["tokenizer"]
        names = {INDEX}
        if described["hash"] != tokenizer_lib.BYTES:  # a corpus older than the "file" key has tokenizer.json
            names.add(described.get("file", tokenizer_lib.TOKENIZER_FILE))
        for shard in index["shards"]:
            names.update((shard["tokens"], shard["offsets"]))
        return names
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def _remove_unreferenced(out: Path, keep: set[str]) -> None:
    """Removes what a corpus writer left in out that the index does not name: an older
    corpus's shards and tokenizer, and partial files of a write that was killed."""
    for path in out.iterdir():
        name = path.name
        shard = name.startswith("shard-") and name.endswith((".tokens", ".offsets", ".tokens" + PARTIAL))
        tokenizer = name.startswith("tokenizer") and name.endswith((".json", ".json" + PARTIAL))
        ours = shard or tokenizer or name == INDEX + PARTIAL
        if ours and name not in keep and path.is_file():
            path.unlink(missing_ok=True)


class _ShardWriter:
    """One shard, written to partial files and renamed to names carrying its digest when
    closed: a name that no older corpus in the directory uses unless it holds the same bytes."""

    def __init__(self, out: Path, number: int, dtype: np.dtype):
        self.stem = f"shard-{number:05d}"
        self.partial = out / f"{self.stem}.tokens{PARTIAL}"
        self.file = open(self.partial, "wb")
        self.out, self.dtype, self.offsets, self.num_tokens = out, dtype, [0], 0
        self.sha = hashlib.sha256()

    def add(self, ids: np.ndarray) -> None:
        raw = ids.astype(self.dtype).tobytes()
        self.file.write(raw)
        self.sha.update(raw)
        self.num_tokens += len(ids)
        self.offsets.append(self.num_tokens)

    def close(self, written: list[Path]) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        offsets = np.asarray(self.offsets, "<i8").tobytes()
        self.sha.update(offsets)
        digest = self.sha.hexdigest()
        names = f"{self.stem}-{digest[:12]}.tokens", f"{self.stem}-{digest[:12]}.offsets"
        os.replace(self.partial, self.out / names[0])
        written.append(self.out / names[0])
        written.append(publish(self.out / names[1], offsets))
        return {
            "tokens": names[0],
            "offsets": names[1],
            "num_documents": len(self.offsets) - 1,
            "num_tokens": self.num_tokens,
            "sha256": digest,
        }

    def abandon(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


_HASH_BLOCK = 16 << 20


def _check_counts(index: dict, index_file: Path) -> None:
    """The index's shapes and totals agree with each other (ConfigError naming what does not)."""
    try:
        shards = index["shards"]
        counts = [(int(s["num_tokens"]), int(s["num_documents"])) for s in shards]
        fine = all(isinstance(s["tokens"], str) and isinstance(s["offsets"], str) for s in shards)
        fine = fine and all(t >= 0 and d >= 0 for t, d in counts)
        np.dtype(index["dtype"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            f"{index_file}: not an index `mpmd tokenize` writes (a field is missing or mistyped)"
        ) from None
    for file in (n for s in shards for n in (s["tokens"], s["offsets"])):
        if Path(file).name != file or file.startswith("."):
            fine = False
    if not fine:
        raise ConfigError(f"{index_file}: shard entries must name files in the corpus and count from 0 up")
    if sum(t for t, _ in counts) != index.get("num_tokens") or sum(d for _, d in counts) != index.get("num_documents"):
        raise ConfigError(f"{index_file}: num_tokens or num_documents is not the sum of its shards'")


def _index_hash(index: dict) -> str:
    rest = {k: v for k, v in index.items() if k != "hash"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:12]


class Corpus:
    """A corpus directory opened for reading: its index checked, every shard's bytes against
    the digest the index recorded and its offsets against its tokens (`verify`, one read of
    the corpus at ~1 GB/s a core; see docs/benchmarks.md), then memory-mapped."""

    def __init__(self, path: str | Path | None, verify: bool = True):
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
        _check_counts(index, index_file)
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
        if verify:
            self.verify()
        # Where each shard's tokens start in the concatenation of all of them.
        self.starts = np.cumsum([0] + [s["num_tokens"] for s in index["shards"]])
        self._maps: dict[int, np.ndarray] = {}

    def verify(self) -> None:
        """Each shard's sha256 recomputed and compared with the index's, its offsets checked
        to start at 0, never decrease and end at its token count: ConfigError naming the
        first file that disagrees. Shards are hashed on threads (hashlib lets go of the GIL)."""
        from concurrent.futures import ThreadPoolExecutor

        shards = self.index["shards"]
        with ThreadPoolExecutor(min(len(shards), os.cpu_count() or 1) or 1) as pool:
            read = list(pool.map(self._digest, shards))
        for shard, (digest, _) in zip(shards, read):
            if digest != shard["sha256"]:
                raise ConfigError(
                    f"{self.path / shard['tokens']}: its bytes (or its offsets') do not match the sha256 "
                    f"{self.path / INDEX} recorded: the file changed after `mpmd tokenize` wrote it; "
                    "tokenize the corpus again"
                )
        for shard, (_, raw) in zip(shards, read):
            offsets = np.frombuffer(raw, "<i8")
            if offsets[0] != 0 or offsets[-1] != shard["num_tokens"] or np.any(np.diff(offsets) < 0):
                raise ConfigError(
                    f"{self.path / shard['offsets']}: document offsets must start at 0, never decrease and end "
                    f"at the shard's {shard['num_tokens']} tokens; tokenize the corpus again"
                )

    def _digest(self, shard: dict) -> tuple[str, bytes]:
        """(sha256 of the shard's tokens and offsets, the offsets' bytes): one read of each."""
        sha = hashlib.sha256()
        with open(self.path / shard["tokens"], "rb") as f:
            while block := f.read(_HASH_BLOCK):
                sha.update(block)
        offsets = (self.path / shard["offsets"]).read_bytes()
        sha.update(offsets)
        return sha.hexdigest(), offsets

    def tokenizer(self) -> tokenizer_lib.Tokenizer:
        """The tokenizer the corpus was written with (its copy here), checked by hash."""
        want = self.index["tokenizer"]["hash"]
        if want == tokenizer_lib.BYTES:
            return tokenizer_lib.ByteTokenizer()
        file = self.path / self.index["tokenizer"].get("file", tokenizer_lib.TOKENIZER_FILE)
        tok = tokenizer_lib.load(str(file))
        if tok.hash != want:
            raise ConfigError(
                f"{file} has hash {tok.hash}, but the corpus was tokenized with {want}: tokenize it again"
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
