"""What the in-memory checkpoint tier costs a step through `mpmd train`, as a user runs it:
`checkpoint.memory_every=1` against the same run without it, in interleaved rounds.

    .venv/bin/python benchmarks/bench_memory_tier.py [--rounds 3] [--config configs/gpt_tiny.yaml]
        [--steps 40] [key=value ...]

Each round runs the config twice (a fresh controller and local workers each time), in
alternating order, and takes the median of metrics.jsonl's step_s over steps 11..steps (the
first ten hold compilation and warm-up). Prints per round and overall: the median step with
the tier, without it, and their ratio; the overall figure is the median of the per-round
ratios, with their spread. Extra key=value overrides apply to both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mpmd.recipes.run import run_log  # noqa: E402

CASES = {"memory_every=1": ["checkpoint.memory_every=1"], "without": ["checkpoint.memory_every=0"]}


def median_step(config: str, steps: int, extra: list[str], run_dir: Path) -> float:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mpmd.recipes.cli",
            "train",
            config,
            f"train.steps={steps}",
            *extra,
            f"run_dir={run_dir}",
        ],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        check=True,
        capture_output=True,
    )
    return statistics.median(r["step_s"] for r in run_log.read(run_dir) if r["step"] > 10)


def measure(config: str, rounds: int, steps: int, overrides: list[str]) -> list[float]:
    """Per round, the median step with the tier over the median without; printed as it goes."""
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        for r in range(rounds):
            got = {}
            for case in list(CASES) if r % 2 else list(reversed(CASES)):
                n += 1
                got[case] = median_step(config, steps, [*overrides, *CASES[case]], Path(tmp) / f"r{n}")
            ratios.append(got["memory_every=1"] / got["without"])
            print(
                f"round {r}: memory_every=1 {got['memory_every=1'] * 1e3:.1f} ms, without {got['without'] * 1e3:.1f} "
                f"ms: {ratios[-1]:.3f}x",
                flush=True,
            )
    print(
        f"memory_every=1 / without ({config}): median {statistics.median(ratios):.3f}x "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(ratios)} rounds"
    )
    return ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    measure(args.config, args.rounds, args.steps, args.overrides)


if __name__ == "__main__":
    main()
