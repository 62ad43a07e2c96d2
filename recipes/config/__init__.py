"""The one typed schema for a training run: every default, its description, and its checks.

Config flow (after MaxText): defaults live in the schema and only there; a YAML file holds
only the keys it overrides; `key=value` arguments override the file; unknown keys are
rejected with the nearest valid key suggested; the resolved config is written to the run
directory (`dump`). Every check a user's config can fail runs in `load`, before any worker
starts, and raises `ConfigError` naming the key and what is allowed.

The parts, one idea each:
  schema.py     the sections, their defaults and descriptions, Config, MATH_KEYS
  problems.py   what is wrong across sections (the batch, the schedule, the mesh, addresses)
  loading.py    YAML file <- key=value overrides, key by key checks, validate, dump
  help_text.py  `--help-config`: every key as YAML with its default and description
"""

from mpmd.recipes.config.schema import (  # noqa: F401
    MATH_KEYS,
    MESH_AXES,
    CheckpointConfig,
    ClusterSection,
    Config,
    ConfigError,
    DataSection,
    LogConfig,
    MeshConfig,
    ModelSection,
    OptimizerConfig,
    PipelineConfig,
    PlanConfig,
    SliceShape,
    TrainConfig,
    TuneConfig,
    WorkerSection,
    math_changes,
)
from mpmd.recipes.config.problems import address_problem  # noqa: F401
from mpmd.recipes.config.loading import dump, load, validate, values_of  # noqa: F401
from mpmd.recipes.config.help_text import describe  # noqa: F401
