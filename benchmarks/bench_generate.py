"""What the key-value cache buys `mpmd generate`: tokens/s with it against a full forward of the
window per token (`--no-cache`), side by side in one run.

    .venv/bin/python benchmarks/bench_generate.py [--configs gpt_tiny gpt_small llama_tiny]
        [--tokens N] [--rounds N]

Per config: a run directory made by one training step (`mpmd train CONFIG train.steps=1` on
the in-process backend; the weights' values do not change the cost), then what `mpmd generate
RUN_DIR` runs: the checkpoint restored on this process (recipes/run/generate.py), both programs
of each variant compiled first (not timed), then `--tokens` new tokens from the prompt
"def __init__(self" sampled at the run's temperature and top-k, timed per variant, the two
alternating within each of `--rounds` rounds; medians. The tokens are checked to be the same
for both variants (same seed). With seq_len tokens in a window, the cache's step attends over
seq_len slots where a full forward runs seq_len tokens through every layer, so the ratio grows
with seq_len; each window shift (every seq_len / 2 tokens) costs the cached variant one prefill.

The load average is printed at the start and end: on a 2-core machine other processes move
every figure.
"""

from __future__ import annotations

import cpu_setup  # noqa: E402  (first: sets the flags before anything imports jax)

cpu_setup.before_jax(devices=4)

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

PROMPT = "def __init__(self"
VARIANTS = {"key-value cache": True, "full forward per token": False}


def make_run(config_name: str, run_dir: str) -> None:
    """One training step of configs/<config_name>.yaml, so run_dir holds a committed checkpoint."""
    from mpmd.recipes import config
    from mpmd.recipes.run import train

    cfg = config.load(
        str(cpu_setup.REPO / "configs" / f"{config_name}.yaml"),
        [
            "train.steps=1",
            "train.eval_every=0",
            "train.sample_tokens=0",
            "checkpoint.every=0",
            "log.tensorboard=false",
            "log.trace_steps=[]",
            "log.progress=lines",
            "data.max_bytes=300000",
            "cluster.backend=inprocess",
            f"run_dir={run_dir}",
        ],
    )
    train.run(cfg)
    logging.disable(logging.INFO)  # Orbax's and absl's records of the save, once the run set them up


def measure(run_dir: str, num_tokens: int, rounds: int) -> dict:
    """variant -> (median s for num_tokens tokens, their tokens); plus the run's config."""
    from mpmd.models import decoding
    from mpmd.recipes.run import generate

    cfg, _, model = generate.load_run(run_dir)
    tokenizer = generate.tokenizer_of(run_dir)
    decoders = {name: decoding.Decoder(model) for name in VARIANTS}
    for name, cache in VARIANTS.items():
        decoders[name].warm_up(cache)
    times, texts = {name: [] for name in VARIANTS}, {}
    t = cfg.train
    for _ in range(rounds):
        for name, cache in VARIANTS.items():
            start = time.perf_counter()
            texts[name], _ = generate.continue_text(
                model,
                tokenizer,
                PROMPT,
                num_tokens,
                t.sample_temperature,
                t.sample_top_k,
                cfg.seed,
                cache=cache,
                decoder=decoders[name],
            )
            times[name].append(time.perf_counter() - start)
    assert len(set(texts.values())) == 1, "the cache changed the tokens"
    return {"cfg": cfg, **{name: statistics.median(ts) for name, ts in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["gpt_tiny", "gpt_small", "llama_tiny"])
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per generation")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    rows = []
    for name in args.configs:
        with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
            make_run(name, os.path.join(tmp, "run"))
            got = measure(os.path.join(tmp, "run"), args.tokens, args.rounds)
        m = got["cfg"].model
        rates = {v: args.tokens / got[v] for v in VARIANTS}
        rows.append(
            f"| {name} (d_model {m.d_model}, {m.num_layers} blocks, seq_len {m.seq_len}) | "
            + " | ".join(f"{rates[v]:.0f}" for v in VARIANTS)
            + f" | {rates['key-value cache'] / rates['full forward per token']:.2f} |"
        )
        print(rows[-1], flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    print(f"\n{args.tokens} new tokens, median of {args.rounds} rounds, tokens/s:\n")
    print("| config | " + " | ".join(VARIANTS) + " | cache / full |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
