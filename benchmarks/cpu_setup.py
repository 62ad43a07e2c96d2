"""What every benchmark sets before JAX loads: the CPU platform, N simulated host devices in
this process (workers set their own), no Eigen thread pool (XLA:CPU would otherwise spread
one op over both cores and blur the side-by-side ratios), and the repository on sys.path so
`python benchmarks/bench_x.py` imports mpmd from this checkout.

    import cpu_setup  # noqa: I001  (first: before anything imports jax)
    REPO = cpu_setup.before_jax(devices=4)
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def before_jax(devices: int | None = None, eigen_threads: bool = False) -> Path:
    """Set the flags above (devices=None: leave the device count alone) and return the repo root."""
    if "jax" in sys.modules:
        raise RuntimeError("cpu_setup.before_jax must run before jax is imported")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [os.environ.get("XLA_FLAGS", "")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if not eigen_threads:
        flags.append("--xla_cpu_multi_thread_eigen=false")
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f).strip()
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return REPO


@contextlib.contextmanager
def stderr_to(path: Path):
    """This process's stderr (which the workers it starts inherit: Orbax's INFO lines) goes
    to `path` while inside."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
