"""Helpers for tests that start real processes: worker liveness and the `mpmd train` command."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from runtime.local import process_alive as alive

ROOT = Path(__file__).resolve().parent.parent
# Small enough that a run is mostly process start-up; data.max_bytes keeps corpus reading short.
TINY_GPT = ["model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.seq_len=16",
            "train.batch_size=8", "train.eval_batches=2", "data.max_bytes=300000",
            "log.progress=lines", "log.every=1"]


def wait_gone(pids, timeout_s=10.0) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to `timeout_s` for all to exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def mpmd_train(*args, timeout=120):
    """`python -m recipes.cli train ARGS` on the CPU with 4 host devices; the CompletedProcess."""
    env = dict(os.environ)  # carries conftest's JAX compilation cache settings
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "recipes.cli", "train", *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
