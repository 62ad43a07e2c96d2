"""A model family, a cluster backend and a schedule registered from outside mpmd, the way a
user's module does it; a config loads this module with `imports: [tests.support.registrations]`
(tests/recipes/test_registries.py). Nothing in mpmd names them: if a registry stops being the one place
the recipe, the config or the tuner asks, a run naming them fails."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd import schedules
from mpmd.recipes.config import ClusterSection, Config, ModelSection
from mpmd.recipes.registry import BackendSpec, ModelSpec, register_backend_spec, register_model_spec


class RampSection(ModelSection):
    kind: Literal["ramp"] = Field("ramp", description="which model to build")
    width: int = Field(8, gt=0, description="input and hidden width")
    depth: int = Field(2, gt=0, description="hidden layers")


def _build(cfg: Config, abstract: bool):
    from flax import nnx

    import mpmd
    from mpmd import models
    m = cfg.model

    def make():
        return models.MLP(m.width, m.width, m.depth, 2, rngs=nnx.Rngs(cfg.seed))
    return mpmd.abstract(make) if abstract else make()


def _sources(cfg: Config):
    from mpmd.recipes import data
    return data.SyntheticRegression(cfg.model.width, 2, 0), data.SyntheticRegression(cfg.model.width, 2, 1)


def _loss(cfg: Config):
    from mpmd import models
    return models.mse_loss


def _problems(cfg: Config) -> list[str]:
    if cfg.pipeline.num_stages > cfg.model.depth + 1:
        return [f"pipeline.num_stages={cfg.pipeline.num_stages} is more than the ramp's {cfg.model.depth + 1} layers"]
    return []


RAMP = register_model_spec(ModelSpec("ramp", RampSection, build=_build, loss=_loss, sources=_sources,
                                     tokens_per_example=lambda cfg: 1, problems=_problems))


class ThreadsSection(ClusterSection):
    backend: Literal["threads"] = Field("threads", description="where the slices run")
    label: str = Field("", description="a key only this backend takes")


def _cluster(cfg: Config, timeouts: dict):
    import mpmd
    return mpmd.InProcessCluster()


THREADS = register_backend_spec(BackendSpec("threads", ThreadsSection, build=_cluster, worker_processes=False,
                                            in_process_devices=True))


def gpipe_named(name: str):
    """A builder of GPipe under another name: a schedule the registry learns about."""
    return lambda num_stages, num_microbatches, virtual_stages: \
        schedules.gpipe(num_stages, num_microbatches)._replace(name=name)


if "all-forward-first" not in schedules.SCHEDULES:
    schedules.register_schedule(schedules.ScheduleSpec("all-forward-first", gpipe_named("all-forward-first")))
