"""A model family, a data source, a cluster backend and a schedule registered from outside
mpmd, the way a user's module does it; a config loads this module with `imports:
[tests.support.registrations]` (tests/recipes/test_registries.py). Nothing in mpmd names them:
if a registry stops being the one place the recipe, the config or the tuner asks, a run naming
them fails."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from mpmd import schedules
from mpmd.recipes.config import ClusterSection, Config, DataSection, ModelSection
from mpmd.recipes.data.loaders import loaders_of
from mpmd.recipes.registry import (
    REGRESSION,
    TOKEN_WINDOWS,
    BackendSpec,
    DataSourceSpec,
    ModelSpec,
    flax_build,
    layers_problems,
    models_loss,
    register_backend_spec,
    register_data_source,
    register_model_spec,
)


class RampSection(ModelSection):
    kind: Literal["ramp"] = Field("ramp", description="which model to build")
    width: int = Field(8, gt=0, description="input and hidden width")
    depth: int = Field(2, gt=0, description="hidden layers")

    # What the synthetic source's regression pairs are sized by.
    in_features = property(lambda self: self.width)
    out_features = property(lambda self: 2)


def _ramp(cfg: Config, rngs):
    from mpmd import models

    return models.MLP(cfg.model.width, cfg.model.width, cfg.model.depth, 2, rngs=rngs)


def _problems(cfg: Config) -> list[str]:
    return layers_problems(cfg, cfg.model.depth + 1, f"{cfg.model.depth} hidden + output")


RAMP = register_model_spec(
    ModelSpec(
        "ramp",
        RampSection,
        build=flax_build(_ramp),
        loss=models_loss("mse_loss"),
        reads=(REGRESSION,),
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


class CountingData(DataSection):
    source: Literal["counting"] = Field("counting", description="where the training data comes from")
    start: int = Field(0, ge=0, description="the first token of every row")


class Counting:
    """Rows start, start + 1, ... (mod the vocabulary): a pure function of the batch index."""

    num_examples = None

    def __init__(self, start, vocab_size, seq_len):
        self.start, self.vocab_size, self.seq_len = start, vocab_size, seq_len

    def batch(self, seed, index, batch_size):
        rows = (self.start + index + np.arange(batch_size)[:, None] + np.arange(self.seq_len + 1)) % self.vocab_size
        rows = rows.astype(np.int32)
        return rows[:, :-1], rows[:, 1:]


def _loaders(cfg, kind):
    m = cfg.model
    return loaders_of(cfg, Counting(cfg.data.start, m.vocab_size, m.seq_len), Counting(1, m.vocab_size, m.seq_len))


COUNTING = register_data_source(DataSourceSpec("counting", CountingData, gives=(TOKEN_WINDOWS,), loaders=_loaders))
