"""A model family, a cluster backend and a schedule registered from outside mpmd, the way a
user's module does it; a config loads this module with `imports: [tests.support.registrations]`
(tests/recipes/test_registries.py). Nothing in mpmd names them: if a registry stops being the one place
the recipe, the config or the tuner asks, a run naming them fails."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd import schedules
from mpmd.recipes.config import ClusterSection, Config, ModelSection
from mpmd.recipes.registry import (
    BackendSpec,
    ModelSpec,
    flax_build,
    layers_problems,
    models_loss,
    register_backend_spec,
    register_model_spec,
)


class RampSection(ModelSection):
    kind: Literal["ramp"] = Field("ramp", description="which model to build")
    width: int = Field(8, gt=0, description="input and hidden width")
    depth: int = Field(2, gt=0, description="hidden layers")


def _ramp(cfg: Config, rngs):
    from mpmd import models

    return models.MLP(cfg.model.width, cfg.model.width, cfg.model.depth, 2, rngs=rngs)


def _sources(cfg: Config):
    from mpmd.recipes.data import loaders as data

    return data.SyntheticRegression(cfg.model.width, 2, 0), data.SyntheticRegression(cfg.model.width, 2, 1)


def _problems(cfg: Config) -> list[str]:
    return layers_problems(cfg, cfg.model.depth + 1, f"{cfg.model.depth} hidden + output")


RAMP = register_model_spec(
    ModelSpec(
        "ramp",
        RampSection,
        build=flax_build(_ramp),
        loss=models_loss("mse_loss"),
        sources=_sources,
        tokens_per_example=lambda cfg: 1,
        problems=_problems,
    )
)


class ThreadsSection(ClusterSection):
    backend: Literal["threads"] = Field("threads", description="where the slices run")
    label: str = Field("", description="a key only this backend takes")


def _cluster(cfg: Config, timeouts: dict):
    import mpmd

    return mpmd.InProcessCluster()


THREADS = register_backend_spec(
    BackendSpec("threads", ThreadsSection, build=_cluster, worker_processes=False, in_process_devices=True)
)


def gpipe_named(name: str):
    """A builder of GPipe under another name: a schedule the registry learns about."""
    return lambda num_stages, num_microbatches, virtual_stages: schedules.gpipe(num_stages, num_microbatches)._replace(
        name=name
    )


if "all-forward-first" not in schedules.SCHEDULES:
    schedules.register_schedule(schedules.ScheduleSpec("all-forward-first", gpipe_named("all-forward-first")))
