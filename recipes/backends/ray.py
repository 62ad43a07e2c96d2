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
        None, description="the Ray cluster to join ('auto', 'HEAD_IP:6379', 'ray://head:10001'); "
                          "null = $RAY_ADDRESS, else a new Ray instance on this machine")
    resources: dict[str, float] = Field(
        {}, description="resources each worker reserves, e.g. {CPU: 1, GPU: 1}; CPU defaults to threads_per_worker")


def _problems(cfg: Config) -> list[str]:
    return [f"cluster.resources.{name}={amount:g} must be >= 0"
            for name, amount in cfg.cluster.resources.items() if amount < 0]


def _build(cfg: Config, timeouts: dict):
    # Ray is optional: without it RayCluster raises RayMissingError (an ImportError), which
    # says how to install it; recipes/train.py reports it as this key's problem.
    import mpmd
    c = cfg.cluster
    return mpmd.RayCluster(num_workers=cfg.num_workers, devices_per_worker=c.devices_per_worker,
                           threads_per_worker=c.threads_per_worker, **timeouts, address=c.address,
                           resources_per_worker=c.resources or None, processes_per_slice=c.processes_per_slice)


SPEC = register_backend_spec(BackendSpec("ray", RaySection, build=_build, gangs=True, problems=_problems))
