"""`mpmd generate RUN_DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --step S
--seed N --no-cache]`: continue a prompt with a trained run's model (recipes/run/generate.py), or
with a Hugging Face Llama directory's: `mpmd generate hf:DIR --prompt TEXT` (what `mpmd export`
writes; sampling defaults are then the schema's).

Prints the prompt and its continuation on stdout, and on stderr one line with the step it
restored, the new tokens and tokens/s (decoding alone; compiling its two programs is timed
apart). Sampling defaults are the run's own (train.sample_temperature, train.sample_top_k,
seed), so `mpmd generate RUN_DIR --prompt P` draws what the end-of-run sample would from P.
Exit status 0, or 2 with one line "error: ..." for a run directory that does not exist or
holds no committed checkpoint, a --step not committed, a model kind that cannot generate.
Runs on this process alone: no worker starts.
"""

from __future__ import annotations

import argparse
import sys
import time
from mpmd.recipes.commands.arguments import non_negative


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd generate",
        description="Continue a prompt with the model of a run directory of `mpmd train`.",
        epilog='example: mpmd generate runs/gpt_tiny --prompt "def __init__(self" --temperature 0',
    )
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a run directory of `mpmd train` (its config.yaml "
        "and checkpoints/), or hf:DIR, a Hugging Face model "
        "directory (config.json, safetensors, tokenizer.json)",
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument(
        "--max-new-tokens", type=non_negative(int), default=200, metavar="N", help="tokens to generate (default 200)"
    )
    parser.add_argument(
        "--temperature",
        type=non_negative(float),
        default=None,
        metavar="T",
        help="divides the logits before sampling; 0 = greedy (default: the run's train.sample_temperature)",
    )
    parser.add_argument(
        "--top-k",
        type=non_negative(int),
        default=None,
        metavar="K",
        help="sample among the K likeliest tokens; 0 = all (default: the run's train.sample_top_k)",
    )
    parser.add_argument(
        "--step",
        type=non_negative(int),
        default=None,
        metavar="S",
        help="the committed checkpoint to restore (default: the newest)",
    )
    parser.add_argument(
        "--seed", type=non_negative(int), default=None, help="seeds the sampling, >= 0 (default: the run's seed)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message: rendered with the tokenizer's chat template "
        "(tokenizer_config.json), the reply printed up to its end-of-text token",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="run the whole window through the model for every token instead of the "
        "key-value cache (same tokens, slower: for comparison)",
    )
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from mpmd.recipes.config import ConfigError
    from mpmd.recipes.run import generate  # imports JAX on use only

    try:
        cfg, step, model = generate.load_run(args.run_dir, args.step)
        t = cfg.train
        from mpmd.models import decoding

        decoder = decoding.Decoder(model)
        t0 = time.perf_counter()
        decoder.warm_up(cache=not args.no_cache)
        t1 = time.perf_counter()
        tokenizer = generate.tokenizer_of(args.run_dir)
        text, num_new = generate.continue_text(
            model,
            tokenizer,
            args.prompt,
            args.max_new_tokens,
            t.sample_temperature if args.temperature is None else args.temperature,
            t.sample_top_k if args.top_k is None else args.top_k,
            cfg.seed if args.seed is None else args.seed,
            cache=not args.no_cache,
            decoder=decoder,
            chat=args.chat,
        )
        t2 = time.perf_counter()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    decode_s = t2 - t1
    where = args.run_dir if step is None else f"step {step} of {args.run_dir}"
    print(
        f"{where}: {num_new} new tokens in {decode_s:.2f} s "
        f"({num_new / decode_s if decode_s > 0 else float('inf'):.1f} tokens/s, "
        f"{'no cache' if args.no_cache else 'key-value cache'}; compiled in {t1 - t0:.2f} s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
