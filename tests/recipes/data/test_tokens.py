"""recipes/data/tokens.py and `mpmd tokenize`: a tokenized corpus written in shards and read back
memory-mapped, document by document exactly the tokenizer's encoding; a changed or damaged
corpus is refused by name."""

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from mpmd.recipes import config
from mpmd.recipes.commands import tokenize as tokenize_cli
from mpmd.recipes.data import tokenizer
from mpmd.recipes.data import tokens
from mpmd.recipes.config import ConfigError
from tests.support.processes import sigkill_at_marker
from tests.recipes.data.test_tokenizer import trained  # noqa: F401  (the fixture: a 300-token BPE)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = [STDLIB / "json" / n for n in ("decoder.py", "encoder.py", "scanner.py", "tool.py", "__init__.py")]


def texts_of(files) -> list[str]:
    return [f.read_text() for f in files]


@pytest.fixture(scope="module")
def corpus_dir(trained, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("corpus")
    assert (
        tokenize_cli.main([*map(str, FILES), "-o", str(out), "--tokenizer", str(trained), "--shard-tokens", "3000"])
        == 0
    )
    return out


def test_every_document_reads_back_as_its_tokens_followed_by_eos(corpus_dir, trained):  # noqa: F811
    corpus = tokens.Corpus(corpus_dir)
    tok = tokenizer.load(str(trained))
    want = [np.append(tok.encode(t), tok.eos_id) for t in texts_of(FILES)]
    assert len(corpus.index["shards"]) > 1, "the documents span several shards"
    assert corpus.dtype == np.dtype("<u2") and corpus.num_documents == len(FILES)
    bounds = corpus.document_bounds()
    assert corpus.num_tokens == bounds[-1] == sum(map(len, want))
    for j, doc in enumerate(want):
        np.testing.assert_array_equal(corpus.tokens(bounds[j], bounds[j + 1]), doc)
    # Any range, across shard ends, is the concatenation's.
    stream = np.concatenate(want)
    for start, stop in [(0, 5), (2990, 3010), (100, corpus.num_tokens), (corpus.num_tokens, corpus.num_tokens)]:
        np.testing.assert_array_equal(corpus.tokens(start, stop), stream[start:stop])
    assert corpus.tokens(0, 5).dtype == np.int32
    assert corpus.tokenizer().hash == tok.hash == corpus.index["tokenizer"]["hash"]


def test_jsonl_lines_are_documents_and_bytes_have_no_eos(tmp_path):
    lines = [{"text": "one"}, {"text": "twö"}, {"text": ""}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    index = tokens.write([tmp_path / "a.jsonl"], tmp_path / "c", tokenizer.load("bytes"))
    corpus = tokens.Corpus(tmp_path / "c")
    assert index["num_documents"] == 3 and corpus.dtype == np.dtype("u1")
    assert list(corpus.document_bounds()) == [0, 3, 7, 7]
    assert corpus.tokens(0, 7).tobytes() == np.frombuffer("onetwö".encode(), np.uint8).astype(np.int32).tobytes()
    assert not (tmp_path / "c" / "tokenizer.json").exists() and corpus.tokenizer().hash == "bytes"
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match=r"b.jsonl:1: a .jsonl line must be a JSON object with a string 'text'"):
        tokens.write([tmp_path / "b.jsonl"], tmp_path / "d", tokenizer.load("bytes"))


def test_the_same_files_and_tokenizer_give_the_same_hash(corpus_dir, trained, tmp_path):  # noqa: F811
    again = tokens.write(FILES, tmp_path / "again", tokenizer.load(str(trained)), shard_tokens=3000)
    other = tokens.write(FILES[:-1], tmp_path / "other", tokenizer.load(str(trained)), shard_tokens=3000)
    as_bytes = tokens.write(FILES, tmp_path / "bytes", tokenizer.load("bytes"), shard_tokens=3000)
    assert again["hash"] == tokens.Corpus(corpus_dir).hash
    assert len({again["hash"], other["hash"], as_bytes["hash"]}) == 3


def test_tokenize_a_configs_files(trained, tmp_path):  # noqa: F811
    out = tmp_path / "c"
    assert (
        tokenize_cli.main(
            [
                "configs/gpt_tiny.yaml",
                "data.source=files",
                f"data.paths={[str(f) for f in FILES]}",
                f"data.tokenizer={trained}",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert tokens.Corpus(out).num_documents == len(FILES)
    assert tokens.Corpus(out).tokenizer().hash == tokenizer.load(str(trained)).hash


def test_refuses_a_missing_changed_or_truncated_corpus(corpus_dir, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"data.path='.*nope' does not exist: give the directory `mpmd tokenize"):
        tokens.Corpus(tmp_path / "nope")
    with pytest.raises(
        ConfigError, match=r"data.path \(a corpus `mpmd tokenize` wrote\) must be given when data.source=.tokens."
    ):
        config.load("configs/gpt_tiny.yaml", ["data.source=tokens"])
    with pytest.raises(ConfigError, match=r"data.pack is only used by data.source='tokens' or 'jsonl'"):
        config.load("configs/gpt_tiny.yaml", ["data.pack=true"])
    with pytest.raises(ConfigError, match=r"gives token windows, which model.kind='mlp' does not read"):
        config.load("configs/mlp.yaml", ["data.source=tokens", f"data.path={corpus_dir}"])
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in corpus_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    index = json.loads((copy / "index.json").read_text())
    index["num_tokens"] += 1
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"was changed after `mpmd tokenize` wrote it"):
        tokens.Corpus(copy)
    (copy / "index.json").write_bytes((corpus_dir / "index.json").read_bytes())
    shard = copy / index["shards"][1]["tokens"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"shard-00001-[0-9a-f]{12}.tokens: missing or not \d+ bytes"):
        tokens.Corpus(copy)
    assert tokenize_cli.main([str(tmp_path / "none.txt"), "-o", str(tmp_path / "x")]) == 2
    assert "text file '" in capsys.readouterr().err


def copy_of(corpus_dir: Path, to: Path) -> Path:
    to.mkdir()
    for f in corpus_dir.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def rewrite_index(corpus: Path, change) -> None:
    """Changes the index and recomputes its hash, as someone who knows the format would."""
    index = json.loads((corpus / "index.json").read_text())
    change(index)
    index["hash"] = tokens._index_hash(index)
    (corpus / "index.json").write_text(json.dumps(index))


def test_rotted_shard_bytes_and_lying_counts_or_offsets_are_refused_by_name(corpus_dir, tmp_path):
    # Bytes rotted in place, ids still in the vocabulary, the size unchanged: only the digest sees it.
    rotted = copy_of(corpus_dir, tmp_path / "rotted")
    name = json.loads((rotted / "index.json").read_text())["shards"][0]["tokens"]
    raw = bytearray((rotted / name).read_bytes())
    raw[100], raw[101] = raw[101], raw[100] ^ 1
    (rotted / name).write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=rf"{name}: its bytes \(or its offsets'\) do not match the sha256"):
        tokens.Corpus(rotted)
    assert tokens.Corpus(rotted, verify=False).hash  # the index alone still reads (manifests, resume checks)
    # Totals that are not the sum of the shards', the index's hash recomputed.
    counts = copy_of(corpus_dir, tmp_path / "counts")
    rewrite_index(counts, lambda i: i.update(num_documents=i["num_documents"] + 1))
    with pytest.raises(ConfigError, match=r"num_tokens or num_documents is not the sum of its shards'"):
        tokens.Corpus(counts)
    # An offsets file of the right size that lies, its shard digest and the index hash recomputed.
    lying = copy_of(corpus_dir, tmp_path / "lying")
    shard = json.loads((lying / "index.json").read_text())["shards"][0]
    offsets = np.fromfile(lying / shard["offsets"], "<i8")
    offsets[0] = 7  # document 0 would start mid-document
    (lying / shard["offsets"]).write_bytes(offsets.tobytes())
    sha = hashlib.sha256((lying / shard["tokens"]).read_bytes() + offsets.tobytes()).hexdigest()
    rewrite_index(lying, lambda i: i["shards"][0].update(sha256=sha))
    with pytest.raises(ConfigError, match=rf"{shard['offsets']}: document offsets must start at 0, never decrease"):
        tokens.Corpus(lying)
    # A shard entry naming a file outside the corpus.
    outside = copy_of(corpus_dir, tmp_path / "outside")
    rewrite_index(outside, lambda i: i["shards"][0].update(tokens="../rotted/" + name))
    with pytest.raises(ConfigError, match=r"shard entries must name files in the corpus"):
        tokens.Corpus(outside)


def snapshot(directory: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


def test_a_failed_tokenize_leaves_the_corpus_it_would_replace_as_it_was(corpus_dir, tmp_path, capsys):
    good = copy_of(corpus_dir, tmp_path / "good")
    before = snapshot(good)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 \xff\xfe not UTF-8")
    # The bad file last: the good ones are tokenized and written first, then the write fails.
    assert tokenize_cli.main([*map(str, FILES), str(bad), "-o", str(good), "--shard-tokens", "3000"]) == 2
    assert "bad.txt" in capsys.readouterr().err
    assert snapshot(good) == before, "a failed tokenize changed the corpus it would have replaced"
    assert tokens.Corpus(good).num_documents == len(FILES)
    # A good write replaces it whole and leaves nothing of the old corpus behind.
    assert tokenize_cli.main([*map(str, FILES[:2]), "-o", str(good)]) == 0
    corpus = tokens.Corpus(good)
    assert corpus.num_documents == 2 and corpus.tokenizer().hash == "bytes"
    assert sorted(f.name for f in good.iterdir()) == sorted(tokens._referenced(good))


KILLED_MID_WRITE = """
import os, sys, time
from pathlib import Path
from mpmd.recipes.data import tokenizer, tokens

closes = []
close = tokens._ShardWriter.close
def close_then_wait(self, written):
    got = close(self, written)
    closes.append(got)
    if len(closes) == 2:  # two new shards published, the index not yet
        Path(sys.argv[2]).write_text("mid-write")
        time.sleep(60)
    return got
tokens._ShardWriter.close = close_then_wait
files = sys.argv[3:]
tokens.write(files, sys.argv[1], tokenizer.load("bytes"), shard_tokens=3000)
"""


def test_a_tokenize_killed_mid_write_leaves_the_old_corpus_and_the_next_cleans_up(corpus_dir, tmp_path):
    good = copy_of(corpus_dir, tmp_path / "good")
    before = snapshot(good)
    marker = tmp_path / "marker"
    sigkill_at_marker(KILLED_MID_WRITE, [good, marker, *FILES], marker)
    left = set(snapshot(good)) - set(before)
    assert left, "the killed write had published shards of its own"
    assert {n: b for n, b in snapshot(good).items() if n in before} == before
    assert tokens.Corpus(good).hash == json.loads(before["index.json"])["hash"]
    tokens.write(FILES[:1], good, tokenizer.load("bytes"))
    assert sorted(f.name for f in good.iterdir()) == sorted(tokens._referenced(good))
    assert tokens.Corpus(good).num_documents == 1
