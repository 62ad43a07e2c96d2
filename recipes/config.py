"""The one typed schema for a training run: every default, its description, and its checks.

Config flow (after MaxText): defaults live here and only here; a YAML file holds only the keys
it overrides; `key=value` arguments override the file; unknown keys are rejected with the
nearest valid key suggested; the resolved config is written to the run directory (`dump`).
Every check a user's config can fail runs in `load`, before any worker starts, and raises
`ConfigError` naming the key and what is allowed.
"""

import copy
import difflib
import hashlib
import json
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from mpmd.recipes import registry
from mpmd.stages.mesh_axes import AXES, rule_problem
from mpmd.schedules import core as schedules


class ConfigError(ValueError):
    """A config the user wrote is invalid; the message names the key and what is allowed."""


class _Section(BaseModel):
    # strict: YAML already gives typed values, so "5" for an int is a mistake, not a coercion.
    model_config = ConfigDict(extra="forbid", strict=True)


class ModelSection(_Section):
    """model.*: the keys every family takes; each family's section (its ModelSpec's, in
    recipes/families/) adds its own, and model.kind picks the section."""
    kind: str = Field("gpt", description="which model to build (each family's own keys: its section in "
                                         "recipes/families/)", json_schema_extra={"one_of": "model"})


class DataConfig(_Section):
    source: Literal["stdlib", "files", "synthetic"] = Field(
        "stdlib", description="stdlib = this Python's own .py files as bytes; no download")
    paths: list[str] = Field([], description="files source: file paths, directories or globs")
    eval_fraction: float = Field(
        0.05, gt=0, lt=1, description="last fraction of the byte corpus held out for eval")
    max_bytes: int = Field(8_000_000, gt=0, description="byte corpus cap, keeps startup fast")


class TrainConfig(_Section):
    steps: int = Field(200, gt=0, description="optimizer steps; step k is the k-th update")
    batch_size: int = Field(16, gt=0, description="sequences (or examples) per global batch")
    eval_every: int = Field(50, ge=0, description="eval every N steps and at the end; 0 = never")
    eval_batches: int = Field(4, gt=0, description="batches averaged per eval")
    sample_tokens: int = Field(200, ge=0, description="sample length in tokens at the end; 0 = none")
    sample_prompt: str = Field("def ", description="text the final sample continues")
    sample_temperature: float = Field(
        0.8, ge=0, description="divides the logits before sampling; 0 = greedy (argmax)")
    sample_top_k: int = Field(40, ge=0, description="sample among the k likeliest tokens; 0 = all")
    run_ahead: int = Field(
        1, ge=0, description="steps sent to the slices ahead of the one running (each queues "
                             "behind it, hiding the gap between steps); 0 = one step at a time")


class OptimizerConfig(_Section):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="optax optimizer")
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay; adamw only")
    b1: float = Field(0.9, ge=0, lt=1, description="adam beta1; sgd momentum (0 = plain sgd)")
    b2: float = Field(0.95, ge=0, lt=1, description="adam beta2; unused by sgd")
    warmup_steps: int = Field(
        20, ge=0, description="linear warmup from 0 to lr over this many steps, then constant")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="clip the global gradient norm to this; null = no clipping")


class PipelineConfig(_Section):
    num_stages: int = Field(2, gt=0, description="pipeline stages the model is split into")
    schedule: str = Field(
        "1f1b", description="order of forward/backward tasks on each slice",
        json_schema_extra={"one_of": "schedule"})
    num_microbatches: int = Field(4, gt=0, description="microbatches per global batch")
    virtual_stages: int = Field(
        1, gt=0, description="stages per slice: >= 2 for interleaved-1f1b, 2 for zb-v and dualpipe-v "
                             "(their V, the default for them), else 1")

    cuts: list[int] | None = Field(
        None, description="the layer (or, for a custom model's list of stages, the stage) where each "
                          "pipeline stage after the first begins, increasing; null = cut where the "
                          "stages' estimated costs balance (`mpmd tune` writes measured ones)")

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, name: str) -> str:
        return _known("pipeline.schedule", name, schedules.SCHEDULES)

    @model_validator(mode="after")
    def _schedule_default(self):
        if "virtual_stages" not in self.model_fields_set:     # not given: the schedule's own
            self.virtual_stages = schedules.default_virtual_stages(self.schedule)
        return self


class ClusterSection(_Section):
    """cluster.*: the keys every backend takes; each backend's section (its BackendSpec's, in
    recipes/backends/) adds its own, and cluster.backend picks the section."""
    backend: str = Field(
        "local", description="where the slices run (each backend's own keys: its section in recipes/backends/): "
                             "inprocess = threads; local = processes here; static = by address; "
                             "shared = slices leased from a persistent cluster (`mpmd cluster up`)",
        json_schema_extra={"one_of": "cluster"})
    num_workers: int | None = Field(
        None, gt=0, description="workers; null = num_stages // virtual_stages, the only valid one")
    devices_per_worker: int = Field(1, gt=0, description="JAX devices each worker owns")
    processes_per_slice: int = Field(
        1, gt=0, description="local, static, ray: worker processes (one per host) that together own one slice's "
                             "mesh of processes_per_slice x devices_per_worker devices; a lost one is a lost slice")
    step_timeout_s: float | None = Field(
        None, gt=0, description="abort a step with no progress for this long (a worker is lost); "
                                "null = max(60 s, 20 x the median recent step time)")
    # Their rules are mpmd.Recovery's (mpmd/train/options.py), checked by building one.
    on_loss: str = Field(
        "auto", description="a lost worker: replace = a new one or stop; shrink = go on with the same stages "
                            "on the survivors, back to all slices at a checkpoint once workers can start "
                            "again; auto = replace if one comes within replace_timeout_s, else shrink",
        json_schema_extra={"one_of": "on_loss"})
    replace_timeout_s: float = Field(
        60.0, description="how long a replacement worker is waited for (on_loss replace or auto); 0 = one try")
    slice_memory_bytes: int | None = Field(
        None, description="bytes a layout on fewer slices may hold on one slice (parameters, "
                          "gradients, optimizer state, saved activations); null = not checked")

    def recovery(self):
        """The Trainer's mpmd.Recovery record of these keys."""
        from mpmd.train.options import Recovery
        return Recovery(on_loss=self.on_loss, replace_timeout_s=self.replace_timeout_s,
                        slice_memory_bytes=self.slice_memory_bytes)

    @model_validator(mode="after")
    def _recovery_rules(self):
        _record_rules("cluster", self.recovery)
        return self


class WorkerSection(ClusterSection):
    """cluster.*: what the backends whose slices are worker processes add."""
    token_file: str | None = Field(
        None, description="file holding the cluster secret; static needs one, others generate it; "
                          "shared with cluster.address: the submit token")
    failure_timeout_s: float | None = Field(
        None, gt=0, description="a worker silent this long (no heartbeat answered) is declared lost "
                                "and replaced; null = the cluster's default (5 s)")


def address_problem(where: str, address: str, whose: str = "") -> str | None:
    """None for a 'host:port' with port 1..65535, else the sentence saying so."""
    match = _ADDRESS.match(address)
    if match and 0 < int(match.group(1)) < 65536:
        return None
    return f"{where} {address!r} must be {whose}'host:port' with port 1..65535"


class TuneConfig(_Section):
    """What `mpmd tune` searches and how it confirms (recipes/tune_cli.py); `mpmd train`
    ignores this section."""
    memory_gb: float | None = Field(
        None, gt=0, description="per-slice memory cap in GiB the predicted peak must fit; null = the "
                                "device's memory (on CPU: this host's memory / workers)")
    confirm: int = Field(3, ge=0, description="best predicted candidates run for real; 0 = none")
    confirm_steps: int = Field(3, gt=0, description="timed steps per confirmed candidate (after one warm-up)")
    microbatch_counts: list[typing.Annotated[int, Field(gt=0)]] | None = Field(
        None, description="microbatch counts to consider, each dividing train.batch_size; null = every divisor")
    schedule_names: list[str] | None = Field(
        None, description="schedules to consider; null = all", json_schema_extra={"one_of": "schedule"})
    max_virtual_stages: int = Field(4, gt=0, description="most stages per slice interleaved-1f1b may take")
    output: str = Field("tuned.yaml", description="where the winner's config is written")

    @field_validator("schedule_names")
    @classmethod
    def _known_schedules(cls, names):
        for i, name in enumerate(names or []):
            _known(f"tune.schedule_names[{i}]", name, schedules.SCHEDULES)
        return names


# The mesh axes of every slice, in order: defined once, in the runtime (which imports JAX only to
# bind a mesh to devices), so a config is checked against them before JAX is imported.
MESH_AXES = AXES


class SliceShape(_Section):
    """One slice's mesh: data x fsdp x tensor devices (mpmd.stages.sharding.SliceMesh)."""
    data: int | None = Field(
        None, gt=0, description="ways a microbatch is split (data parallel); null = the devices "
                                "fsdp x tensor leave: max(1, cluster.devices_per_worker // (fsdp x tensor))")
    fsdp: int = Field(1, gt=0, description="ways a microbatch and the parameter dims the rules put "
                                           "on fsdp are split (ZeRO-3)")
    tensor: int = Field(1, gt=0, description="ways the parameter dims the rules put on tensor are "
                                             "split (Megatron-style)")

    def resolved(self, devices_per_worker: int) -> dict[str, int]:
        """{data, fsdp, tensor} with data's null replaced (what mpmd.Trainer(mesh=...) takes)."""
        data = self.data or max(1, devices_per_worker // (self.fsdp * self.tensor))
        return {"data": data, "fsdp": self.fsdp, "tensor": self.tensor}


class MeshConfig(SliceShape):
    stages: list[SliceShape] | None = Field(
        None, description="one {data, fsdp, tensor} per slice (worker), replacing the shape above "
                          "for that slice; null = every slice alike")
    rules: dict[str, Any] = Field(
        {}, description="logical axis name -> mesh axis, list of mesh axes, or null (replicated); "
                        "overrides mpmd.stages.sharding.RULES")


class CheckpointConfig(_Section):
    """Their rules are mpmd.Checkpointing's (mpmd/train/options.py), checked by building one."""
    every: int = Field(50, description="save every N steps and at the end; 0 = end only")
    memory_every: int = Field(
        0, description="also snapshot every N steps in host memory, copied to a peer slice: "
                       "a lost worker is restored from it and replays at most N steps; 0 = off")
    keep: int = Field(2, description="newest committed checkpoints kept on disk")
    max_failed_saves: int = Field(
        1, description="saves that may fail after a failed one (retries, or saves already "
                       "in flight) before training stops at the last committed step")

    def record(self, metadata: dict | None = None):
        """The Trainer's mpmd.Checkpointing record of these keys, with `metadata` in every manifest."""
        from mpmd.train.options import Checkpointing
        return Checkpointing(every=self.every, keep=self.keep, max_failed_saves=self.max_failed_saves,
                             memory_every=self.memory_every, metadata=dict(metadata or {}))

    @model_validator(mode="after")
    def _checkpointing_rules(self):
        _record_rules("checkpoint", self.record)
        return self


class LogConfig(_Section):
    every: int = Field(10, gt=0, description="log a line (and flush scalars) every N steps")
    trace_steps: list[typing.Annotated[int, Field(gt=0)]] = Field(
        [2, 3], description="steps whose per-task timeline is written as a Perfetto trace")
    tensorboard: bool = Field(True, description="also write scalars to <run_dir>/tb")
    progress: Literal["auto", "bar", "lines"] = Field(
        "auto", description="auto = tqdm bar on a terminal, log lines otherwise")
    level: Literal["debug", "info", "warning", "error"] = Field(
        "warning", description="least level of log records on the console (workers' too, one line "
                               "each); info and up always go to <run_dir>/logs; $MPMD_LOG overrides")


_ADDRESS = re.compile(r"^[^\s:]+:(\d{1,5})$")
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# The sections picked by a key inside them: section -> (that key, the registry of its variants).
_VARIANTS = {"model": ("kind", ModelSection, registry.model_specs),
             "cluster": ("backend", ClusterSection, registry.backend_specs)}


def _variant(section: str, values) -> type[BaseModel]:
    """The section class for the values given (a dict, or a section already built): the
    registered spec's of its kind (model) or backend (cluster); ValueError naming those known."""
    key, base, specs = _VARIANTS[section]
    if isinstance(values, BaseModel):
        return type(values)
    name = values.get(key, base.model_fields[key].default) if isinstance(values, dict) else None
    known = specs()
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"{section}.{key} must be one of {registry.one_of(known)}, got {name!r}")
    return known[name].section


def _known(key: str, name, names) -> str:
    if name not in names:
        raise ValueError(f"{key} must be one of {registry.one_of(names)}, got {name!r}")
    return name


def _record_rules(section: str, make) -> None:
    """Builds the Trainer's option record of a section (its __post_init__ holds the rules);
    its ValueError, naming the field, becomes one naming the key."""
    try:
        make()
    except ValueError as e:
        raise ValueError(f"{section}.{e}") from None


class Config(_Section):
    imports: list[str] = Field(
        [], description="modules imported before the rest of the config is checked, e.g. [my_pkg.my_family]: "
                        "a module that registers a model family (mpmd.recipes.registry.register_model_spec), "
                        "a cluster backend (register_backend_spec) or a schedule (mpmd.schedules."
                        "register_schedule) makes its name valid for model.kind, cluster.backend or "
                        "pipeline.schedule; the working directory is on the import path")
    run_dir: str = Field("runs/default", description="checkpoints, metrics, traces, config go here")
    seed: int = Field(0, description="seeds parameter init and data order")
    # model and cluster: the section of the registered family or backend their kind/backend names.
    model: SerializeAsAny[ModelSection] = Field(default_factory=lambda: _variant("model", {})())
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    pipeline: PipelineConfig = PipelineConfig()
    cluster: SerializeAsAny[ClusterSection] = Field(default_factory=lambda: _variant("cluster", {})())
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    tune: TuneConfig = TuneConfig()

    @field_validator("model", "cluster", mode="before")
    @classmethod
    def _registered_section(cls, values, info):
        section = _variant(info.field_name, values)
        return values if isinstance(values, section) else section.model_validate(values)

    @field_validator("imports")
    @classmethod
    def _module_names(cls, names):
        for i, name in enumerate(names):
            if not _MODULE.match(name):
                raise ValueError(f"imports[{i}]={name!r} must be a module name, e.g. my_pkg.my_family")
        return names

    @property
    def num_workers(self) -> int:
        """Worker processes (= pipeline slices): each holds virtual_stages stages."""
        return self.pipeline.num_stages // self.pipeline.virtual_stages

    def slice_shapes(self) -> list[dict[str, int]]:
        """{data, fsdp, tensor} of each slice's mesh, one per slice (mesh.stages, else mesh)."""
        shapes = self.mesh.stages if self.mesh.stages is not None else [self.mesh] * self.num_workers
        return [s.resolved(self.cluster.devices_per_worker * self.cluster.processes_per_slice) for s in shapes]

    @property
    def num_devices(self) -> int:
        """Devices of every slice together (what the inprocess backend needs in one process)."""
        return sum(s["data"] * s["fsdp"] * s["tensor"] for s in self.slice_shapes())

    def hash(self, exclude: typing.Iterable[str] = ()) -> str:
        """12 hex digits of sha256 over the resolved config, minus the dotted keys in exclude."""
        values = self.model_dump(mode="json")
        for key in exclude:
            *sections, leaf = key.split(".")
            node = values
            for section in sections:
                node = node[section]
            del node[leaf]
        text = json.dumps(values, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def math(self) -> dict[str, Any]:
        """{dotted key: value} of every key in MATH_KEYS: what a resumed run must not change."""
        values = self.model_dump(mode="json")
        out = {}
        for key in MATH_KEYS:
            node = values
            for part in key.split("."):
                node = node[part]
            out.update(_flatten(node, key) if isinstance(node, dict) else {key: node})
        return out

    def math_hash(self) -> str:
        """12 hex digits of sha256 over math(): equal hashes, equal training updates."""
        text = json.dumps(self.math(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @model_validator(mode="after")
    def _cross_check(self) -> "Config":
        problems = _cross_field_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self


# The keys that change what training computes. Others (train.steps, logging, checkpoint
# cadence, the cluster, run_dir, and the mesh: how the same math is spread over devices)
# may change between a run and its resume.
MATH_KEYS = ("seed", "model", "data", "optimizer", "train.batch_size", "pipeline.num_microbatches")


def _flatten(values: dict, prefix: str) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        out.update(_flatten(v, f"{prefix}.{k}") if isinstance(v, dict) else {f"{prefix}.{k}": v})
    return out


def math_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: saved -> now' for every math key whose value differs. A model key only one side
    has, at the default of a family that has it, is no change (a manifest from before the
    model section was per family records every family's keys)."""
    def same(k):
        if k in saved and k in now:
            return saved[k] == now[k]
        section, _, name = k.partition(".")
        one = saved if k in saved else now
        return section in _VARIANTS and "." not in name and _default_elsewhere(section, name, one[k])
    return [f"{k}: {saved.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}"
            for k in sorted(set(saved) | set(now)) if not same(k)]


def _schedule_problem(p: PipelineConfig) -> str | None:
    """What mpmd.schedules says is wrong with the pipeline section (which schedules take
    virtual stages, how many microbatches each needs), found by building the schedule: the
    rules live there only. Its messages name make()'s parameters, which are this section's
    keys, so prefixing them makes the message name the config key."""
    try:
        schedules.make(p.schedule, p.num_stages, p.num_microbatches, p.virtual_stages)
    except ValueError as e:
        text = str(e).replace("schedule '", "pipeline.schedule='")
        return re.sub(r"(?<![.\w])(num_stages|num_microbatches|virtual_stages)\b", r"pipeline.\1", text)
    return None


def _cross_field_problems(c: Config) -> list[str]:
    """Every cross-section inconsistency, each a full sentence; empty when the config is sound.
    A key a family or backend does not take is not here: its section has no such key
    (`_check_keys` says which kinds or backends take it); what a family or backend needs of
    the other sections is its spec's `problems`."""
    p, t, d, tb = c.pipeline, c.train, c.data, c.tune
    out = []
    if t.batch_size % p.num_microbatches:
        out.append(f"train.batch_size={t.batch_size} must be divisible by "
                   f"pipeline.num_microbatches={p.num_microbatches} (equal-sized microbatches)")
    problem = _schedule_problem(p)
    if problem:
        out.append(problem)
    if p.cuts is not None and (len(p.cuts) != p.num_stages - 1 or p.cuts != sorted(set(p.cuts))
                               or (p.cuts and p.cuts[0] < 1)):
        out.append(f"pipeline.cuts={p.cuts} must be {p.num_stages - 1} increasing layer indices >= 1 "
                   f"(one per stage after the first, pipeline.num_stages={p.num_stages}), or null")
    if tb.microbatch_counts is not None:
        bad = [m for m in tb.microbatch_counts if t.batch_size % m]
        if bad or not tb.microbatch_counts:
            out.append(f"tune.microbatch_counts={tb.microbatch_counts} must be a non-empty list of divisors "
                       f"of train.batch_size={t.batch_size} "
                       f"({[m for m in range(1, t.batch_size + 1) if t.batch_size % m == 0]}), or null")
    if tb.schedule_names is not None and not tb.schedule_names:
        out.append(f"tune.schedule_names must name at least one of {list(schedules.SCHEDULES)}, or be null (all)")
    out += registry.get_model_spec(c.model.kind).problems(c)
    if (d.source == "files") != bool(d.paths):
        out.append("data.paths must be non-empty when data.source='files' and empty otherwise, "
                   f"got source '{d.source}' with {len(d.paths)} paths")
    if t.sample_tokens and not t.sample_prompt:
        out.append("train.sample_prompt must be non-empty when train.sample_tokens > 0")
    if c.optimizer.name != "adamw" and c.optimizer.weight_decay:
        out.append(f"optimizer.weight_decay={c.optimizer.weight_decay} only applies to 'adamw'; "
                   f"set it to 0 for '{c.optimizer.name}'")
    num_slices = max(1, p.num_stages // p.virtual_stages)
    if c.cluster.num_workers is not None and c.cluster.num_workers != num_slices:
        out.append(f"cluster.num_workers={c.cluster.num_workers} must equal pipeline.num_stages // "
                   f"pipeline.virtual_stages = {num_slices} (or be null)")
    out += registry.get_backend_spec(c.cluster.backend).problems(c)
    return out + _mesh_problems(c, num_slices)


def _mesh_problems(c: Config, num_slices: int) -> list[str]:
    """mesh.* against the slices and cluster.devices_per_worker (the rules by mpmd.stages.mesh_axes,
    as mpmd.stages.sharding.check_rules does; the devices again by sharding.slice_meshes in the
    Trainer, which imports JAX)."""
    mesh, devices = c.mesh, c.cluster.devices_per_worker * c.cluster.processes_per_slice
    out = []
    if mesh.stages is not None and len(mesh.stages) != num_slices:
        out.append(f"mesh.stages lists {len(mesh.stages)} slice shape(s) but there are {num_slices} slices "
                   f"(pipeline.num_stages // pipeline.virtual_stages): give one per slice, or none")
    # A worker owns devices_per_worker devices; an in-process slice takes as many as its mesh.
    elif not registry.get_backend_spec(c.cluster.backend).in_process_devices:
        named = [(f"mesh.stages[{r}]", s) for r, s in enumerate(mesh.stages)] if mesh.stages else [("mesh", mesh)]
        for where, shape in named:
            axes = shape.resolved(devices)
            product = axes["data"] * axes["fsdp"] * axes["tensor"]
            if product != devices:
                out.append(f"{where}: {' x '.join(f'{a}={n}' for a, n in axes.items())} = {product} devices, "
                           + (f"but cluster.devices_per_worker={devices}" if c.cluster.processes_per_slice == 1 else
                              f"but a slice has {devices} (cluster.devices_per_worker="
                              f"{c.cluster.devices_per_worker} x cluster.processes_per_slice="
                              f"{c.cluster.processes_per_slice})") + ": the axes' product must equal it")
    out += [p for name, target in mesh.rules.items() if (p := rule_problem(name, target, f"mesh.rules.{name}"))]
    return out


# PyYAML follows YAML 1.1, where "3e-3" (no dot) is a string; accept it as the float it means.
class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)(?:\.[\d_]*)?[eE][-+]?\d+$"), list("-+0123456789"))


def _parse_value(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _sections(model: type[BaseModel], name: str) -> list[type[BaseModel]]:
    """The section classes field `name` of `model` may hold: every registered variant of model
    and cluster (the default one first), one class for another section, none for a value."""
    if model is Config and name in _VARIANTS:
        default = _variant(name, {})
        return [default] + [spec.section for spec in _VARIANTS[name][2]().values() if spec.section is not default]
    annotation = model.model_fields[name].annotation
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def _leaf_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included: ['run_dir', 'model', 'model.kind', ..]
    (every family's and backend's); the keys of a list of sections' entries as 'mesh.stages[].data'."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for section in _sections(model, name):
            keys += [k for k in _leaf_keys(section, f"{prefix}{name}.") if k not in keys]
        for arg in typing.get_args(field.annotation):      # list[Section] | None
            entry = (typing.get_args(arg) or (None,))[0] if typing.get_origin(arg) is list else None
            if isinstance(entry, type) and issubclass(entry, BaseModel):
                keys += _leaf_keys(entry, f"{prefix}{name}[].")
    return keys


def _default_elsewhere(section: str, name: str, value) -> bool:
    """Whether `value` of key section.name is the default of a variant that has the key: such a
    key says nothing the variant without it does not mean (a resolved config from before the
    sections were per kind lists every family's keys at their defaults)."""
    specs = _VARIANTS[section][2]()
    return any(name in spec.section.model_fields and spec.section.model_fields[name].default == value
               for spec in specs.values())


def _not_taken(section: str, chosen: type[BaseModel], values: dict) -> list[str]:
    """'model.num_kv_heads is only used by model.kind='llama', got kind 'gpt'' for each key of
    values that the chosen family's (backend's) section lacks and another one has, unless the
    value is that one's default (then the key is dropped from values)."""
    key, _, specs = _VARIANTS[section]
    out = []
    for name in list(values):
        if name in chosen.model_fields:
            continue
        users = [n for n, spec in specs().items() if name in spec.section.model_fields]
        if users and _default_elsewhere(section, name, values[name]):
            del values[name]
        elif users:
            out.append(f"{section}.{name} is only used by {section}.{key}={registry.one_of(users)}, "
                       f"got {key} '{chosen.model_fields[key].default}'")
    return out


def _unknown_key(key: str) -> ConfigError:
    index = re.search(r"\[\d+\]", key)     # an entry of a list of sections: mesh.stages[1].x
    close = difflib.get_close_matches(re.sub(r"\[\d+\]", "[]", key), _leaf_keys(), n=1, cutoff=0.6)
    close = [c.replace("[]", index.group(0)) for c in close] if index else close
    hint = f"; did you mean '{close[0]}'?" if close else "; run with --help-config for all keys"
    return ConfigError(f"unknown key '{key}'{hint}")


def _check_keys(values: dict, model: type[BaseModel] = Config, prefix: str = "") -> None:
    """Rejects unknown keys anywhere in values, before pydantic, so the suggestion is ours; and
    the keys of model.* (cluster.*) that model.kind's family (cluster.backend's) does not take,
    naming those that do."""
    for key, value in values.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            raise _unknown_key(f"{prefix}{key}")
        sections = _sections(model, key)
        if not sections:
            if isinstance(value, dict) and typing.get_origin(field.annotation) is not dict:
                raise ConfigError(f"'{prefix}{key}' is a value, not a section: cannot set "
                                  f"'{prefix}{key}.{next(iter(value), '')}'")
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"'{prefix}{key}' is a section, not a value: set its keys, "
                              f"e.g. {prefix}{key}.{next(iter(sections[0].model_fields))}=...")
        section = sections[0]
        if model is Config and key in _VARIANTS:
            try:
                section = _variant(key, value)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            problems = _not_taken(key, section, value)
            if problems:
                raise ConfigError("\n".join(problems))
        _check_keys(value, section, f"{prefix}{key}.")


def _set(values: dict, key: str, value: Any) -> None:
    """values[a][b][c] = value for key 'a.b.c', creating sections; a leaf is never a section."""
    *sections, leaf = key.split(".")
    node = values
    for depth, section in enumerate(sections):
        child = node.setdefault(section, {})
        if child is None:
            child = node[section] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"'{'.'.join(sections[:depth + 1])}' is a value, not a section: "
                              f"cannot set '{key}'")
        node = child
    node[leaf] = value


_TYPE_WORDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
               "string_type": "a string", "list_type": "a list", "dict_type": "a mapping",
               "model_type": "a mapping", "int_from_float": "an integer"}
_BOUND_WORDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
                "less_than_equal": "<="}


def _describe_error(error: dict) -> str:
    """One pydantic error -> 'train.steps must be an integer, got 'abc''."""
    key = ""
    for part in error["loc"]:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    kind, got, ctx = error["type"], error.get("input"), error.get("ctx", {})
    if kind == "value_error":  # our cross-field checks: already full sentences
        return str(ctx.get("error", error["msg"]))
    if kind == "extra_forbidden":
        return str(_unknown_key(key))
    if kind in _TYPE_WORDS:
        return f"{key} must be {_TYPE_WORDS[kind]}, got {got!r}"
    if kind == "literal_error":
        return f"{key} must be one of {ctx['expected']}, got {got!r}"
    for bound, word in _BOUND_WORDS.items():
        if kind == bound:
            return f"{key} must be {word} {next(iter(ctx.values()))}, got {got!r}"
    return f"{key}: {error['msg']}, got {got!r}"


def validate(values: dict) -> Config:
    """A nested dict of overrides -> Config, or ConfigError listing every problem. The
    modules under `imports` are imported first: they may register what the rest names."""
    values = copy.deepcopy(values)     # _check_keys drops keys it ignores
    imports = values.get("imports", [])
    if isinstance(imports, list) and all(isinstance(name, str) and _MODULE.match(name) for name in imports):
        for i, name in enumerate(imports):
            registry.import_module(name, f"imports[{i}]")
    _check_keys(values)
    try:
        return Config.model_validate(values)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe_error(err) for err in e.errors())) from None


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file '{path}': {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start}: "
                          f"{e.reason}); a config is YAML") from None
    try:
        values = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
    if values is None:  # an empty file, or only comments: no overrides
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values, "
                          f"got a {type(values).__name__}")
    # A section with all its keys commented out parses as null: treat it as empty.
    return {k: ({} if v is None and k in Config.model_fields and k not in ("imports", "run_dir", "seed")
                else v) for k, v in values.items()}


def load(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- YAML file at path (if any) <- 'dotted.key=value' overrides, validated.

    Values are parsed as YAML: `train.steps=5`, `optimizer.max_grad_norm=null`,
    `log.trace_steps=[1,2]`, `log.tensorboard=false`, `optimizer.lr=1e-3`.
    """
    return validate(values_of(path, overrides))


def values_of(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> dict:
    """The nested dict of overrides `load` validates: the YAML file's, then the key=values."""
    values = _read_yaml(path) if path is not None else {}
    for override in overrides:
        key, sep, text = override.partition("=")
        key = key.strip()
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*", key):
            raise ConfigError(f"override {override!r} must look like key=value, "
                              f"e.g. train.steps=100")
        try:
            value = _parse_value(text)
        except yaml.YAMLError:
            raise ConfigError(f"override {override!r}: value {text!r} is not valid YAML "
                              f"(quote strings that contain ':' or brackets)") from None
        _set(values, key, value)
    return values


def dump(config: Config, path: str | Path) -> Path:
    """Writes the fully resolved config as YAML that `load` reads back to an equal Config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# resolved mpmd config (hash {config.hash()}); every key, defaults included\n"
    path.write_text(header + yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


def _choices(field) -> list[str] | None:
    """The values a str key may take when a registry or an option record holds them."""
    source = (field.json_schema_extra or {}).get("one_of") if isinstance(field.json_schema_extra, dict) else None
    if source == "model":
        return list(registry.model_specs())
    if source == "cluster":
        return list(registry.backend_specs())
    if source == "schedule":
        return list(schedules.SCHEDULES)
    if source == "on_loss":
        from mpmd.train.options import ON_LOSS
        return list(ON_LOSS)
    if typing.get_origin(field.annotation) is Literal:
        return list(typing.get_args(field.annotation))
    return None


def _allowed(field) -> str:
    choices = _choices(field)
    return " (one of: " + ", ".join(choices) + ")" if choices else ""


def _describe_field(name: str, field, indent: str) -> str:
    value = yaml.safe_dump(field.default, default_flow_style=True).strip()
    value = value.removesuffix("\n...").removesuffix("...").strip()
    return f"{indent}{name}: {value}  # {field.description}{_allowed(field)}"


def describe(model: type[BaseModel] = Config, indent: str = "", base: type[BaseModel] | None = None) -> str:
    """Every key with its default and description, as YAML (the defaults file nobody edits);
    model.* and cluster.* as the default family and backend take them, and as comments what
    each other registered one adds."""
    lines = []
    for name, field in model.model_fields.items():
        sections = _sections(model, name)
        if not sections:
            # A variant's kind (backend) is described as its base section's: every registered one.
            choice = base.model_fields[name] if base is not None and name in base.model_fields else None
            if choice is not None and _choices(choice):
                field = field.merge_field_infos(field, description=choice.description,
                                                json_schema_extra=choice.json_schema_extra)
            lines.append(_describe_field(name, field, indent))
            continue
        lines.append(f"{indent}{name}:")
        lines.append(describe(sections[0], indent + "  ", _VARIANTS[name][1] if model is Config and name in _VARIANTS else None))
        for other in sections[1:]:
            key = _VARIANTS[name][0]
            added = [(k, f) for k, f in other.model_fields.items() if k not in sections[0].model_fields]
            lacks = [k for k in sections[0].model_fields if k not in other.model_fields]
            lines.append(f"{indent}  # {key}: {other.model_fields[key].default}"
                         + (f" takes none of {', '.join(lacks)}" if lacks else "")
                         + (("," if lacks else "") + " adds:" if added else ""))
            lines += [f"{indent}  #   " + _describe_field(k, f, "") for k, f in added]
    return "\n".join(lines)
