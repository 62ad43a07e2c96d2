"""cluster.backend='ray': workers are Ray actors on a Ray cluster (a placement group per
multi-host slice)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd.recipes.backends.local import ProcessesSection
from mpmd.recipes.config import Config
from mpmd.recipes.registry import BackendSpec, register_backend_spec


class RaySection(ProcessesSection):
    backend: Literal["ray"] = Field("ray", description="where the slices run")
    address: str | None = Field(
        None,
        description="the Ray cluster to join ('auto', 'HEAD_IP:6379', 'ray://head:10001'); "
        "null = $RAY_ADDRESS, else a new Ray instance on this machine",
    )
    resources: dict[str, float] = Field(
        {}, description="resources each worker reserves, e.g. {CPU: 1, GPU: 1}; CPU defaults to threads_per_worker"
    )
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="how long connecting to cluster.address may take before the run stops naming it "
        "(and a new worker's first answer)",
    )
    start_timeout_s: float = Field(
        120.0,
        gt=0,
        allow_inf_nan=False,
        description="how long the first start may take to place and start every worker actor (a "
        "replacement waits at most cluster.replace_timeout_s for Ray to place it)",
    )


def _problems(cfg: Config) -> list[str]:
    return [
        f"cluster.resources.{name}={amount:g} must be >= 0"
        for name, amount in cfg.cluster.resources.items()
        if amount < 0
    ]


def _build(cfg: Config, timeouts: dict):
    # Ray is optional: without it RayCluster raises RayMissingError (an ImportError), which
    # says how to install it; recipes/run/train.py reports it as this key's problem.
    from pathlib import Path
    import mpmd
    from mpmd.recipes.run import console

    c = cfg.cluster
    # Each actor's output goes to <run_dir>/logs/worker_<slot>.log, never through Ray to the
    # console; its records at the console level come back one line each (recipes/run/console.py).
    return mpmd.RayCluster(
        num_workers=cfg.num_workers,
        devices_per_worker=c.devices_per_worker,
        threads_per_worker=c.threads_per_worker,
        **timeouts,
        address=c.address,
        resources_per_worker=c.resources or None,
        processes_per_slice=c.processes_per_slice,
        connect_timeout_s=c.connect_timeout_s,
        start_timeout_s=c.start_timeout_s,
        log_dir=str(Path(cfg.run_dir) / "logs"),
        log_level=console.level(cfg.log.level),
    )


SPEC = register_backend_spec(BackendSpec("ray", RaySection, build=_build, gangs=True, problems=_problems))
