"""cluster.backend='inprocess': every slice a thread of this process, on its own devices."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd.recipes.config import ClusterSection, Config
from mpmd.recipes import registry
from mpmd.recipes.registry import BackendSpec, register_backend_spec


class InProcessSection(ClusterSection):
    backend: Literal["inprocess"] = Field("inprocess", description="where the slices run")


def _problems(cfg: Config) -> list[str]:
    cl = cfg.cluster
    if cl.processes_per_slice > 1:
        gangs = [name for name, spec in registry.backend_specs().items() if spec.gangs]
        return [
            f"cluster.processes_per_slice={cl.processes_per_slice} needs worker processes: "
            f"cluster.backend {registry.one_of(gangs)}, got 'inprocess' (use 1)"
        ]
    return []


def _build(cfg: Config, timeouts: dict):
    import mpmd
    from mpmd.runtime.control.inprocess import meshes_for

    meshes_for(cfg.slice_shapes())  # each slice's devices, else say how to get more
    return mpmd.InProcessCluster()


SPEC = register_backend_spec(
    BackendSpec(
        "inprocess", InProcessSection, build=_build, worker_processes=False, in_process_devices=True, problems=_problems
    )
)
