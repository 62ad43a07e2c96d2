"""`mpmd tokenizer train FILES... --vocab-size N -o DIR`: a byte-level BPE tokenizer learnt
from the user's own text files, offline (recipes/data/tokenizer.py train_bpe); DIR/tokenizer.json is
what data.tokenizer and `mpmd tokenize --tokenizer` take.

Exit status: 0 when written, 2 for bad arguments or unreadable files ("error: ..." on stderr).
"""

from __future__ import annotations

import argparse
import sys

from mpmd.recipes.config import ConfigError
from mpmd.recipes.commands.arguments import positive


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd tokenizer",
        description="Make a tokenizer from your own text files (nothing is downloaded).",
        epilog="example: mpmd tokenizer train notes/*.txt --vocab-size 4096 -o runs/tok",
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="train")
    train = sub.add_parser("train", help="train a byte-level BPE tokenizer on FILES")
    train.add_argument("files", metavar="FILES", nargs="+", help="UTF-8 text files to learn merges from")
    train.add_argument(
        "--vocab-size",
        type=positive(int),
        required=True,
        metavar="N",
        help="tokens in all: 256 bytes, <|endoftext|> and N - 257 merges (at most)",
    )
    train.add_argument("-o", "--output", required=True, metavar="DIR", help="writes DIR/tokenizer.json")
    train.add_argument(
        "--min-frequency",
        type=positive(int),
        default=2,
        metavar="K",
        help="a pair merges only if it occurs at least K times (default 2)",
    )
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from mpmd.recipes.data import tokenizer

    try:
        path = tokenizer.train_bpe(args.files, args.vocab_size, args.output, args.min_frequency)
        tok = tokenizer.load(str(path))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}: byte-level BPE, {tok.vocab_size} tokens, eos id {tok.eos_id}, hash {tok.hash}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
