"""A run's start when the controller uses JAX's persistent compilation cache, against one that
does not, in interleaved rounds of one run.

    .venv/bin/python benchmarks/bench_controller_cache.py [--rounds 5] [--config configs/gpt_tiny.yaml]

Each round runs `mpmd train CONFIG train.steps=2` twice, in alternating order, as a user
would (a fresh process, its own local workers), and times it from start to exit:

  cached   the command as shipped: `mpmd train` points JAX's persistent cache at the workers'
           directory before JAX starts (recipes/cli.py use_compilation_cache), so the model's
           initialisation, the stages' lowering and the sample's decoder come from the cache
  uncached JAX_COMPILATION_CACHE_DIR="" for the controller (the workers keep theirs): what
           every `mpmd train` paid before

Both use a fresh cache directory ($XDG_CACHE_HOME in a temporary directory), filled by one
warm-up run of each kind that is not counted: what a second run of the same config sees.
Prints per-kind medians, their spread (min-max) and cached / uncached.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_s(config: str, env: dict, run_dir: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "mpmd.recipes.cli", "train", config, "train.steps=2", f"run_dir={run_dir}"],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
        base.update(JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(Path(tmp) / "cache"))
        envs = {"cached": base, "uncached": dict(base, JAX_COMPILATION_CACHE_DIR="")}
        times: dict[str, list[float]] = {kind: [] for kind in envs}
        n = 0
        for r in range(args.rounds + 1):
            order = list(envs) if r % 2 else list(reversed(envs))
            for kind in order:
                n += 1
                seconds = run_s(args.config, envs[kind], Path(tmp) / f"run{n}")
                if r:  # round 0 warms the cache up
                    times[kind].append(seconds)
                print(f"round {r} {kind}: {seconds:.2f} s{' (warm-up)' if not r else ''}", flush=True)
    med = {kind: statistics.median(ts) for kind, ts in times.items()}
    for kind, ts in times.items():
        print(f"{kind:9s} median {med[kind]:.2f} s (min {min(ts):.2f}, max {max(ts):.2f}) over {len(ts)} runs")
    print(f"cached / uncached: {med['cached'] / med['uncached']:.2f}")


if __name__ == "__main__":
    main()
