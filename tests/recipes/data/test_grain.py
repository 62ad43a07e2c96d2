"""recipes/data/grain.py: data.source=tokens through Grain. The loader's batches are those of
Grain's own iterator over the corpus's windows held in memory; each epoch is a permutation of
the train windows; a loader restored from a saved (JSON) state goes on exactly as one never
stopped, packed or not; packed rows hold whole pieces of documents with their segment ids,
positions and loss mask."""

import json
import time
from pathlib import Path

import grain
import numpy as np
import pytest

from mpmd.recipes import config
from mpmd.recipes.data import grain as grain_data
from mpmd.recipes.data import tokenizer
from mpmd.recipes.data import tokens
from mpmd.recipes.config import ConfigError

SEQ, BATCH, SEED = 16, 4, 7


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """~180 byte-tokenized documents of 1..60 tokens (bytes: tokens are readable), 3 shards."""
    out = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "pi", "rho", "é"]
    docs = [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(180)]
    (out / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokens.write([out / "docs.jsonl"], out / "c", tokenizer.load("bytes"), shard_tokens=2000)
    return out / "c"


def cfg_of(corpus_dir, *overrides):
    return config.load(
        "configs/gpt_tiny.yaml",
        [
            "data.source=tokens",
            f"data.path={corpus_dir}",
            f"model.seq_len={SEQ}",
            f"train.batch_size={BATCH}",
            "pipeline.num_microbatches=2",
            f"seed={SEED}",
            *overrides,
        ],
    )


def test_batches_are_grains_own_iterator_over_the_windows(corpus_dir):
    corpus = tokens.Corpus(corpus_dir)
    assert len(corpus.index["shards"]) > 1
    stream = corpus.tokens(0, corpus.num_tokens)
    num = (len(stream) - 1) // SEQ
    windows = [stream[i * SEQ : (i + 1) * SEQ + 1] for i in range(num)]
    split = int(num * 0.95)
    train, eval_ = grain_data.loaders(cfg_of(corpus_dir))
    want = iter(grain.MapDataset.source(windows[:split]).shuffle(seed=SEED).repeat().batch(BATCH))
    epoch = split // BATCH
    got = [train.next() for _ in range(2 * epoch + 1)]  # into a third epoch
    for i, (inputs, targets) in enumerate(got):
        w = next(want)
        np.testing.assert_array_equal(inputs, w[:, :-1], err_msg=f"batch {i}")
        np.testing.assert_array_equal(targets, w[:, 1:], err_msg=f"batch {i}")
    # An epoch is a permutation of the train windows (its first `split` rows hold each once);
    # the next epoch another.
    rows = [tuple(r) for inputs, targets in got for r in np.concatenate([inputs, targets[:, -1:]], axis=1)]
    assert sorted(rows[:split]) == sorted(tuple(w) for w in windows[:split])
    assert sorted(rows[split : 2 * split]) == sorted(rows[:split]) and rows[split : 2 * split] != rows[:split]
    # Eval: the held-out tail, in corpus order, the same each time.
    inputs, targets = eval_.batch_at(1)
    np.testing.assert_array_equal(inputs, np.stack(windows[split + BATCH : split + 2 * BATCH])[:, :-1])
    assert eval_.batch_at(1)[0] is inputs


def test_a_loader_reads_a_few_batches_ahead_not_grains_500(corpus_dir, monkeypatch):
    """Grain's default read options fill a 500-element buffer on 16 threads at each new
    iterator; the loader's own read 16 batches ahead (recipes/data/grain.py _read_options)."""
    reads = []
    window = grain_data.Windows.__getitem__
    monkeypatch.setattr(grain_data.Windows, "__getitem__", lambda self, i: reads.append(i) or window(self, i))
    train, _ = grain_data.loaders(cfg_of(corpus_dir))
    train.next()
    settled = -1
    while settled != len(reads):  # until the read-ahead threads stop
        settled = len(reads)
        time.sleep(0.3)
    assert 2 * BATCH <= len(reads) <= (1 + 16 + 2) * BATCH, f"{len(reads)} windows read for one batch of {BATCH}"


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("stop_after", [3, 40])  # mid-epoch, and past the first epoch
def test_a_restored_loader_goes_on_as_one_never_stopped(corpus_dir, pack, stop_after):
    cfg = cfg_of(corpus_dir, f"data.pack={str(pack).lower()}")
    straight, _ = grain_data.loaders(cfg)
    want = [straight.next() for _ in range(stop_after + 5)]
    stopped, _ = grain_data.loaders(cfg)
    for _ in range(stop_after):
        stopped.next()
    state = json.loads(json.dumps(stopped.state()))  # as the manifest holds it
    assert state["position"] == stop_after
    resumed, _ = grain_data.loaders(cfg)
    resumed.restore(state)
    for i in range(5):
        got, w = resumed.next(), want[stop_after + i]
        for a, b in zip(*(x.values() if pack else x for x in (got, w))):
            np.testing.assert_array_equal(a, b, err_msg=f"batch {stop_after + i}")
    resumed.restore(None)
    np.testing.assert_array_equal(
        (resumed.next()["inputs"] if pack else resumed.next()[0]), (want[0]["inputs"] if pack else want[0][0])
    )


def test_packed_rows_hold_whole_document_pieces(corpus_dir):
    corpus = tokens.Corpus(corpus_dir)
    bounds = corpus.document_bounds()
    # Each document cut every SEQ tokens into pieces of up to SEQ + 1 (a piece's last token is the
    # next one's first), so every target of a document is in exactly one piece.
    docs = [corpus.tokens(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    pieces = {tuple(d[k : k + SEQ + 1]) for d in docs for k in range(0, max(1, len(d) - 1), SEQ) if len(d) >= 2}
    assert any(len(d) > SEQ + 1 for d in docs) and any(len(d) < SEQ for d in docs)
    train, _ = grain_data.loaders(cfg_of(corpus_dir, "data.pack=true"))
    seen = 0
    for _ in range(30):
        b = train.next()
        assert set(b) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
        assert all(v.shape == (BATCH, SEQ) for v in b.values())
        np.testing.assert_array_equal(b["loss_mask"], (b["segment_ids"] > 0).astype(np.float32))
        for r in range(BATCH):
            for s in set(b["segment_ids"][r]) - {0}:
                at = b["segment_ids"][r] == s
                np.testing.assert_array_equal(b["positions"][r][at], np.arange(at.sum()))
                inputs, targets = b["inputs"][r][at], b["targets"][r][at]
                np.testing.assert_array_equal(inputs[1:], targets[:-1])  # targets shifted within the piece
                piece = (*inputs, targets[-1])
                assert piece in pieces
                seen += 1
    assert seen > 30 * BATCH, "several documents a row"


def test_refuses_a_corpus_too_small_for_a_batch(corpus_dir):
    with pytest.raises(ConfigError, match=r"its eval split has \d+, fewer than train.batch_size=64"):
        grain_data.loaders(cfg_of(corpus_dir, "train.batch_size=64", "pipeline.num_microbatches=4"))


@pytest.mark.slow
def test_a_packed_recipe_run_trains_on_the_token_weighted_loss(corpus_dir, tmp_path):
    """`mpmd train` with data.source=tokens data.pack=true on 2 worker processes: step 1's loss
    is the unpipelined model's token-weighted loss on the loader's first packed batch (within
    1e-5), the loss falls, and evals run on packed eval batches."""
    from mpmd import models
    from mpmd.recipes import registry
    from mpmd.recipes.run import run_log
    from tests.support.processes import Controller

    overrides = [
        "data.source=tokens",
        f"data.path={corpus_dir}",
        "data.pack=true",
        f"model.seq_len={SEQ}",
        "model.d_model=32",
        "model.num_layers=2",
        "train.batch_size=8",
        "train.steps=12",
        "train.eval_every=6",
        "train.sample_tokens=8",
        "optimizer.warmup_steps=0",
        "log.trace_steps=[]",
        "log.tensorboard=false",
        "checkpoint.every=0",
    ]
    out = Controller(tmp_path / "run", ["configs/gpt_tiny.yaml", *overrides]).succeed()
    records = run_log.read(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 13)) and "eval_loss" in records[5], records[5]
    cfg = config.load("configs/gpt_tiny.yaml", overrides)
    batch = grain_data.loaders(cfg)[0].next()
    assert batch["loss_mask"].mean() < 1, "the first batch has padding"
    model = registry.get_model_spec("gpt").build(cfg, False)
    loss_sum, weight = models.masked_lm_loss(
        model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"]), batch
    )
    np.testing.assert_allclose(records[0]["loss"], float(loss_sum / weight), rtol=1e-5)
    assert np.mean([r["loss"] for r in records[-3:]]) < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    assert "sample (8 bytes" in out
