"""recipes/data/tokenizer.py and `mpmd tokenizer train`: the bytes tokenizer is the byte corpus's
own coding; a trained byte-level BPE encodes as the Hugging Face `tokenizers` library itself
does; model.vocab_size follows the tokenizer; a run's tokenizer is read back from its run
directory."""

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from mpmd.recipes import config
from mpmd.recipes.data import loaders as data
from mpmd.recipes.data import tokenizer
from mpmd.recipes.commands import tokenizer as tokenizer_cli
from mpmd.recipes.config import ConfigError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXT = "def f(x):\n    return {'é': x ** 2}  # ünïcödé ✓\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 300-token BPE learnt from three stdlib modules: DIR/tokenizer.json."""
    out = tmp_path_factory.mktemp("tok")
    files = [STDLIB / "json" / "decoder.py", STDLIB / "json" / "encoder.py", STDLIB / "textwrap.py"]
    assert tokenizer_cli.main(["train", *map(str, files), "--vocab-size", "300", "-o", str(out)]) == 0
    return out


def test_bytes_is_the_byte_corpus_coding():
    tok = tokenizer.load("bytes")
    assert (tok.vocab_size, tok.eos_id, tok.hash) == (256, None, "bytes")
    np.testing.assert_array_equal(tok.encode(TEXT), data.encode(TEXT))
    assert tok.encode(TEXT).dtype == np.int32
    assert tok.decode(tok.encode(TEXT)) == TEXT == data.decode(data.encode(TEXT))
    assert tok.decode([300, 65]) == data.decode([300, 65]) == "\ufffdA"


def test_a_trained_bpe_encodes_as_the_tokenizers_library_does(trained):
    tok = tokenizer.load(str(trained))  # the directory
    same = tokenizer.load(str(trained / "tokenizer.json"))  # or the file
    reference = tokenizers.Tokenizer.from_file(str(trained / "tokenizer.json"))
    assert tok.vocab_size == same.vocab_size == reference.get_vocab_size() == 300
    assert tok.eos_id == reference.token_to_id("<|endoftext|>") is not None
    text = (STDLIB / "json" / "scanner.py").read_text()  # not trained on
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and list(ids) == reference.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text.encode()) / 1.4, "merges shorten the text"
    assert tok.decode(ids) == text and tok.decode(tok.encode(TEXT)) == TEXT  # byte-level: any text
    assert [list(a) for a in tok.encode_batch([text, TEXT])] == [list(ids), list(tok.encode(TEXT))]
    # Ids past the tokenizer's (the model's padded rows) decode to U+FFFD, the rest as they are.
    assert tok.decode([*tok.encode("ab"), 299 + 50, *tok.encode("cd")]) == "ab\ufffdcd"
    assert tok.hash == same.hash and len(tok.hash) == 12


def test_the_hash_is_the_files_content(trained, tmp_path):
    copy = tmp_path / "t" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(trained / "tokenizer.json", copy)
    assert tokenizer.load(str(copy)).hash == tokenizer.load(str(trained)).hash
    spec = json.loads(copy.read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    copy.write_text(json.dumps(spec))
    assert tokenizer.load(str(copy)).hash != tokenizer.load(str(trained)).hash


def test_tokenizer_config_names_the_eos_token(trained, tmp_path):
    shutil.copy(trained / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert tokenizer.load(str(tmp_path)).eos_id == tokenizer.load(str(trained)).eos_id


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda d: str(d / "nope"), r"does not exist; give 'bytes', a tokenizer.json"),
        (lambda d: str(d), r"the directory .* holds no tokenizer.json"),
        (
            lambda d: (d / "t.json").write_text('{"x": 1}') and str(d / "t.json"),
            r"is not a Hugging Face tokenizer.json",
        ),
    ],
)
def test_refuses_what_is_no_tokenizer(tmp_path, make, match):
    with pytest.raises(ConfigError, match=match):
        tokenizer.load(make(tmp_path))


def test_the_cli_refuses_a_vocabulary_below_the_bytes(tmp_path, capsys):
    assert tokenizer_cli.main(["train", str(STDLIB / "textwrap.py"), "--vocab-size", "100", "-o", str(tmp_path)]) == 2
    assert "a byte-level BPE needs at least 257 tokens" in capsys.readouterr().err
    assert tokenizer_cli.main(["train", str(tmp_path / "missing.txt"), "--vocab-size", "300", "-o", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_training_on_a_file_that_is_not_utf8_is_one_line_and_keeps_the_tokenizer_there(trained, tmp_path, capsys):
    out = tmp_path / "tok"
    out.mkdir()
    before = (trained / "tokenizer.json").read_bytes()
    (out / "tokenizer.json").write_bytes(before)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text " * 100 + b"\xff\xfe")
    argv = ["train", str(STDLIB / "textwrap.py"), str(bad), "--vocab-size", "300", "-o", str(out)]
    assert tokenizer_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: text file '{bad}' is not UTF-8 text (byte 1000: invalid start byte)"], err
    assert (out / "tokenizer.json").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]


def test_model_vocab_size_follows_the_tokenizer(trained):
    cfg = config.load("configs/gpt_tiny.yaml", [f"data.tokenizer={trained}"])
    assert cfg.model.vocab_size == 384, "300 rounded up to a multiple of 128"
    assert "padded by 84" in tokenizer.vocab_note(tokenizer.of_config(cfg), cfg.model.vocab_size)
    cfg = config.load("configs/llama_tiny.yaml", [f"data.tokenizer={trained}", "model.vocab_size=300"])
    assert cfg.model.vocab_size == 300, "a vocab_size given is kept"
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than the tokenizer .*'s 300 tokens"):
        config.load("configs/gpt_tiny.yaml", [f"data.tokenizer={trained}", "model.vocab_size=256"])
    with pytest.raises(ConfigError, match=r"tokenizer .*nope.* does not exist"):
        config.load("configs/gpt_tiny.yaml", ["data.tokenizer=nope"])
    assert tokenizer.vocab_multiple([1, 4, 2]) == 512
    assert config.load("configs/gpt_tiny.yaml").model.vocab_size == 256, "bytes: the default stays"


def test_a_config_from_before_the_tokenizer_keys_has_the_same_math():
    """A checkpoint's math lacks data.tokenizer, or (from before the data section was per
    source) holds every source's keys: at their defaults they are no change, so a run from
    before them resumes."""
    cfg = config.load("configs/gpt_tiny.yaml")
    now = cfg.math()
    saved = {k: v for k, v in now.items() if k != "data.tokenizer"}
    assert len(saved) == len(now) - 1
    assert config.math_changes(saved, now) == []
    flat = {**now, "data.paths": [], "data.path": None, "data.pack": False, "data.eval_path": None}
    assert config.math_changes(flat, now) == []
    assert config.math_changes({**flat, "data.pack": True}, now) == ["data.pack: True -> '(unset)'"]
    changed = config.load("configs/gpt_tiny.yaml", ["data.tokenizer=bytes", "data.eval_fraction=0.1"]).math()
    assert config.math_changes(saved, changed) == ["data.eval_fraction: 0.05 -> 0.1"]


def test_the_byte_corpus_through_a_tokenizer(trained):
    """data.source=files with a BPE: each file's tokens, then the end-of-text token."""
    files = [STDLIB / "json" / "decoder.py", STDLIB / "textwrap.py"]
    cfg = config.load(
        "configs/gpt_tiny.yaml",
        ["data.source=files", f"data.paths={[str(f) for f in files]}", f"data.tokenizer={trained}"],
    )
    train, eval_ = (loader.source for loader in data.make_loaders(cfg))
    tok = tokenizer.load(str(trained))
    want = np.concatenate([np.append(tok.encode(f.read_text()), tok.eos_id) for f in files])
    np.testing.assert_array_equal(np.concatenate([train.tokens, eval_.tokens]), want)
    inputs, targets = train.batch(0, 0, 4)
    assert inputs.shape == (4, 64) and inputs.max() < 300


def _with_bos(trained, out: Path, post_processor: bool, add_bos_token) -> Path:
    """The trained BPE with a <|begin_of_text|> token: put first by its post-processor (Llama
    3's tokenizer.json) or not, and tokenizer_config.json's add_bos_token as given."""
    tok = tokenizers.Tokenizer.from_file(str(trained / "tokenizer.json"))
    tok.add_special_tokens(["<|begin_of_text|>"])
    if post_processor:
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    "post_processor, add_bos_token, bos_first",
    # transformers 5 follows the post-processor; add_bos_token does not change a tokenizer.json's
    [(True, None, True), (True, False, True), (False, True, False), (False, None, False)],
)
def test_a_prompt_starts_with_bos_as_transformers_tokenizer_makes_it(
    trained, tmp_path, post_processor, add_bos_token, bos_first
):
    """`mpmd generate`'s prompt tokens are what transformers' AutoTokenizer gives for the same
    directory (its input_ids); the text printed leaves the BOS out."""
    from transformers import AutoTokenizer

    d = _with_bos(trained, tmp_path / "tok", post_processor, add_bos_token)
    ours = tokenizer.load(str(d))
    want = AutoTokenizer.from_pretrained(str(d))(TEXT)["input_ids"]
    got = ours.encode_prompt(TEXT).tolist()
    assert got == want
    assert (got[0] == ours._tok.token_to_id("<|begin_of_text|>")) == bos_first
    assert ours.encode(TEXT).tolist() == got[1:] if bos_first else got  # training data: no BOS
