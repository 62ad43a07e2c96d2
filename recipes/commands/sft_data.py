"""`mpmd sft-data -o DIR [--task add|reverse] [--train N] [--heldout N] [--seed S]`: a fine-tuning
data set this repo makes itself (nothing downloaded), as the jsonl `data.source: jsonl` reads.

    mpmd sft-data -o data/sft                         # data/sft/train.jsonl, data/sft/heldout.jsonl
    mpmd train configs/llama_sft.yaml

Tasks, each line {"prompt": ..., "response": ...}:
- add: "37+45=" -> "82", both numbers uniform in 0..99;
- reverse: "reverse kqzt:" -> "tzqk", 3 to 6 lowercase letters.
The held-out examples' prompts are none of the training ones, so exact match on them measures
what was learnt, not what was seen. Deterministic from --seed.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from pathlib import Path

import numpy as np
from mpmd.recipes.commands.arguments import non_negative, positive
from mpmd.recipes.files import publish


def _add(rng: np.random.Generator) -> tuple[str, str]:
    a, b = (int(v) for v in rng.integers(0, 100, 2))
    return f"{a}+{b}=", str(a + b)


def _reverse(rng: np.random.Generator) -> tuple[str, str]:
    word = "".join(rng.choice(list(string.ascii_lowercase), int(rng.integers(3, 7))))
    return f"reverse {word}:", word[::-1]


TASKS = {"add": _add, "reverse": _reverse}


def make(task: str, num_train: int, num_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out) examples of `task`, their prompts distinct (ValueError when the task
    has too few different ones)."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    rng, seen, out = np.random.default_rng(seed), set(), []
    for _ in range(20 * (num_train + num_heldout)):
        if len(out) == num_train + num_heldout:
            break
        prompt, response = TASKS[task](rng)
        if prompt not in seen:
            seen.add(prompt)
            out.append({"prompt": prompt, "response": response})
    else:
        raise ValueError(f"task {task!r} has fewer than {num_train + num_heldout} different prompts; ask for fewer")
    return out[num_heldout:], out[:num_heldout]


def write(out_dir, train: list[dict], heldout: list[dict]) -> tuple[Path, Path]:
    out = Path(out_dir)
    paths = out / "train.jsonl", out / "heldout.jsonl"
    for path, examples in zip(paths, (train, heldout)):  # each replaced whole, or left as it was
        publish(path, "".join(json.dumps(e) + "\n" for e in examples))
    return paths


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd sft-data",
        description="Write a generated fine-tuning data set "
        "(train.jsonl, heldout.jsonl) that data.source=jsonl trains on.",
        epilog="example: mpmd sft-data -o data/sft && mpmd train configs/llama_sft.yaml",
    )
    parser.add_argument("-o", "--out", required=True, metavar="DIR", help="directory to write the two files into")
    parser.add_argument(
        "--task", default="reverse", choices=sorted(TASKS), help="what the examples ask (default reverse)"
    )
    parser.add_argument(
        "--train", type=positive(int), default=4000, metavar="N", help="training examples (default 4000)"
    )
    parser.add_argument(
        "--heldout", type=non_negative(int), default=200, metavar="N", help="held-out examples (default 200)"
    )
    parser.add_argument("--seed", type=non_negative(int), default=0, help="seeds the examples (default 0)")
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.train < 1 or args.heldout < 1:
        print(f"error: --train and --heldout must be >= 1, got {args.train} and {args.heldout}", file=sys.stderr)
        return 2
    try:
        train, heldout = make(args.task, args.train, args.heldout, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = write(args.out, train, heldout)
    print(f"wrote {len(train)} examples to {paths[0]} and {len(heldout)} to {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
