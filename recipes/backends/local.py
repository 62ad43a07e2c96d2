"""cluster.backend='local': worker processes started on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from mpmd.recipes.config import Config, WorkerSection
from mpmd.recipes.registry import BackendSpec, register_backend_spec


class ProcessesSection(WorkerSection):
    """What the backends that start worker processes themselves add (local here, ray)."""

    threads_per_worker: int = Field(1, gt=0, description="XLA/BLAS threads per worker process")


class LocalSection(ProcessesSection):
    backend: Literal["local"] = Field("local", description="where the slices run")
    start_timeout_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a worker, or every process of a slice's gang, may take to start",
    )
    max_workers: int | None = Field(
        None,
        gt=0,
        description="the most worker processes started over the run, replacements and hot "
        "spares included; null = no limit (a lost worker is always replaced)",
    )


def _problems(cfg: Config) -> list[str]:
    cl = cfg.cluster
    need = (cfg.num_workers + cl.hot_spares) * cl.processes_per_slice
    if cl.max_workers is not None and cl.max_workers < need:
        return [
            f"cluster.max_workers={cl.max_workers} must be at least the {need} worker process(es) the "
            f"slices{' and cluster.hot_spares' if cl.hot_spares else ''} need (or null)"
        ]
    return []


def _build(cfg: Config, timeouts: dict):
    import mpmd
    from mpmd.recipes.run import console

    c = cfg.cluster
    # Workers' logs and tracebacks go to <run_dir>/logs/worker_<slot>.log; their records at
    # the console level come back one line each (recipes/run/console.py).
    return mpmd.LocalCluster(
        num_workers=cfg.num_workers,
        devices_per_worker=c.devices_per_worker,
        threads_per_worker=c.threads_per_worker,
        **timeouts,
        max_workers=c.max_workers,
        processes_per_slice=c.processes_per_slice,
        start_timeout_s=c.start_timeout_s,
        log_dir=str(Path(cfg.run_dir) / "logs"),
        log_level=console.level(cfg.log.level),
    )


SPEC = register_backend_spec(BackendSpec("local", LocalSection, build=_build, gangs=True, problems=_problems))
