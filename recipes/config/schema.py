"""The schema: every section of a run's config, each key's default and description, the
variants of model.*, data.* and cluster.* (their bases: sections.py) picked by model.kind,
data.source and cluster.backend, and what a
resumed run may not change (MATH_KEYS).

A section's own bounds are its fields'; what spans sections is problems.py's, run by
Config's validator; which keys exist and how they are read is loading.py's.
"""

import hashlib
import importlib.util
import json
import math
import re
import typing
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializeAsAny, field_validator, model_validator

from mpmd.recipes import registry
from mpmd.recipes.config import problems
from mpmd.recipes.config.rl import RLConfig
from mpmd.recipes.config.sections import (  # noqa: F401  (re-exported: the schema's names)
    ClusterSection,
    ConfigError,
    DataSection,
    ModelSection,
    SliceShape,
    WorkerSection,
    _known,
    _record_rules,
    _Section,
)
from mpmd.stages.mesh_axes import AXES
from mpmd.schedules import core as schedules


class TrainConfig(_Section):
    steps: int = Field(200, gt=0, description="optimizer steps; step k is the k-th update")
    batch_size: int = Field(16, gt=0, description="sequences (or examples) per global batch")
    eval_every: int = Field(50, ge=0, description="eval every N steps and at the end; 0 = never")
    eval_batches: int = Field(4, gt=0, description="batches averaged per eval")
    sample_tokens: int = Field(200, ge=0, description="sample length in tokens at the end; 0 = none")
    sample_prompt: str = Field("def ", description="text the final sample continues")
    sample_temperature: float = Field(0.8, ge=0, description="divides the logits before sampling; 0 = greedy (argmax)")
    sample_top_k: int = Field(40, ge=0, description="sample among the k likeliest tokens; 0 = all")
    exact_match: int = Field(
        0,
        ge=0,
        description="jsonl source: score this many held-out examples by exact match of the greedy "
        "continuation of each prompt with its response, before training, at each eval and at "
        "the end (metrics.jsonl and the summary); 0 = none",
    )
    run_ahead: int = Field(
        1,
        ge=0,
        description="steps sent to the slices ahead of the one running (each queues "
        "behind it, hiding the gap between steps); 0 = one step at a time",
    )
    # Its rules are mpmd.Recovery's (mpmd/train/options.py), checked by building one.
    on_nonfinite: str = Field(
        "stop",
        description="a step whose loss or gradient norm is not finite is never committed; then "
        "stop = end the run (one error line naming the step, the last committed step "
        "kept); rewind = restore the last committed step and go on, once per step "
        "(skip is refused: the update is applied on the slices before the loss is known)",
        json_schema_extra={"one_of": "on_nonfinite"},
    )
    preempt_grace_s: float = Field(
        30.0,
        ge=12,
        description="after a SIGTERM (a scheduler's preemption) the run exits within this many "
        "seconds, exit code 143: it collects the steps in flight and commits a "
        "checkpoint, and when that has not finished 10 s before the end it keeps the "
        "last commit instead (those 10 s stop the workers)",
    )

    @model_validator(mode="after")
    def _nonfinite_rules(self):
        from mpmd.train.options import Recovery

        _record_rules("train", lambda: Recovery(on_nonfinite=self.on_nonfinite))
        return self


class OptimizerConfig(_Section):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="optax optimizer")
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay; adamw only")
    b1: float = Field(0.9, ge=0, lt=1, description="adam beta1; sgd momentum (0 = plain sgd)")
    b2: float = Field(0.95, ge=0, lt=1, description="adam beta2; unused by sgd")
    warmup_steps: int = Field(20, ge=0, description="linear warmup from 0 to lr over this many steps, then constant")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="clip the global gradient norm to this; null = no clipping"
    )


class PipelineConfig(_Section):
    num_stages: int = Field(2, gt=0, description="pipeline stages the model is split into")
    schedule: str = Field(
        "1f1b", description="order of forward/backward tasks on each slice", json_schema_extra={"one_of": "schedule"}
    )
    num_microbatches: int = Field(4, gt=0, description="microbatches per global batch")
    virtual_stages: int = Field(
        1,
        gt=0,
        description="stages per slice: >= 2 for interleaved-1f1b, 2 for zb-v and dualpipe-v "
        "(their V, the default for them), else 1",
    )

    cuts: list[int] | None = Field(
        None,
        description="the layer (or, for a custom model's list of stages, the stage) where each "
        "pipeline stage after the first begins, increasing; null = cut where the "
        "stages' estimated costs balance (`mpmd tune` writes measured ones)",
    )

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, name: str) -> str:
        return _known("pipeline.schedule", name, schedules.SCHEDULES)

    @model_validator(mode="after")
    def _schedule_default(self):
        if "virtual_stages" not in self.model_fields_set:  # not given: the schedule's own
            self.virtual_stages = schedules.default_virtual_stages(self.schedule)
        return self


class TuneConfig(_Section):
    """What `mpmd tune` searches and how it confirms (recipes/commands/tune.py); `mpmd train`
    ignores this section."""

    memory_gb: float | None = Field(
        None,
        gt=0,
        description="per-slice memory cap in GiB the predicted peak must fit; null = the "
        "device's memory (on CPU: this host's memory / workers)",
    )
    confirm: int = Field(3, ge=0, description="best predicted candidates run for real; 0 = none")
    confirm_steps: int = Field(5, gt=0, description="timed steps per confirmed candidate (after two warm-up steps)")
    microbatch_counts: list[typing.Annotated[int, Field(gt=0)]] | None = Field(
        None, description="microbatch counts to consider, each dividing train.batch_size; null = every divisor"
    )
    schedule_names: list[str] | None = Field(
        None, description="schedules to consider; null = all", json_schema_extra={"one_of": "schedule"}
    )
    max_virtual_stages: int = Field(4, gt=0, description="most stages per slice interleaved-1f1b may take")
    output: str = Field("tuned.yaml", description="where the winner's config is written")

    @field_validator("schedule_names")
    @classmethod
    def _known_schedules(cls, names):
        for i, name in enumerate(names or []):
            _known(f"tune.schedule_names[{i}]", name, schedules.SCHEDULES)
        return names


class PlanConfig(_Section):
    """What `mpmd plan goodput` simulates (recipes/commands/plan.py, mpmd/tuner/goodput.py);
    `mpmd train` ignores this section. A cost left null is what plan.from_run's records
    measured, else gpt_tiny's on 4 local workers of this project's development machine."""

    num_slices: int | None = Field(
        None, gt=0, le=2**20, description="slices of the run planned; null = the config's workers"
    )
    slices_per_host: int = Field(
        1,
        gt=0,
        le=2**20,
        description="slices on one host: its loss takes them all, and with 2 or more the in-memory tier "
        "too (a slice's copy is on the next slice); a gang (cluster.processes_per_slice) is a slice over that many hosts",
    )
    mtbf_h: float = Field(
        1000.0,
        gt=0,
        description="mean hours between failures of one host, the controller's too (Llama 3's 16k-GPU "
        "run saw about 6,000 h per 8-GPU host)",
    )
    wall_h: float = Field(24.0, gt=0, description="the run's wall time in hours")
    hot_spares: int | None = Field(
        None,
        ge=0,
        le=2**10,
        description="warm spare workers; null = cluster.hot_spares where the config has it, else 0",
    )
    replace_wait_s: float = Field(
        0.0,
        ge=0,
        description="seconds until a new worker can be had after a loss (0 = at once, as locally); "
        "past cluster.replace_timeout_s, on_loss auto shrinks",
    )
    from_run: str | None = Field(
        None, description="a run directory whose metrics.jsonl gives the costs it measured (mpmd/report/costs.py)"
    )
    seed: int = Field(0, ge=0, description="seeds the failures drawn")
    step_s: float | None = Field(None, gt=0, description="seconds of a step without a save")
    save_s: float | None = Field(None, ge=0, description="seconds a persistent save adds (checkpoint.every)")
    snapshot_s: float | None = Field(
        None, ge=0, description="seconds an in-memory snapshot adds (checkpoint.memory_every)"
    )
    detect_s: float | None = Field(None, ge=0, description="seconds from a loss until it is declared")
    spawn_s: float | None = Field(None, ge=0, description="seconds to start a new worker, set it up, ship its programs")
    promote_s: float | None = Field(None, ge=0, description="seconds for a warm hot spare to take a lost slice's place")
    restore_s: float | None = Field(None, ge=0, description="seconds to restore every slice from the persistent tier")
    memory_restore_s: float | None = Field(
        None, ge=0, description="seconds to restore every slice from the in-memory tier"
    )
    compile_s: float | None = Field(None, ge=0, description="seconds the first step on a new worker adds (it compiles)")


# The mesh axes of every slice, in order: defined once, in the runtime (which imports JAX only to
# bind a mesh to devices), so a config is checked against them before JAX is imported.
MESH_AXES = AXES


class MeshConfig(SliceShape):
    stages: list[SliceShape] | None = Field(
        None,
        description="one {data, fsdp, tensor, expert} per slice (worker), replacing the shape above "
        "for that slice; null = every slice alike",
    )
    rules: dict[str, Any] = Field(
        {},
        description="logical axis name -> mesh axis, list of mesh axes, or null (replicated); "
        "overrides mpmd.stages.sharding.RULES",
    )
    fsdp_gather: Literal["per_microbatch", "per_step"] = Field(
        "per_microbatch",
        description="where weights laid out on fsdp are gathered: inside every forward and "
        "backward program (per_microbatch), or once a step by gather{k} before a "
        "stage's first forward, kept whole over fsdp until its last backward "
        "(per_step: fewer gathers, fsdp x the sharded weights' memory; needs a "
        "slice with fsdp > 1)",
    )


class CheckpointConfig(_Section):
    """Their rules are mpmd.Checkpointing's (mpmd/train/options.py), checked by building one."""

    every: int = Field(50, description="save every N steps and at the end; 0 = end only")
    memory_every: int = Field(
        0,
        description="also snapshot every N steps in host memory, copied to a peer slice: "
        "a lost worker is restored from it and replays at most N steps; 0 = off",
    )
    keep: int = Field(2, description="newest committed checkpoints kept on disk")
    max_failed_saves: int = Field(
        1,
        description="saves that may fail after a failed one (retries, or saves already "
        "in flight) before training stops at the last committed step",
    )

    def record(self, metadata: dict | None = None):
        """The Trainer's mpmd.Checkpointing record of these keys, with `metadata` in every manifest."""
        from mpmd.train.options import Checkpointing

        return Checkpointing(
            every=self.every,
            keep=self.keep,
            max_failed_saves=self.max_failed_saves,
            memory_every=self.memory_every,
            metadata=dict(metadata or {}),
        )

    @model_validator(mode="after")
    def _checkpointing_rules(self):
        _record_rules("checkpoint", self.record)
        return self


class LogConfig(_Section):
    every: int = Field(10, gt=0, description="log a line (and flush scalars) every N steps")
    trace_steps: list[typing.Annotated[int, Field(gt=0)]] = Field(
        [2, 3], description="steps whose per-task timeline is written as a Perfetto trace"
    )
    tensorboard: bool = Field(True, description="also write scalars to <run_dir>/tb")
    wandb: bool = Field(
        False,
        description="also log scalars to Weights & Biases (needs `pip install 'mpmd[wandb]'`), its files "
        "under <run_dir>/wandb; with WANDB_MODE=offline nothing is sent (`wandb sync` uploads later)",
    )
    wandb_project: str = Field("mpmd", description="the W&B project log.wandb logs to (the run is named after run_dir)")
    progress: Literal["auto", "bar", "lines"] = Field(
        "auto", description="auto = tqdm bar on a terminal, log lines otherwise"
    )
    level: Literal["debug", "info", "warning", "error"] = Field(
        "warning",
        description="least level of log records on the console (workers' too, one line "
        "each); info and up always go to <run_dir>/logs; $MPMD_LOG overrides",
    )

    @model_validator(mode="after")
    def _wandb_installed(self):
        # Checked with the config, before JAX starts or a worker does, not at the first step.
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                "log.wandb=true needs the wandb package: pip install 'mpmd[wandb]' (or set log.wandb=false)"
            )
        return self


MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# The sections picked by a key inside them: section -> (that key, the registry of its variants).
VARIANTS = {
    "model": ("kind", ModelSection, registry.model_specs),
    "cluster": ("backend", ClusterSection, registry.backend_specs),
    "data": ("source", DataSection, registry.data_sources),
}


def variant(section: str, values) -> type[BaseModel]:
    """The section class for the values given (a dict, or a section already built): the
    registered spec's of its kind (model), source (data) or backend (cluster); ValueError
    naming those known."""
    key, base, specs = VARIANTS[section]
    if isinstance(values, BaseModel):
        return type(values)
    name = values.get(key, base.model_fields[key].default) if isinstance(values, dict) else None
    known = specs()
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"{section}.{key} must be one of {registry.one_of(known)}, got {name!r}")
    return known[name].section


class Config(_Section):
    imports: list[str] = Field(
        [],
        description="modules imported before the rest of the config is checked, e.g. [my_pkg.my_family]: "
        "a module that registers a model family (mpmd.recipes.registry.register_model_spec), "
        "a cluster backend (register_backend_spec) or a schedule (mpmd.schedules."
        "register_schedule) makes its name valid for model.kind, cluster.backend or "
        "pipeline.schedule; the working directory is on the import path",
    )
    run_dir: str = Field("runs/default", description="checkpoints, metrics, traces, config go here")
    run_dir_mode: str = Field(
        "0700",
        description="permissions of run_dir and what the run writes in it (octal, as chmod takes them): "
        "0700 = its owner only; 0750 lets the owner's group read it (a team sharing a group). The "
        "owner always has rwx; others may never write",
    )
    seed: int = Field(0, ge=0, description="seeds parameter init and data order")
    # model, data and cluster: the section of the registered family, source or backend that
    # their kind, source or backend names.
    model: SerializeAsAny[ModelSection] = Field(default_factory=lambda: variant("model", {})())
    data: SerializeAsAny[DataSection] = Field(default_factory=lambda: variant("data", {})())
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    pipeline: PipelineConfig = PipelineConfig()
    cluster: SerializeAsAny[ClusterSection] = Field(default_factory=lambda: variant("cluster", {})())
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    tune: TuneConfig = TuneConfig()
    plan: PlanConfig = PlanConfig()
    rl: RLConfig = RLConfig()

    @field_validator("run_dir_mode", mode="before")
    @classmethod
    def _octal_mode(cls, value):
        # YAML reads an unquoted 0750 as the integer 488 (octal): take it as the octal it was.
        text = format(value, "04o") if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str) or not re.fullmatch(r"0?[0-7]{3}", text):
            raise ValueError(f"run_dir_mode must be an octal mode like '0700' or '0750', got {value!r}")
        mode = int(text, 8)
        if mode & 0o700 != 0o700 or mode & 0o002:
            raise ValueError(
                f"run_dir_mode={text!r}: its owner must keep rwx (0700) and others may not write (no 0002)"
            )
        return format(mode, "04o")

    @field_validator("model", "data", "cluster", mode="before")
    @classmethod
    def _registered_section(cls, values, info):
        section = variant(info.field_name, values)
        return values if isinstance(values, section) else section.model_validate(values)

    @field_validator("imports")
    @classmethod
    def _module_names(cls, names):
        for i, name in enumerate(names):
            if not MODULE.match(name):
                raise ValueError(f"imports[{i}]={name!r} must be a module name, e.g. my_pkg.my_family")
        return names

    @property
    def num_slices(self) -> int:
        """The pipeline's slices: each holds virtual_stages stages."""
        return self.pipeline.num_stages // self.pipeline.virtual_stages

    @property
    def num_workers(self) -> int:
        """Worker processes: one per pipeline slice, and with rl.algorithm one more, the sampler's
        (and another, the reference's, with rl.kl_coef > 0)."""
        rl = self.rl.algorithm is not None
        return self.num_slices + rl + (rl and self.rl.kl_coef > 0)

    def slice_shapes(self) -> list[dict[str, int]]:
        """{data, fsdp, tensor[, expert]} of each pipeline slice's mesh (mesh.stages, else mesh)."""
        shapes = self.mesh.stages if self.mesh.stages is not None else [self.mesh] * self.num_slices
        return [s.resolved(self.cluster.devices_per_worker * self.cluster.processes_per_slice) for s in shapes]

    @property
    def num_devices(self) -> int:
        """Devices of every slice together (what the inprocess backend needs in one process)."""
        return sum(math.prod(s.values()) for s in self.slice_shapes())

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
        from mpmd.recipes.data import tokenizer  # imports the config schema: not at the top

        tokenizer.resolve_vocab_size(self)  # before the checks that read model.vocab_size
        found = problems.cross_field_problems(self)
        if found:
            raise ValueError("\n".join(found))
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
    model section was per family records every family's keys); nor is a key of another section
    only one side has, at its default (a manifest from before the key existed)."""

    def same(k):
        if k in saved and k in now:
            return saved[k] == now[k]
        section, _, name = k.partition(".")
        one = saved if k in saved else now
        if section in VARIANTS:
            return "." not in name and default_elsewhere(section, name, one[k])
        # A key added to a section since (data.tokenizer), at its default, changes nothing.
        fields = getattr(Config.model_fields.get(section), "annotation", None)
        field = getattr(fields, "model_fields", {}).get(name)
        return field is not None and field.default == one[k]

    return [
        f"{k}: {saved.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}"
        for k in sorted(set(saved) | set(now))
        if not same(k)
    ]


def default_elsewhere(section: str, name: str, value) -> bool:
    """Whether `value` of key section.name is the default of a variant that has the key: such a
    key says nothing the variant without it does not mean (a resolved config from before the
    sections were per kind lists every family's keys at their defaults)."""
    specs = VARIANTS[section][2]()
    return any(
        name in spec.section.model_fields and spec.section.model_fields[name].default == value
        for spec in specs.values()
    )
