"""The recipe's registries: model families, data sources and cluster backends, each one
registration.

After torchtitan's `register_train_spec(TrainSpec(...))`: a family is a `ModelSpec` (its
config section, how to build it, how it splits into stages, the kinds of data it reads and
its loss), a data source a `DataSourceSpec` (its config section, its loaders, what it records
in every manifest and needs of the tokenizer), a backend a `BackendSpec` (its config section
and how it builds its Cluster). The config schema, the recipe (recipes/run/), the commands
and the planner ask `get_model_spec(cfg.model.kind)`, `get_data_source(cfg.data.source)`,
`get_backend_spec(cfg.cluster.backend)`; nothing else in the tree names a family, a source
or a backend. The built-in ones are registered by recipes/families/, recipes/data/sources.py
and recipes/backends/; a user's own by a module the config lists under `imports:`
(recipes/config/loading.py loads them before it validates).

Nothing here imports JAX: a config is checked before JAX is imported, so a spec's section and
problems are plain pydantic and Python, and its builders import what they need when called.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from mpmd.recipes.config import Config


# The kinds of data a source gives and a family reads.
TOKEN_WINDOWS = "token windows"  # (inputs, targets) int32 [batch, seq_len]: a sequence and the next tokens
PROMPT_RESPONSE = "prompt/response rows"  # a batch dict with a loss_mask over the response tokens
REGRESSION = "regression pairs"  # (x, y) float32 [batch, in_features], [batch, out_features]


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
    or None for `.layers()` / the list. reads: the kinds of data it trains on, in order of
    preference (a data source that gives none of them is refused). tokens_per_example(cfg): what one example counts for in tokens/s.
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
    reads: tuple[str, ...] = (TOKEN_WINDOWS,)


@dataclasses.dataclass(frozen=True)
class DataSourceSpec:
    """A data source.

    name: data.source's value. section: the pydantic section of data.* keys it takes (a
    recipes.config.DataSection whose `source` is Literal[name]). gives: the kinds of data it
    can give (TOKEN_WINDOWS, ...); the family's `reads` picks one. loaders(cfg, kind) ->
    (train, eval) loaders at position 0 of that kind, each with batch_at(i), next(), state()
    and restore(state) (recipes/data/loaders.py Loader). metadata(cfg) -> what every
    manifest records of the data beyond the config's values (a corpus's or tokenizer's
    content hash), so a resume on other data is refused. tokenizer(cfg) -> the tokenizer
    the source itself fixes (a tokenized corpus's), None where data.tokenizer says.
    problems(cfg) -> sentences naming what is wrong. text: its tokens decode to text (a run
    ends with a sample). byte_text: with data.tokenizer=bytes its tokens are the bytes 0..255.
    files(section) -> the text files it reads (what `mpmd tokenize` takes), None if it reads
    none. masks_loss(cfg): its batches carry a loss_mask (the loss is token-weighted).
    batch_digests: each step's batch CRC-32 goes into metrics.jsonl. held_out_examples: it
    holds prompt/response examples train.exact_match can score."""

    name: str
    section: type
    gives: tuple[str, ...]
    loaders: Callable[["Config", str], tuple]
    metadata: Callable[["Config"], dict] = lambda cfg: {}
    tokenizer: Callable[["Config"], Any] | None = None
    problems: Callable[["Config"], list[str]] = lambda cfg: []
    text: bool = False
    byte_text: bool = False
    files: Callable[[Any], list] | None = None
    masks_loss: Callable[["Config"], bool] = lambda cfg: False
    batch_digests: bool = False
    held_out_examples: bool = False


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


def layers_problems(cfg: "Config", num_layers: int, layers: str) -> list[str]:
    """A pipeline cannot have more stages than the model has layers (`layers` says which)."""
    p = cfg.pipeline.num_stages
    if p > num_layers:
        return [f"pipeline.num_stages={p} is more than the {cfg.model.kind}'s {num_layers} layers ({layers})"]
    return []


_MODELS: dict[str, ModelSpec] = {}
_SOURCES: dict[str, DataSourceSpec] = {}
_BACKENDS: dict[str, BackendSpec] = {}


def _register(table: dict, spec, what: str, key: str):
    name = spec.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {what}'s name must be a non-empty string, got {name!r}")
    if name in table and table[name] != spec:
        raise ValueError(f"{what} {name!r} is already registered (by {table[name].section.__module__})")
    field = spec.section.model_fields.get(key)
    if field is None or field.default != name:
        raise ValueError(f"{what} {name!r}: its section {spec.section.__name__} must have {key} = {name!r}")
    table[name] = spec
    return spec


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Makes model.kind=spec.name valid everywhere; ValueError if the name is taken."""
    return _register(_MODELS, spec, "model family", "kind")


def register_data_source(spec: DataSourceSpec) -> DataSourceSpec:
    """Makes data.source=spec.name valid everywhere; ValueError if the name is taken."""
    return _register(_SOURCES, spec, "data source", "source")


def register_backend_spec(spec: BackendSpec) -> BackendSpec:
    """Makes cluster.backend=spec.name valid everywhere; ValueError if the name is taken."""
    return _register(_BACKENDS, spec, "cluster backend", "backend")


def _builtins() -> None:
    import mpmd.recipes.backends  # noqa: F401  (registers inprocess, local, static, ray, shared)
    import mpmd.recipes.families  # noqa: F401  (registers gpt, llama, mlp, custom)
    import mpmd.recipes.data.sources  # noqa: F401  (registers stdlib, files, synthetic, tokens, jsonl)


def model_specs() -> dict[str, ModelSpec]:
    """name -> spec of every family, in registration order."""
    _builtins()
    return dict(_MODELS)


def data_sources() -> dict[str, DataSourceSpec]:
    """name -> spec of every data source, in registration order."""
    _builtins()
    return dict(_SOURCES)


def backend_specs() -> dict[str, BackendSpec]:
    """name -> spec of every backend, in registration order."""
    _builtins()
    return dict(_BACKENDS)


def get_model_spec(kind: str) -> ModelSpec:
    specs = model_specs()
    if kind not in specs:
        raise ValueError(f"model.kind must be one of {one_of(specs)}, got {kind!r}")
    return specs[kind]


def get_data_source(source: str) -> DataSourceSpec:
    specs = data_sources()
    if source not in specs:
        raise ValueError(f"data.source must be one of {one_of(specs)}, got {source!r}")
    return specs[source]


def data_kind(cfg: "Config") -> str:
    """The kind of data cfg's family reads from cfg's source (the first of the family's
    `reads` the source gives); ValueError naming both when there is none."""
    spec, source = get_model_spec(cfg.model.kind), get_data_source(cfg.data.source)
    for kind in spec.reads:
        if kind in source.gives:
            return kind
    fits = [name for name, s in data_sources().items() if set(s.gives) & set(spec.reads)]
    raise ValueError(
        f"data.source='{source.name}' gives {' or '.join(source.gives)}, which model.kind='{spec.name}' "
        f"does not read (it reads {' or '.join(spec.reads)}): data.source must be {one_of(fits)}"
    )


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
