"""The recipe's registries: model families and cluster backends, each one registration.

After torchtitan's `register_train_spec(TrainSpec(...))`: a family is a `ModelSpec` (its
config section, how to build it, how it splits into stages, the data it trains on and its
loss), a backend a `BackendSpec` (its config section and how it builds its Cluster). The
config schema, the recipe (recipes/run/train.py), the data (recipes/data/loaders.py) and the planner ask
`get_model_spec(cfg.model.kind)` / `get_backend_spec(cfg.cluster.backend)`; nothing else in
the tree names a family or a backend. The built-in ones are registered by the modules of
recipes/families/ and recipes/backends/; a user's own by a module the config lists under
`imports:` (recipes/config/loading.py loads them before it validates).

Nothing here imports JAX: a config is checked before JAX is imported, so a spec's section and
problems are plain pydantic and Python, and its builders import what they need when called.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from mpmd.recipes.config import Config


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model family.

    name: model.kind's value. section: the pydantic section of model.* keys it takes (a
    recipes.config.ModelSection whose `kind` is Literal[name]). build(cfg, abstract) -> a
    model with `.layers()`, a list of stages, or either paired with its loss as
    (built, loss_fn); `abstract`: shapes only (mpmd.abstract), where can_be_abstract(cfg).
    loss(cfg) -> the loss_fn(outputs, targets) used when build gives none. split(cfg, built,
    sample_input) -> the stages, or None for the usual split (pipeline.cuts, else balanced by
    cost; recipes.run.build.split_stages); units(cfg, built) -> what `mpmd tune` cuts stages from,
    or None for `.layers()` / the list. sources(cfg) -> (train, eval) data sources
    (recipes.data). tokens_per_example(cfg): what one example counts for in tokens/s.
    samples_text: its logits decode to bytes, so a run ends with a sample. rules: logical
    axis -> mesh axis its parameters need beyond mpmd.stages.sharding.RULES (mesh.rules
    override them). problems(cfg) -> sentences naming what is wrong across sections (a
    section's own bounds are its fields'). state_metrics(cfg) -> None, or a reader
    read(step, state) -> dict that the recipe calls on eval steps with its stages' state
    ({path in the model: host array}) and merges into the step's metrics record. active_params(cfg, sizes) ->
    the parameters one token uses (a mixture's routed experts count top_k of num_experts),
    from {parameter path: size}; None where that is every parameter. init_params(cfg) -> None (the built model's own
    initial values), or what mpmd.Trainer(init_params=...) takes: a function from a stage's
    parameter paths to their initial arrays (a pretrained checkpoint's, e.g. llama's
    model.init_from); the model is then built abstract where it can be."""

    name: str
    section: type
    build: Callable[["Config", bool], Any]
    loss: Callable[["Config"], Callable]
    sources: Callable[["Config"], tuple]
    tokens_per_example: Callable[["Config"], int]
    split: Callable[["Config", Any, Any], list | None] = lambda cfg, built, sample_input: None
    units: Callable[["Config", Any], list | None] = lambda cfg, built: None
    can_be_abstract: Callable[["Config"], bool] = lambda cfg: True
    samples_text: bool = False
    rules: dict = dataclasses.field(default_factory=dict)
    problems: Callable[["Config"], list[str]] = lambda cfg: []
    state_metrics: Callable[["Config"], Callable | None] = lambda cfg: None
    active_params: Callable[["Config", dict], int | None] = lambda cfg, sizes: None
    init_params: Callable[["Config"], Callable | None] = lambda cfg: None


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A cluster backend.

    name: cluster.backend's value. section: the pydantic section of cluster.* keys it takes
    (a recipes.config.ClusterSection whose `backend` is Literal[name]). build(cfg, timeouts)
    -> its Cluster (workers start when the Trainer starts it); `timeouts` holds
    step_timeout_s and, where given, failure_timeout_s and transport (cluster.transport). worker_processes: its slices are
    worker processes (what `mpmd tune` measures on); gangs: it can make a slice of several
    processes (cluster.processes_per_slice > 1); in_process_devices: its slices take this process's devices (the command line
    makes them before JAX starts). problems(cfg) -> sentences naming what is wrong across
    sections."""

    name: str
    section: type
    build: Callable[["Config", dict], Any]
    worker_processes: bool = True
    gangs: bool = False
    in_process_devices: bool = False
    problems: Callable[["Config"], list[str]] = lambda cfg: []


# -- parts most families' specs are made of (each imports Flax or the data only when called) --
def flax_build(make: Callable[["Config", Any], Any]) -> Callable[["Config", bool], Any]:
    """A ModelSpec.build from make(cfg, rngs) -> a Flax NNX model: seeded with cfg.seed, built
    as shapes only (mpmd.abstract) when `abstract`."""

    def build(cfg: "Config", abstract: bool):
        from flax import nnx

        import mpmd

        def made():
            return make(cfg, nnx.Rngs(cfg.seed))

        return mpmd.abstract(made) if abstract else made()

    return build


def models_loss(name: str) -> Callable[["Config"], Callable]:
    """A ModelSpec.loss: the loss function mpmd.models.<name> (lm_loss, mse_loss, ...)."""

    def loss(cfg: "Config"):
        from mpmd import models

        return getattr(models, name)

    return loss


def data_sources(name: str) -> Callable[["Config"], tuple]:
    """A ModelSpec.sources: mpmd.recipes.data.loaders.<name>(cfg) (token_sources, regression_sources)."""

    def sources(cfg: "Config"):
        from mpmd.recipes.data import loaders as data

        return getattr(data, name)(cfg)

    return sources


def layers_problems(cfg: "Config", num_layers: int, layers: str) -> list[str]:
    """A pipeline cannot have more stages than the model has layers (`layers` says which)."""
    p = cfg.pipeline.num_stages
    if p > num_layers:
        return [f"pipeline.num_stages={p} is more than the {cfg.model.kind}'s {num_layers} layers ({layers})"]
    return []


_MODELS: dict[str, ModelSpec] = {}
_BACKENDS: dict[str, BackendSpec] = {}


def _register(table: dict, spec, what: str, key: str):
    name = spec.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {what}'s name must be a non-empty string, got {name!r}")
    if name in table and table[name] != spec:
        raise ValueError(f"{what} {name!r} is already registered (by {table[name].build.__module__})")
    field = spec.section.model_fields.get(key)
    if field is None or field.default != name:
        raise ValueError(f"{what} {name!r}: its section {spec.section.__name__} must have {key} = {name!r}")
    table[name] = spec
    return spec


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Makes model.kind=spec.name valid everywhere; ValueError if the name is taken."""
    return _register(_MODELS, spec, "model family", "kind")


def register_backend_spec(spec: BackendSpec) -> BackendSpec:
    """Makes cluster.backend=spec.name valid everywhere; ValueError if the name is taken."""
    return _register(_BACKENDS, spec, "cluster backend", "backend")


def _builtins() -> None:
    import mpmd.recipes.backends  # noqa: F401  (registers inprocess, local, static, ray, shared)
    import mpmd.recipes.families  # noqa: F401  (registers gpt, llama, mlp, custom)


def model_specs() -> dict[str, ModelSpec]:
    """name -> spec of every family, in registration order."""
    _builtins()
    return dict(_MODELS)


def backend_specs() -> dict[str, BackendSpec]:
    """name -> spec of every backend, in registration order."""
    _builtins()
    return dict(_BACKENDS)


def get_model_spec(kind: str) -> ModelSpec:
    specs = model_specs()
    if kind not in specs:
        raise ValueError(f"model.kind must be one of {one_of(specs)}, got {kind!r}")
    return specs[kind]


def get_backend_spec(backend: str) -> BackendSpec:
    specs = backend_specs()
    if backend not in specs:
        raise ValueError(f"cluster.backend must be one of {one_of(specs)}, got {backend!r}")
    return specs[backend]


def one_of(names) -> str:
    """'a', 'b' or 'c' (how pydantic lists a Literal's values)."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def import_module(name: str, key: str):
    """The user's module `name` (from the config's `key`), or ConfigError naming the key. The
    `mpmd` console script, unlike `python -m`, does not put the working directory on sys.path;
    a user's own module next to their config imports either way."""
    import importlib
    import os
    import sys

    from mpmd.recipes.config import ConfigError

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import {name!r}: {e}") from None
