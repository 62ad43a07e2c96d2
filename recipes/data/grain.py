"""`data.source: tokens`: a tokenized corpus (recipes/data/tokens.py) through a Grain pipeline.

    train, eval = grain_data.loaders(cfg)   # GrainLoader: .next(), .batch_at(i), .state(), .restore(state)

Without packing, examples are the corpus's non-overlapping windows of seq_len + 1 tokens (as the
byte corpus cuts its bytes: documents run on into each other), served as a Grain random-access
data source: `MapDataset.source(windows).shuffle(seed).repeat().batch(batch_size)`, so every epoch
is a fresh global permutation from `seed` (Grain's index shuffle: nothing is materialised, epoch
e uses seed + e) and a batch may hold windows of two epochs. With `data.pack`, examples are
documents (one cut into pieces of seq_len + 1 tokens where it is longer), shuffled the same
way and packed by Grain's `FirstFitPackIterDataset` into batch_size rows of seq_len: `inputs`,
`targets`, `segment_ids` (0 = padding), `positions` (restarting per document), and `loss_mask`
(1 where the target is a real token of the same document) that the token-weighted loss reads.

The last data.eval_fraction of the examples (the corpus's tail) is the eval split, read in
order. A loader's `state()` holds Grain's own iterator state (`DatasetIterator.get_state()`: a
dict of integers), saved in each checkpoint's manifest; `restore(state)` sets it on a fresh
iterator, so a resumed, recovered or relayouted run reads exactly the batches an uninterrupted
one would. Grain reads ahead 16 elements on 2 threads (_read_options). Its defaults, 16
threads and 500 elements, made every new iterator (a resume's, an evaluation's) read 500
batches at once on the controller's cores: 0.6-0.8 s of CPU each for gpt_tiny, taken from the
workers beside it (benchmarks/bench_data.py, part c).
The corpus and tokenizer a checkpoint was trained on are in its manifest's metadata
(`metadata`), and a run on another one is refused (recipes/run/train.py resume_metadata).
"""

from __future__ import annotations

import numpy as np

from mpmd.recipes.config import Config, ConfigError
from mpmd.recipes.data.tokens import Corpus


class Windows:
    """Grain RandomAccessDataSource: window i = tokens [(first + i) T, (first + i + 1) T] of
    the corpus, T + 1 int32 tokens."""

    def __init__(self, corpus: Corpus, seq_len: int, first: int, stop: int):
        self.corpus, self.seq_len, self.first, self.stop = corpus, seq_len, first, stop

    def __len__(self) -> int:
        return self.stop - self.first

    def __getitem__(self, i: int) -> np.ndarray:
        start = (self.first + int(i)) * self.seq_len
        return self.corpus.tokens(start, start + self.seq_len + 1)


class Pieces:
    """Grain RandomAccessDataSource: documents (of >= 2 tokens) cut into pieces of at most
    T + 1 tokens that share their boundary token, so every target is kept once; piece i as
    {"inputs": piece[:-1], "targets": piece[1:]} (int32, up to T each)."""

    def __init__(self, corpus: Corpus, seq_len: int, starts: np.ndarray, stops: np.ndarray):
        self.corpus, self.starts, self.stops = corpus, starts, stops

    @classmethod
    def of(cls, corpus: Corpus, seq_len: int) -> "Pieces":
        bounds = corpus.document_bounds()
        lengths = np.diff(bounds)
        keep = lengths >= 2
        begin, lengths = bounds[:-1][keep], lengths[keep]
        counts = -(-(lengths - 1) // seq_len)  # ceil((n - 1) / T) pieces per document
        doc = np.repeat(np.arange(len(counts)), counts)
        within = np.arange(len(doc)) - np.repeat(np.cumsum(counts) - counts, counts)
        starts = begin[doc] + within * seq_len
        stops = np.minimum(starts + seq_len + 1, begin[doc] + lengths[doc])
        return cls(corpus, seq_len, starts, stops)

    def split(self, first: int, stop: int) -> "Pieces":
        return Pieces(self.corpus, 0, self.starts[first:stop], self.stops[first:stop])

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        piece = self.corpus.tokens(int(self.starts[i]), int(self.stops[i]))
        return {"inputs": piece[:-1], "targets": piece[1:]}


def _read_options():
    import grain

    return grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)


def _grain_seed(seed: int) -> int:
    return seed % 2**32  # Grain's shuffle takes 0 <= seed < 2**32


def _pair(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return batch[:, :-1], batch[:, 1:]


def _packed(batch: dict) -> dict:
    """Grain's packed features -> the batch keys the models and the masked loss read."""
    segment_ids = batch["inputs_segment_ids"].astype(np.int32)
    return {
        "inputs": batch["inputs"].astype(np.int32),
        "targets": batch["targets"].astype(np.int32),
        "segment_ids": segment_ids,
        "positions": batch["inputs_positions"].astype(np.int32),
        "loss_mask": (segment_ids > 0).astype(np.float32),
    }


def datasets(
    corpus: Corpus, seq_len: int, batch_size: int, seed: int, eval_fraction: float, pack: bool, read_options=None
):
    """(train, eval) Grain datasets of batches: train shuffled from seed over endless epochs,
    eval in corpus order; both Grain IterDatasets reading ahead as `read_options` (a
    grain.ReadOptions; default _read_options) says."""
    import grain

    read_options = read_options or _read_options()
    if pack:
        source = Pieces.of(corpus, seq_len)
        what = f"{len(source)} document pieces"
    else:
        source = Windows(corpus, seq_len, 0, max(0, (corpus.num_tokens - 1) // seq_len))
        what = f"{len(source)} windows of seq_len + 1 = {seq_len + 1} tokens"
    split = int(len(source) * (1 - eval_fraction))
    parts = (
        (source.split(0, split), source.split(split, len(source)))
        if pack
        else (Windows(corpus, seq_len, 0, split), Windows(corpus, seq_len, split, len(source)))
    )
    for name, part in zip(("train", "eval"), parts):
        if len(part) < batch_size and not pack or len(part) == 0:
            raise ConfigError(
                f"data.path={str(corpus.path)!r} has {what}: its {name} split has {len(part)}, "
                f"fewer than train.batch_size={batch_size}: tokenize more text, lower "
                f"train.batch_size or model.seq_len, or change data.eval_fraction"
            )
    train = grain.MapDataset.source(parts[0]).shuffle(seed=_grain_seed(seed)).repeat()
    eval_ = grain.MapDataset.source(parts[1]).repeat()
    if not pack:
        return tuple(
            ds.batch(batch_size, drop_remainder=True).map(_pair).to_iter_dataset(read_options) for ds in (train, eval_)
        )

    def packed(ds):
        # One bin a row: each round of first-fit packing makes one batch of batch_size rows.
        rows = grain.experimental.FirstFitPackIterDataset(
            ds.to_iter_dataset(read_options),
            length_struct={"inputs": seq_len, "targets": seq_len},
            num_packing_bins=batch_size,
            seed=_grain_seed(seed),
            shuffle_bins=False,
        )
        return rows.batch(batch_size, drop_remainder=True).map(_packed)

    return packed(train), packed(eval_)


class GrainLoader:
    """A Grain dataset's iterator as recipes/run/train.py reads a data.Loader: next() the batch
    after the last one served, batch_at(i) the i-th from the start (cursor unmoved), state()
    and restore(state) Grain's iterator state (and the batches served)."""

    def __init__(self, dataset, batch_size: int, seed: int):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.iterator, self.position = iter(dataset), 0
        self._first: list = []

    def next(self):
        batch = next(self.iterator)
        self.position += 1
        return batch

    def batch_at(self, index: int):
        """The index-th batch (eval reads its first few again and again: kept)."""
        if index >= len(self._first):
            it = iter(self.dataset)
            self._first = [next(it) for _ in range(index + 1)]
        return self._first[index]

    def state(self) -> dict:
        return {
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "grain": self.iterator.get_state(),
        }

    def restore(self, state: dict | None) -> None:
        """Where a checkpoint's data_state says the loader stood (the start when None)."""
        self.iterator = iter(self.dataset)
        self.position = 0
        if state is None:
            return
        if "grain" not in state:
            raise ConfigError(
                f"the checkpoint's data state {state} is not a Grain iterator's: it was "
                f"trained on another data.source; resume with that one, or use another run_dir"
            )
        self.iterator.set_state(state["grain"])
        self.position = state["position"]


def loaders(cfg: Config) -> tuple[GrainLoader, GrainLoader]:
    corpus = Corpus(cfg.data.path)
    train, eval_ = datasets(
        corpus, cfg.model.seq_len, cfg.train.batch_size, cfg.seed, cfg.data.eval_fraction, cfg.data.pack
    )
    return (GrainLoader(train, cfg.train.batch_size, cfg.seed), GrainLoader(eval_, cfg.train.batch_size, cfg.seed))


def metadata(cfg: Config) -> dict:
    """What every manifest of a tokens run records of its data: the corpus's and tokenizer's
    hashes (a resume on another corpus or tokenizer is refused)."""
    corpus = Corpus(cfg.data.path, verify=False)  # its index only; the loaders verify the shards
    return {"corpus_hash": corpus.hash, "tokenizer_hash": corpus.index["tokenizer"]["hash"]}
