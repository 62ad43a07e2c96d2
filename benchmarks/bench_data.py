"""The data pipeline's cost: tokens/s of the Grain pipeline alone, and how long a training
step waits for its batch, as a fraction of the step.

    .venv/bin/python benchmarks/bench_data.py [--tokens 20000000] [--steps 8] [--skip-train]

a. A corpus of --tokens byte tokens (documents of 50..4,000 bytes of random words, written by
   recipes/data/tokens.py as `mpmd tokenize` writes it, in shards of 10^7 tokens) is opened
   with its index alone (the time does not grow with its size) and with every shard verified
   against its digest (what a run's loaders do: one read of the corpus), and read by
   the loader configs/gpt_small.yaml's batches take (32 rows of 128 + 1 tokens): batches/s and
   tokens/s of the Grain pipeline alone (shuffled windows; packed documents), after a warm-up
   of 3 batches, over 200 batches each.
b. configs/gpt_small.yaml with data.source=tokens on that corpus (LocalCluster, 2 workers,
   interleaved 1F1B, 8 microbatches), --steps steps, no eval, sample or checkpoint: the time
   the training loop spends inside the loader's next() (the data wait: the loop sends nothing
   while it waits, though the slices may still run the step sent before) against the wall
   time from step 1's record to the last one's (step 1 compiles and is left out). Goal < 2 %.
c. A new train loader's CPU: the process's CPU seconds (every thread's) to open a shuffled-
   window iterator, take --first batches and let its read-ahead settle (0.5 s), with Grain's
   default read options (16 threads, 500 elements ahead; the loaders' before 2026-12-08)
   against the loaders' own (recipes/data/grain.py _read_options), for 8 x 128 + 1 rows
   (gpt_tiny's batch size) and 32 x 128 + 1 (gpt_small's). Interleaved rounds, both in each,
   Grain's defaults first: their read-ahead still running is counted to the loaders', against
   them. The batches of both are checked equal. A run, a resume and each evaluation's
   batch_at open one such iterator.
"""

from __future__ import annotations

import cpu_setup  # noqa: I001  (first: before anything imports jax)

REPO = cpu_setup.before_jax(devices=2)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

WORDS = ["the", "model", "pipeline", "stage", "slice", "token", "batch", "grain", "é", "\n"]


def write_corpus(out: Path, num_tokens: int) -> Path:
    """~num_tokens byte tokens in documents of 50..4,000 bytes, as a .jsonl then tokenized."""
    from mpmd.recipes.data import tokenizer
    from mpmd.recipes.data import tokens

    rng = np.random.default_rng(0)
    words = np.array(WORDS)
    src = out / "docs.jsonl"
    with src.open("w") as f:
        written = 0
        while written < num_tokens:
            text = " ".join(words[rng.integers(0, len(words), int(rng.integers(10, 800)))])
            text = text[:4000]
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())
    tokens.write([src], out / "corpus", tokenizer.load("bytes"), shard_tokens=10_000_000)
    return out / "corpus"


def pipeline_alone(corpus: Path, pack: bool, num_batches: int = 200) -> dict:
    import grain  # noqa: F401  (its import, and JAX's under it, is no part of opening a corpus)

    from mpmd.recipes import config
    from mpmd.recipes.data import grain as grain_data

    t0 = time.perf_counter()
    cfg = config.load(
        "configs/gpt_small.yaml", ["data.source=tokens", f"data.path={corpus}", f"data.pack={str(pack).lower()}"]
    )
    loader, _ = grain_data.loaders(cfg)
    open_s = time.perf_counter() - t0
    for _ in range(3):
        loader.next()
    t0 = time.perf_counter()
    for _ in range(num_batches):
        loader.next()
    wall_s = time.perf_counter() - t0
    rows, seq = cfg.train.batch_size, cfg.model.seq_len
    return {"open_s": open_s, "batches_per_s": num_batches / wall_s, "tokens_per_s": num_batches * rows * seq / wall_s}


def new_loader_cpu(corpus: Path, rounds: int, first: int) -> dict:
    """{rows: {"grain defaults" | "loaders": [CPU s per round]}} for part c."""
    import grain

    from mpmd.recipes.data import grain as grain_data
    from mpmd.recipes.data import tokens

    c = tokens.Corpus(corpus)
    out = {}
    for rows in (8, 32):
        kinds = {"grain defaults": grain.ReadOptions(), "loaders": None}
        cpu = {k: [] for k in kinds}
        for _ in range(rounds):
            seen = {}
            for kind, options in kinds.items():
                t0 = time.process_time()
                train, _ = grain_data.datasets(c, 128, rows, 0, 0.05, False, read_options=options)
                it = iter(train)
                seen[kind] = [next(it)[0] for _ in range(first)]
                time.sleep(0.5)
                cpu[kind].append(time.process_time() - t0)
                del it
            a, b = seen.values()
            assert all(np.array_equal(x, y) for x, y in zip(a, b)), "the two read options gave other batches"
        out[rows] = cpu
    return out


def data_wait(corpus: Path, steps: int, run_dir: Path) -> dict:
    """Trains gpt_small on the corpus, timing every train_loader.next() of the loop."""
    from mpmd.recipes import config
    from mpmd.recipes.data import grain as grain_data
    from mpmd.recipes.run import run_log
    from mpmd.recipes.run import train

    waits: list[float] = []
    make = grain_data.loaders

    def timed_loaders(cfg):
        train_loader, eval_loader = make(cfg)
        untimed = train_loader.next

        def next_batch():
            t0 = time.perf_counter()
            batch = untimed()
            waits.append(time.perf_counter() - t0)
            return batch

        train_loader.next = next_batch
        return train_loader, eval_loader

    grain_data.loaders = timed_loaders
    try:
        cfg = config.load(
            "configs/gpt_small.yaml",
            [
                "data.source=tokens",
                f"data.path={corpus}",
                f"train.steps={steps}",
                "train.eval_every=0",
                "train.sample_tokens=0",
                "checkpoint.every=0",
                "log.trace_steps=[]",
                "log.tensorboard=false",
                "log.progress=lines",
                f"run_dir={run_dir}",
            ],
        )
        train.run(cfg)
    finally:
        grain_data.loaders = make
    records = run_log.read(run_dir)
    wall_s = records[-1]["time"] - records[0]["time"]
    # Batch k + 1 is fetched while step k runs (run-ahead): waits[1:] are the batches of steps 2..N.
    wait_s = sum(waits[1:])
    return {
        "steps": len(records) - 1,
        "wall_s": wall_s,
        "wait_s": wait_s,
        "fraction": wait_s / wall_s,
        "median_wait_ms": 1e3 * float(np.median(waits[1:])),
        "step_s": wall_s / (len(records) - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-train", action="store_true", help="parts a and c only")
    parser.add_argument(
        "--rounds", type=int, default=5, help="part c's rounds (both read options in each, Grain's defaults first)"
    )
    parser.add_argument("--first", type=int, default=20, help="part c: batches taken from each new loader")
    args = parser.parse_args()
    os.chdir(REPO)
    print(f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        corpus = write_corpus(Path(tmp), args.tokens)
        from mpmd.recipes.data import tokens

        written_s = time.perf_counter() - t0
        opens = {}
        for verify in (False, True, False, True):  # interleaved, the second of each kept (files cached)
            t0 = time.perf_counter()
            c = tokens.Corpus(corpus, verify=verify)
            opens[verify] = time.perf_counter() - t0
        size = sum((corpus / s[k]).stat().st_size for s in c.index["shards"] for k in ("tokens", "offsets"))
        print(
            f"a. corpus: {c.num_tokens:,} tokens, {c.num_documents:,} documents, {len(c.index['shards'])} shards "
            f"(written in {written_s:.1f} s)\n"
            f"   opened: index only {opens[False] * 1e3:.1f} ms; with every shard's sha256 and offsets verified "
            f"{opens[True] * 1e3:.0f} ms ({size / opens[True] / 1e9:.2f} GB/s of {size / 1e6:.0f} MB, page cache warm)"
        )
        for pack in (False, True):
            r = pipeline_alone(corpus, pack)
            print(
                f"   {'packed documents' if pack else 'shuffled windows'}: opened in {r['open_s'] * 1e3:.0f} ms; "
                f"{r['batches_per_s']:.0f} batches/s of 32 x 128, {r['tokens_per_s'] / 1e6:.2f} M tokens/s"
            )
        for rows, cpu in new_loader_cpu(corpus, args.rounds, args.first).items():
            old, new = (float(np.median(cpu[k])) for k in ("grain defaults", "loaders"))
            spread = lambda k: f"{min(cpu[k]):.2f}-{max(cpu[k]):.2f}"
            print(
                f"c. a new loader, {rows} x 128 rows, {args.first} batches: CPU {new:.2f} s ({spread('loaders')}) "
                f"against Grain's defaults {old:.2f} s ({spread('grain defaults')}), {new / old:.2f}x, "
                f"medians of {args.rounds} interleaved rounds"
            )
        if not args.skip_train:
            r = data_wait(corpus, args.steps, Path(tmp) / "run")
            print(
                f"b. gpt_small, {r['steps']} steps after the first: {r['step_s']:.2f} s a step; data wait "
                f"{r['wait_s'] * 1e3:.1f} ms in all (median {r['median_wait_ms']:.2f} ms a batch) = "
                f"{100 * r['fraction']:.3f} % of the steps' wall time (goal < 2 %)"
            )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
