"""`mpmd tokenize FILES... -o DIR [--tokenizer T]`: a tokenized corpus that `data.source: tokens`
trains from (the format: recipes/data/tokens.py). `mpmd tokenize CONFIG -o DIR [key=value ...]`
tokenizes the files a config's data.paths name with its data.tokenizer.

A document is a file, or a line of a .jsonl file (its --text-key field, default `text`).
Exit status: 0 when written, 2 for bad arguments, files or tokenizer ("error: ..." on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mpmd.recipes.config import ConfigError
from mpmd.recipes.commands.arguments import positive


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd tokenize",
        description="Tokenize text files into shards data.source=tokens reads.",
        epilog="example: mpmd tokenize notes/*.txt -o data/notes --tokenizer runs/tok",
    )
    parser.add_argument(
        "inputs",
        metavar="FILES",
        nargs="+",
        help="UTF-8 text files (.jsonl: a document a line), or one YAML config followed by "
        "key=value overrides: its data.paths with its data.tokenizer",
    )
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DIR",
        help="writes DIR/index.json, DIR/shard-*.tokens|offsets and DIR/tokenizer-*.json; a corpus "
        "already there is replaced only once the new one is whole",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="T",
        help="bytes, a tokenizer.json or its directory (default: bytes, or the config's)",
    )
    parser.add_argument(
        "--shard-tokens",
        type=positive(int),
        default=None,
        metavar="N",
        help="tokens per shard, at least (documents are not cut; default 100,000,000)",
    )
    parser.add_argument("--text-key", default="text", metavar="K", help="the text field of .jsonl lines")
    return parser


def _files_and_tokenizer(args) -> tuple[list, str]:
    first = Path(args.inputs[0])
    if first.suffix not in (".yaml", ".yml"):
        return args.inputs, args.tokenizer or "bytes"
    from mpmd.recipes import config, registry

    cfg = config.load(first, args.inputs[1:])
    files = registry.get_data_source(cfg.data.source).files
    if files is None:
        readers = [name for name, spec in registry.data_sources().items() if spec.files is not None]
        raise ConfigError(
            f"{first}: mpmd tokenize reads the text files of a config's data source, which needs "
            f"data.source={registry.one_of(readers)}, got '{cfg.data.source}'"
        )
    return files(cfg.data), args.tokenizer or cfg.data.tokenizer


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from mpmd.recipes.data import tokenizer
    from mpmd.recipes.data import tokens

    try:
        if args.shard_tokens is not None and args.shard_tokens <= 0:
            raise ConfigError(f"--shard-tokens must be > 0, got {args.shard_tokens}")
        files, spec = _files_and_tokenizer(args)
        tok = tokenizer.load(spec)
        t0 = time.perf_counter()
        index = tokens.write(files, args.output, tok, args.shard_tokens or tokens.SHARD_TOKENS, args.text_key)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.output}: {index['num_documents']} documents, {index['num_tokens']} tokens in "
        f"{len(index['shards'])} shard(s), tokenizer {tok.spec!r} (hash {tok.hash}), corpus hash {index['hash']} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
