"""Training data with no download: bytes of local text files, or seeded synthetic batches.

Every source answers `batch(seed, index, batch_size)` as a pure function of its arguments, so a
`Loader` is only a cursor (`position` = batches served). Its `state()` is saved with every
checkpoint; a resumed or recovered run seeks its loader (built from the same config, so the
same seed and batch size) to the saved position, and so sees exactly the batches an
uninterrupted one would have seen. `Loader.from_state(source, state)` rebuilds a loader from
a saved state alone.

Byte-level LM data: token = byte (0..255). The corpus is cut into non-overlapping windows of
seq_len + 1 bytes (the +1 is the last target), so one epoch shows every byte as a target once.
"""

import glob
import os
import sysconfig
from pathlib import Path
from typing import Protocol

import numpy as np

from mpmd.recipes.config import Config, ConfigError

# Directory names under the stdlib that are not "the standard library's own code".
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
# Fixes the synthetic regression task (the map y = f(x)) independently of the run's seed,
# so train and eval, and runs with different seeds, fit the same function.
_TASK_SEED = 20240601
_TRAIN, _EVAL = 0, 1  # stream ids that keep synthetic train and eval batches independent


class Source(Protocol):
    num_examples: int | None  # None = unbounded (synthetic)

    def batch(self, seed: int, index: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]: ...


def stdlib_files() -> list[Path]:
    """This Python's standard library's own .py files, in a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _STDLIB_SKIP]  # prune, not filter
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ConfigError(
            f"data.source='stdlib' found no .py files under {root}; use data.source='files' with data.paths"
        )
    return files


def listed_files(paths: list[str]) -> list[Path]:
    """The files data.paths names (paths, directories, globs), in order, each once."""
    files, seen, missing = [], set(), []
    for entry in paths:
        if glob.has_magic(entry):
            found = [Path(p) for p in sorted(glob.glob(entry, recursive=True))]
            found = [p for p in found if p.is_file()]
        elif Path(entry).is_dir():
            found = sorted(p for p in Path(entry).rglob("*") if p.is_file())
        else:
            found = [Path(entry)] if Path(entry).is_file() else []
        if not found:
            missing.append(entry)
        files += [p for p in found if not (p in seen or seen.add(p))]
    if missing:
        raise ConfigError("data.paths: no file found for " + ", ".join(map(repr, missing)))
    return files


class Shuffled:
    """num_examples examples served in batches: epoch e visits them in permutation(seed, e),
    the last partial batch dropped. A source of fixed examples (windows, SFT rows) is one."""

    def __init__(self, num_examples: int):
        self.num_examples = num_examples
        self._perm_key, self._perm = None, None

    def epoch_ids(self, seed: int, index: int, batch_size: int) -> np.ndarray:
        """The example ids of batch `index`."""
        batches_per_epoch = self.num_examples // batch_size
        assert batches_per_epoch > 0, (self.num_examples, batch_size)
        epoch, j = divmod(index, batches_per_epoch)
        if self._perm_key != (seed, epoch):  # one epoch's order cached: ~1 MB for 8 MB of text
            self._perm = np.random.default_rng([seed, epoch]).permutation(self.num_examples)
            self._perm_key = (seed, epoch)
        return self._perm[j * batch_size : (j + 1) * batch_size]


class ByteSplit(Shuffled):
    """A contiguous run of bytes served as windows [k*T, (k+1)*T] (T + 1 bytes each)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        assert tokens.dtype.kind in "ui" and seq_len >= 1  # bytes, or a tokenizer's int32 ids
        super().__init__(max(0, (len(tokens) - 1) // seq_len))
        self.tokens, self.seq_len = tokens, seq_len

    def windows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Window ids [B] -> inputs [B, T] int32, targets [B, T] int32 (inputs shifted by 1)."""
        offsets = np.asarray(ids, dtype=np.int64)[:, None] * self.seq_len
        chunk = self.tokens[offsets + np.arange(self.seq_len + 1)].astype(np.int32)
        return chunk[:, :-1], chunk[:, 1:]

    def batch(self, seed: int, index: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        return self.windows(self.epoch_ids(seed, index, batch_size))


class ByteCorpus:
    """Files concatenated in order, capped at max_bytes; the last eval_fraction is eval. With
    a tokenizer (recipes/data/tokenizer.py, not bytes) each file's text is its tokens, followed by
    the end-of-text token where the tokenizer has one."""

    def __init__(self, files: list[Path], seq_len: int, eval_fraction: float, max_bytes: int = 8_000_000, tok=None):
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        chunks, total = [], 0
        for path in files:
            if total >= max_bytes:
                break
            try:
                with open(path, "rb") as f:
                    data = f.read(max_bytes - total)
            except OSError as e:  # a device, a FIFO, a file we may not read, ...
                raise ConfigError(f"data.paths: cannot read {path}: {e.strerror or e}") from None
            chunks.append(data)
            total += len(data)
        self.files = list(files)
        if tok is None:
            self.tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        else:
            eos = [np.asarray([tok.eos_id], np.int32)] if tok.eos_id is not None else []
            texts = [chunk.decode("utf-8", errors="replace") for chunk in chunks]
            self.tokens = np.concatenate(
                [part for ids in tok.encode_batch(texts) for part in [ids, *eos]] or [np.zeros(0, np.int32)]
            )
        split = int(len(self.tokens) * (1 - eval_fraction))
        self.train = ByteSplit(self.tokens[:split], seq_len)
        self.eval = ByteSplit(self.tokens[split:], seq_len)
        for name, part in (("train", self.train), ("eval", self.eval)):
            if part.num_examples == 0:
                raise ConfigError(
                    f"the {name} split has {len(part.tokens)} bytes, fewer than one window of "
                    f"seq_len + 1 = {seq_len + 1}: add files or raise data.eval_fraction"
                )


class SyntheticTokens:
    """Uniform random tokens: for tests and throughput runs, not for learning anything."""

    num_examples = None

    def __init__(self, vocab_size: int, seq_len: int, stream: int = _TRAIN):
        self.vocab_size, self.seq_len, self.stream = vocab_size, seq_len, stream

    def batch(self, seed: int, index: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([seed, self.stream, index])
        chunk = rng.integers(0, self.vocab_size, (batch_size, self.seq_len + 1), dtype=np.int32)
        return chunk[:, :-1], chunk[:, 1:]


class SyntheticRegression:
    """x ~ N(0, 1) [B, in]; y = x A + sin(x V) [B, out], A and V fixed, scaled by 1/sqrt(in)."""

    num_examples = None

    def __init__(self, in_features: int, out_features: int, stream: int = _TRAIN):
        task = np.random.default_rng(_TASK_SEED)
        scale = 1 / np.sqrt(in_features)  # keeps x A at unit variance whatever in_features is
        self.linear = task.standard_normal((in_features, out_features)) * scale
        self.phase = task.standard_normal((in_features, out_features)) * scale
        self.in_features, self.stream = in_features, stream

    def batch(self, seed: int, index: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([seed, self.stream, index])
        x = rng.standard_normal((batch_size, self.in_features))
        y = x @ self.linear + np.sin(x @ self.phase)
        return x.astype(np.float32), y.astype(np.float32)


class Loader:
    """A resumable cursor over a source: batch i is source.batch(seed, i, batch_size)."""

    def __init__(self, source: Source, batch_size: int, seed: int, position: int = 0):
        if batch_size <= 0 or position < 0:
            raise ValueError(f"batch_size must be > 0 and position >= 0, got {batch_size} and {position}")
        if source.num_examples is not None and source.num_examples < batch_size:
            raise ConfigError(
                f"the data split has {source.num_examples} windows, fewer than "
                f"batch_size={batch_size}: add data, lower train.batch_size or "
                f"raise data.eval_fraction"
            )
        self.source, self.batch_size, self.seed, self.position = source, batch_size, seed, position

    def batch_at(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The index-th batch, without moving the cursor (eval reads batches 0..n-1 each time)."""
        return self.source.batch(self.seed, index, self.batch_size)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def seek(self, position: int) -> None:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self.position = position

    def state(self) -> dict:
        return {"position": self.position, "seed": self.seed, "batch_size": self.batch_size}

    def restore(self, state: dict | None) -> None:
        """Where a checkpoint's data_state says the loader stood (the start when None)."""
        self.seek(state["position"] if state else 0)

    @classmethod
    def from_state(cls, source: Source, state: dict) -> "Loader":
        return cls(source, state["batch_size"], state["seed"], position=state["position"])


def synthetic_token_sources(vocab_size: int, seq_len: int) -> tuple[Source, Source]:
    """(train, eval) uniform random token windows of seq_len."""
    return SyntheticTokens(vocab_size, seq_len, _TRAIN), SyntheticTokens(vocab_size, seq_len, _EVAL)


def regression_sources(in_features: int, out_features: int) -> tuple[Source, Source]:
    """(train, eval) of the synthetic regression task from in_features to out_features."""
    return SyntheticRegression(in_features, out_features, _TRAIN), SyntheticRegression(in_features, out_features, _EVAL)


def loaders_of(cfg: Config, train: Source, eval_: Source) -> tuple["Loader", "Loader"]:
    """(train, eval) loaders over two sources at train.batch_size, seeded by the run's seed."""
    return Loader(train, cfg.train.batch_size, cfg.seed), Loader(eval_, cfg.train.batch_size, cfg.seed)


def make_loaders(cfg: Config) -> tuple[Loader, Loader]:
    """(train, eval) loaders at position 0 of data.source (its spec, recipes/data/sources.py),
    of the kind model.kind's family reads; eval reads its first train.eval_batches batches."""
    from mpmd.recipes import registry

    return registry.get_data_source(cfg.data.source).loaders(cfg, registry.data_kind(cfg))


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of text as int32 tokens [len]."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Byte tokens -> text; invalid UTF-8 and tokens outside 0..255 become U+FFFD."""
    values = np.asarray(tokens).reshape(-1).astype(np.int64)
    # 0xFF never occurs in UTF-8, so out-of-range tokens decode to the replacement character.
    values = np.where((values >= 0) & (values < 256), values, 0xFF)
    return values.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
