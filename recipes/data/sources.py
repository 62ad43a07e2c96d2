"""The built-in data sources, each one registration (mpmd.recipes.registry.register_data_source):
its data.* section, its loaders, what it records in every manifest, what it needs of the
tokenizer and the model. A source of your own is one module that registers a spec and is
listed under the config's `imports:`; nothing else in the tree names a source.

| source | gives | its keys |
|---|---|---|
| stdlib | token windows of this Python's own .py files, as bytes (or data.tokenizer's tokens) | eval_fraction, max_bytes |
| files | the same of data.paths | paths, eval_fraction, max_bytes |
| synthetic | seeded token windows, or regression pairs for a regressor | (none) |
| tokens | a corpus `mpmd tokenize` wrote, through Grain (recipes/data/grain.py) | path, pack, eval_fraction |
| jsonl | prompt/response examples, the loss on response tokens (recipes/data/sft.py) | path, eval_path, pack, eval_fraction |
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd.recipes.config.schema import DataSection
from mpmd.recipes.registry import PROMPT_RESPONSE, REGRESSION, TOKEN_WINDOWS, DataSourceSpec, register_data_source

_EVAL_FRACTION = dict(
    gt=0,
    lt=1,
    description="last fraction of the corpus held out for eval (of its bytes or tokens; of a tokens "
    "corpus's windows, or with data.pack its pieces)",
)
_MAX_BYTES = dict(gt=0, description="byte corpus cap, keeps startup fast")


class StdlibData(DataSection):
    source: Literal["stdlib"] = Field("stdlib", description="where the training data comes from")
    eval_fraction: float = Field(0.05, **_EVAL_FRACTION)
    max_bytes: int = Field(8_000_000, **_MAX_BYTES)


class FilesData(StdlibData):
    source: Literal["files"] = Field("files", description="where the training data comes from")
    paths: list[str] = Field([], description="file paths, directories or globs, read as one corpus")


class SyntheticData(DataSection):
    source: Literal["synthetic"] = Field("synthetic", description="where the training data comes from")


class TokensData(DataSection):
    source: Literal["tokens"] = Field("tokens", description="where the training data comes from")
    path: str | None = Field(None, description="the directory `mpmd tokenize` wrote (index.json and its shards)")
    pack: bool = Field(
        False,
        description="pack whole documents into rows of model.seq_len (Grain's first-fit packing) with "
        "segment_ids and positions, the loss over real tokens only; false = windows of the "
        "concatenated documents",
    )
    eval_fraction: float = Field(0.05, **_EVAL_FRACTION)


class JsonlData(TokensData):
    source: Literal["jsonl"] = Field("jsonl", description="where the training data comes from")
    path: str | None = Field(
        None, description="the training examples' .jsonl (prompt/response, or chat messages: recipes/data/sft.py)"
    )
    pack: bool = Field(False, description="pack several examples into each row of model.seq_len")
    eval_path: str | None = Field(
        None,
        description="the held-out examples' .jsonl (eval loss, train.exact_match); null = the last "
        "data.eval_fraction of data.path's examples",
    )


# -- loaders ------------------------------------------------------------------------------
def _byte_corpus(files):
    def loaders(cfg, gives):
        from mpmd.recipes.data import loaders as data
        from mpmd.recipes.data import tokenizer

        d, m = cfg.data, cfg.model
        tok = None if d.tokenizer == tokenizer.BYTES else tokenizer.load(d.tokenizer)
        corpus = data.ByteCorpus(files(d), m.seq_len, d.eval_fraction, d.max_bytes, tok)
        return data.loaders_of(cfg, corpus.train, corpus.eval)

    return loaders


def _stdlib_files(d):
    from mpmd.recipes.data import loaders as data

    return data.stdlib_files()


def _listed_files(d):
    from mpmd.recipes.data import loaders as data

    return data.listed_files(d.paths)


def _synthetic(cfg, gives):
    from mpmd.recipes.data import loaders as data

    m = cfg.model
    if gives == REGRESSION:
        train, eval_ = data.regression_sources(m.in_features, m.out_features)
    else:
        train, eval_ = data.synthetic_token_sources(m.vocab_size, m.seq_len)
    return data.loaders_of(cfg, train, eval_)


def _grain(cfg, gives):
    from mpmd.recipes.data import grain

    return grain.loaders(cfg)


def _sft(cfg, gives):
    from mpmd.recipes.data import sft

    return sft.loaders(cfg)


# -- the rest of each spec ------------------------------------------------------------------
def _tokenizer_hash(cfg) -> dict:
    """A tokenizer other than bytes is recorded by content in every manifest."""
    from mpmd.recipes.data import tokenizer

    d = cfg.data
    return {} if d.tokenizer == tokenizer.BYTES else {"tokenizer_hash": tokenizer.load(d.tokenizer).hash}


def _corpus_metadata(cfg) -> dict:
    from mpmd.recipes.data import grain

    return grain.metadata(cfg)


def _examples_metadata(cfg) -> dict:
    from mpmd.recipes.data import sft

    return sft.metadata(cfg)


def _corpus_tokenizer(cfg):
    """A tokens corpus trains with the tokenizer it was made with (None while data.path is
    missing: a problem of its own)."""
    from mpmd.recipes.data import tokenizer

    return None if cfg.data.path is None else tokenizer.of_corpus(cfg.data)


def _files_problems(cfg) -> list[str]:
    if not cfg.data.paths:
        return ["data.paths must name at least one file, directory or glob when data.source='files'"]
    return []


def _corpus_problems(cfg) -> list[str]:
    if cfg.data.path is None:
        return ["data.path (a corpus `mpmd tokenize` wrote) must be given when data.source='tokens'"]
    return []


def _examples_problems(cfg) -> list[str]:
    if cfg.data.path is None:
        return [
            "data.path (a .jsonl of prompt/response examples, e.g. `mpmd sft-data -o DIR`'s DIR/train.jsonl) "
            "must be given when data.source='jsonl'"
        ]
    return []


def _packed(cfg) -> bool:
    return cfg.data.pack


register_data_source(
    DataSourceSpec(
        "stdlib",
        StdlibData,
        gives=(TOKEN_WINDOWS,),
        loaders=_byte_corpus(_stdlib_files),
        metadata=_tokenizer_hash,
        text=True,
        byte_text=True,
        files=_stdlib_files,
    )
)
register_data_source(
    DataSourceSpec(
        "files",
        FilesData,
        gives=(TOKEN_WINDOWS,),
        loaders=_byte_corpus(_listed_files),
        metadata=_tokenizer_hash,
        text=True,
        byte_text=True,
        files=_listed_files,
        problems=_files_problems,
    )
)
register_data_source(
    DataSourceSpec(
        "synthetic", SyntheticData, gives=(TOKEN_WINDOWS, REGRESSION), loaders=_synthetic, metadata=_tokenizer_hash
    )
)
register_data_source(
    DataSourceSpec(
        "tokens",
        TokensData,
        gives=(TOKEN_WINDOWS,),
        loaders=_grain,
        metadata=_corpus_metadata,
        text=True,
        tokenizer=_corpus_tokenizer,
        masks_loss=_packed,
        batch_digests=True,
        problems=_corpus_problems,
    )
)
register_data_source(
    DataSourceSpec(
        "jsonl",
        JsonlData,
        gives=(PROMPT_RESPONSE,),
        loaders=_sft,
        metadata=_examples_metadata,
        text=True,
        byte_text=True,
        masks_loss=lambda cfg: True,
        held_out_examples=True,
        problems=_examples_problems,
    )
)
