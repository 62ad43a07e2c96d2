"""The one typed schema for a training run: every default, its description, and its checks.

Config flow (after MaxText): defaults live here and only here; a YAML file holds only the keys
it overrides; `key=value` arguments override the file; unknown keys are rejected with the
nearest valid key suggested; the resolved config is written to the run directory (`dump`).
Every check a user's config can fail runs in `load`, before any worker starts, and raises
`ConfigError` naming the key and what is allowed.
"""

import difflib
import hashlib
import json
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mpmd.schedules import core as schedules
from mpmd.runtime.worker import gang


class ConfigError(ValueError):
    """A config the user wrote is invalid; the message names the key and what is allowed."""


class _Section(BaseModel):
    # strict: YAML already gives typed values, so "5" for an int is a mistake, not a coercion.
    model_config = ConfigDict(extra="forbid", strict=True)


class ModelConfig(_Section):
    kind: Literal["gpt", "llama", "mlp", "custom"] = Field("gpt", description="which model to build")
    vocab_size: int = Field(256, gt=0, description="gpt/llama token vocabulary; 256 = one token per byte")
    d_model: int = Field(64, gt=0, description="gpt/llama residual stream width")
    num_heads: int = Field(2, gt=0, description="gpt/llama attention heads; must divide d_model")
    num_layers: int = Field(4, gt=0, description="transformer blocks (gpt/llama) or hidden layers (mlp)")
    seq_len: int = Field(64, ge=2, description="gpt/llama context length in tokens")
    mlp_ratio: int = Field(4, gt=0, description="gpt feed-forward width as a multiple of d_model")
    num_kv_heads: int | None = Field(
        None, gt=0, description="llama key/value heads (grouped-query attention), dividing num_heads; "
                                "null = num_heads")
    mlp_dim: int | None = Field(
        None, gt=0, description="llama SwiGLU hidden width; null = 8/3 x d_model rounded up to a multiple of 64")
    tie_embeddings: bool = Field(
        False, description="llama: the LM head is the token embedding transposed (the model is then cut "
                           "at stage marks, and the embedding's gradients are summed across the two stages)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="llama compute and activation dtype (also what crosses slices); parameters, "
                               "gradients, optimizer state and the loss stay float32")
    remat: Literal["none", "block", "dots_saveable"] = Field(
        "none", description="llama rematerialisation of each block in the backward: none = keep every "
                            "residual; block = keep only block inputs; dots_saveable = also keep projection "
                            "outputs (recompute attention, norms, activations)")
    in_features: int = Field(16, gt=0, description="mlp input width")
    hidden_features: int = Field(64, gt=0, description="mlp hidden width")
    out_features: int = Field(4, gt=0, description="mlp output width")
    module: str | None = Field(
        None, description="custom: 'package.module:function' that builds a list of nnx stages")


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
    schedule: Literal[tuple(schedules.SCHEDULES)] = Field(
        "1f1b", description="order of forward/backward tasks on each slice")
    num_microbatches: int = Field(4, gt=0, description="microbatches per global batch")
    virtual_stages: int = Field(
        1, gt=0, description="stages per slice: >= 2 for interleaved-1f1b, 2 for zb-v and dualpipe-v "
                             "(their V, the default for them), else 1")

    cuts: list[int] | None = Field(
        None, description="the layer (or, for a custom model's list of stages, the stage) where each "
                          "pipeline stage after the first begins, increasing; null = cut where the "
                          "stages' estimated costs balance (`mpmd tune` writes measured ones)")

    @model_validator(mode="after")
    def _schedule_default(self):
        if "virtual_stages" not in self.model_fields_set:     # not given: the schedule's own
            self.virtual_stages = schedules.default_virtual_stages(self.schedule)
        return self


class ClusterConfig(_Section):
    backend: Literal["inprocess", "local", "static", "ray", "shared"] = Field(
        "local", description="inprocess = threads; local = processes here; static = by address; "
                             "shared = slices leased from a persistent cluster (`mpmd cluster up`)")
    num_workers: int | None = Field(
        None, gt=0, description="workers; null = num_stages // virtual_stages, the only valid one")
    addresses: list[str | list[str]] = Field(
        [], description="static: one 'host:port' per worker; with gangs, one list per slice of its processes' "
                        "'host:port' (process 0 first), or a flat list cut by processes_per_slice")
    spares: list[str | list[str]] = Field(
        [], description="static: extra 'host:port' workers (or gangs, as addresses), each replacing one lost "
                        "worker (without spares a static run cannot recover)")
    address: str | None = Field(
        None, description="ray: the Ray cluster to join ('auto', 'HEAD_IP:6379', 'ray://head:10001'); "
                          "null = $RAY_ADDRESS, else a new Ray instance on this machine. shared: the "
                          "manager's 'host:port' (with token_file holding the submit token)")
    file: str | None = Field(
        None, description="shared: the cluster file `mpmd cluster up` wrote (manager address and submit "
                          "token); null = ./mpmd-cluster.json unless cluster.address is given")
    share: bool = Field(
        False, description="shared: time-share workers with other sharing jobs (each job's results stay "
                           "its own); false = wait for workers nobody else uses")
    lease_s: float | None = Field(
        None, gt=2, le=3600, allow_inf_nan=False,
        description="shared: a job silent this long (its controller died) loses its lease: its sessions "
                    "and buffers are freed and its workers go back to the pool; null = the cluster's "
                    "(`mpmd cluster up --lease-s`, default 10 s)")
    resources: dict[str, float] = Field(
        {}, description="ray: resources each worker reserves, e.g. {CPU: 1, GPU: 1}; "
                        "CPU defaults to threads_per_worker")
    failure_timeout_s: float | None = Field(
        None, gt=0, description="a worker silent this long (no heartbeat answered) is declared lost "
                                "and replaced; null = the cluster's default (5 s)")
    token_file: str | None = Field(
        None, description="file holding the cluster secret; static needs one, others generate it; "
                          "shared with cluster.address: the submit token")
    devices_per_worker: int = Field(1, gt=0, description="JAX devices each worker owns")
    processes_per_slice: int = Field(
        1, gt=0, description="local, static, ray: worker processes (one per host) that together own one slice's "
                             "mesh of processes_per_slice x devices_per_worker devices; a lost one is a lost slice")
    start_timeout_s: float = Field(
        60.0, gt=0, allow_inf_nan=False,
        description="local: how long a worker, or every process of a slice's gang, may take to start")
    threads_per_worker: int = Field(1, gt=0, description="XLA/BLAS threads per worker process")
    step_timeout_s: float | None = Field(
        None, gt=0, description="abort a step with no progress for this long (a worker is lost); "
                                "null = max(60 s, 20 x the median recent step time)")
    on_loss: Literal["replace", "shrink", "auto"] = Field(
        "auto", description="a lost worker: replace = a new one or stop; shrink = go on with the same stages "
                            "on the survivors, back to all slices at a checkpoint once workers can start "
                            "again; auto = replace if one comes within replace_timeout_s, else shrink")
    replace_timeout_s: float = Field(
        60.0, ge=0, allow_inf_nan=False,
        description="how long a replacement worker is waited for (on_loss replace or auto); 0 = one try")
    max_workers: int | None = Field(
        None, gt=0, description="local: the most worker processes started over the run, replacements "
                                "included; null = no limit (a lost worker is always replaced)")
    slice_memory_bytes: int | None = Field(
        None, gt=0, description="bytes a layout on fewer slices may hold on one slice (parameters, "
                                "gradients, optimizer state, saved activations); null = not checked")


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
    schedule_names: list[Literal[tuple(schedules.SCHEDULES)]] | None = Field(
        None, description="schedules to consider; null = all")
    max_virtual_stages: int = Field(4, gt=0, description="most stages per slice interleaved-1f1b may take")
    output: str = Field("tuned.yaml", description="where the winner's config is written")


# mpmd.stages.sharding.AXES, in its order; repeated because that module imports JAX, and a config is
# checked before JAX is imported (tests/recipes/test_config.py keeps the two equal).
MESH_AXES = ("data", "fsdp", "tensor")


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
    every: int = Field(50, ge=0, description="save every N steps and at the end; 0 = end only")
    memory_every: int = Field(
        0, ge=0, description="also snapshot every N steps in host memory, copied to a peer slice: "
                             "a lost worker is restored from it and replays at most N steps; 0 = off")
    keep: int = Field(2, gt=0, description="newest committed checkpoints kept on disk")
    max_failed_saves: int = Field(
        1, ge=0, description="saves that may fail after a failed one (retries, or saves already "
                             "in flight) before training stops at the last committed step")


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
_MODULE_FN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Config(_Section):
    run_dir: str = Field("runs/default", description="checkpoints, metrics, traces, config go here")
    seed: int = Field(0, description="seeds parameter init and data order")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    pipeline: PipelineConfig = PipelineConfig()
    cluster: ClusterConfig = ClusterConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    tune: TuneConfig = TuneConfig()

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
    """'key: saved -> now' for every math key whose value differs."""
    return [f"{k}: {saved.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k, "(unset)") != now.get(k, "(unset)")]


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
    """Every cross-field inconsistency, each a full sentence; empty when the config is sound."""
    m, p, t, d, cl = c.model, c.pipeline, c.train, c.data, c.cluster
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
    tb = c.tune
    if tb.microbatch_counts is not None:
        bad = [m for m in tb.microbatch_counts if t.batch_size % m]
        if bad or not tb.microbatch_counts:
            out.append(f"tune.microbatch_counts={tb.microbatch_counts} must be a non-empty list of divisors "
                       f"of train.batch_size={t.batch_size} "
                       f"({[m for m in range(1, t.batch_size + 1) if t.batch_size % m == 0]}), or null")
    if tb.schedule_names is not None and not tb.schedule_names:
        out.append(f"tune.schedule_names must name at least one of {list(schedules.SCHEDULES)}, or be null (all)")
    num_slices = max(1, p.num_stages // p.virtual_stages)
    if m.kind in ("gpt", "llama"):
        if m.d_model % m.num_heads:
            out.append(f"model.d_model={m.d_model} must be divisible by "
                       f"model.num_heads={m.num_heads}")
        if p.num_stages > m.num_layers + 2:
            out.append(f"pipeline.num_stages={p.num_stages} is more than the {m.kind}'s "
                       f"{m.num_layers + 2} layers (embed + {m.num_layers} blocks + head)")
    if m.kind == "llama":
        if not m.d_model % m.num_heads and (m.d_model // m.num_heads) % 2:
            out.append(f"model.d_model / model.num_heads = {m.d_model // m.num_heads} must be even "
                       f"(rotary embeddings rotate pairs of dimensions)")
        if m.num_kv_heads is not None and m.num_heads % m.num_kv_heads:
            out.append(f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}")
    else:
        for key, value, default in (("num_kv_heads", m.num_kv_heads, None), ("mlp_dim", m.mlp_dim, None),
                                    ("tie_embeddings", m.tie_embeddings, False)):
            if value != default:
                out.append(f"model.{key} is only used by model.kind='llama', got kind '{m.kind}'")
        # A custom builder gets the config and may honour dtype and remat itself.
        for key, value, default in (("dtype", m.dtype, "float32"), ("remat", m.remat, "none")):
            if value != default and m.kind != "custom":
                out.append(f"model.{key}={value!r} is only implemented by model.kind='llama' (or a custom "
                           f"model that reads it), got kind '{m.kind}'")
    if m.kind == "mlp":
        if p.num_stages > m.num_layers + 1:
            out.append(f"pipeline.num_stages={p.num_stages} is more than the mlp's "
                       f"{m.num_layers + 1} layers ({m.num_layers} hidden + output)")
        if d.source != "synthetic":
            out.append(f"model.kind='mlp' regresses synthetic data: data.source must be "
                       f"'synthetic', got '{d.source}'")
        if t.sample_tokens:
            out.append(f"model.kind='mlp' cannot sample text: train.sample_tokens must be 0, "
                       f"got {t.sample_tokens}")
    if m.kind == "custom" and not (m.module and _MODULE_FN.match(m.module)):
        out.append(f"model.kind='custom' needs model.module='package.module:function', "
                   f"got {m.module!r}")
    if m.kind != "custom" and m.module is not None:
        out.append(f"model.module is only used by model.kind='custom', got kind '{m.kind}'")
    if d.source in ("stdlib", "files") and m.kind != "mlp" and m.vocab_size < 256:
        out.append(f"data.source='{d.source}' yields byte tokens 0..255: model.vocab_size must "
                   f"be >= 256, got {m.vocab_size}")
    if (d.source == "files") != bool(d.paths):
        out.append("data.paths must be non-empty when data.source='files' and empty otherwise, "
                   f"got source '{d.source}' with {len(d.paths)} paths")
    if t.sample_tokens and not t.sample_prompt:
        out.append("train.sample_prompt must be non-empty when train.sample_tokens > 0")
    if c.optimizer.name != "adamw" and c.optimizer.weight_decay:
        out.append(f"optimizer.weight_decay={c.optimizer.weight_decay} only applies to 'adamw'; "
                   f"set it to 0 for '{c.optimizer.name}'")
    if cl.num_workers is not None and cl.num_workers != num_slices:
        out.append(f"cluster.num_workers={cl.num_workers} must equal pipeline.num_stages // "
                   f"pipeline.virtual_stages = {num_slices} (or be null)")
    # Gangs (runtime/worker/gang.py): addresses grouped per slice, as lists or cut by processes_per_slice.
    ganged = cl.processes_per_slice > 1 or any(isinstance(a, list) for a in cl.addresses + cl.spares)
    num_slots = len(cl.addresses)
    if ganged:
        for key in ("addresses", "spares"):
            try:
                slots = gang.group_addresses(getattr(cl, key), cl.processes_per_slice) if getattr(cl, key) else []
            except ValueError as e:
                out.append(f"cluster.{key}: {e}")
                slots = None
            if key == "addresses":
                num_slots = len(slots) if slots is not None else num_slices
    if cl.backend == "static":
        if num_slots != num_slices:
            out.append(f"cluster.backend='static' needs cluster.addresses with one 'host:port' per worker "
                       f"({num_slices}), got {num_slots}" if not ganged else
                       f"cluster.backend='static' needs cluster.addresses with one gang (the 'host:port' of each "
                       f"of its processes) per slice ({num_slices}), got {num_slots}")
        if not cl.token_file:
            out.append("cluster.backend='static' needs cluster.token_file (the secret the "
                       "workers were started with)")
    else:
        for key in ("addresses", "spares"):
            if getattr(cl, key):
                out.append(f"cluster.{key} is only used by cluster.backend='static', got backend "
                           f"'{cl.backend}'" + ("" if key == "addresses" else
                                                " (a local or ray cluster starts its own replacements)"))
    for key in ("addresses", "spares"):
        for address in [a for g in getattr(cl, key) for a in (g if isinstance(g, list) else [g])]:
            match = _ADDRESS.match(address)
            if not match or not 0 < int(match.group(1)) < 65536:
                out.append(f"cluster.{key} entry {address!r} must be 'host:port' "
                           f"with port 1..65535")
    flat = [a for g in cl.addresses + cl.spares for a in (g if isinstance(g, list) else [g])]
    twice = sorted({a for a in flat if flat.count(a) > 1})
    if twice:
        out.append(f"cluster.addresses and cluster.spares list {', '.join(twice)} more than once: "
                   f"each worker serves one slice or waits as one spare")
    out += _shared_problems(cl)
    if cl.backend not in ("ray", "shared"):
        if cl.address is not None:
            out.append(f"cluster.address (the Ray cluster to join) is only used by cluster.backend='ray', "
                       f"got backend '{cl.backend}'"
                       + ("; a static cluster's workers are cluster.addresses" if cl.backend == "static" else ""))
        if cl.resources:
            out.append(f"cluster.resources is only used by cluster.backend='ray', got backend '{cl.backend}'")
    for name, amount in cl.resources.items():
        if amount < 0:
            out.append(f"cluster.resources.{name}={amount:g} must be >= 0")
    if cl.max_workers is not None:
        if cl.backend != "local":
            out.append(f"cluster.max_workers is only used by cluster.backend='local', got backend '{cl.backend}'"
                       + ("; a static cluster's replacements are cluster.spares" if cl.backend == "static" else ""))
        elif cl.max_workers < num_slices:
            out.append(f"cluster.max_workers={cl.max_workers} must be at least the {num_slices} worker(s) the "
                       f"slices need (or null)")
    if cl.processes_per_slice > 1 and cl.backend == "inprocess":
        out.append(f"cluster.processes_per_slice={cl.processes_per_slice} needs worker processes: "
                   f"cluster.backend 'local', 'static' or 'ray', got 'inprocess' (use 1)")
    if cl.backend == "inprocess" and cl.failure_timeout_s is not None:
        out.append("cluster.failure_timeout_s is not used by cluster.backend='inprocess' (its slices are "
                   "threads of this process, never lost): set it to null")
    return out + _mesh_problems(c, num_slices)


def _shared_problems(cl: ClusterConfig) -> list[str]:
    """The cluster.* keys of backend 'shared', and those only it uses."""
    out = []
    if cl.backend != "shared":
        for key, value, default in (("file", cl.file, None), ("share", cl.share, False),
                                    ("lease_s", cl.lease_s, None)):
            if value != default:
                out.append(f"cluster.{key} is only used by cluster.backend='shared', got backend '{cl.backend}'")
        return out
    if cl.file is not None and cl.address is not None:
        out.append("cluster.backend='shared' takes cluster.file (the cluster file) or cluster.address "
                   "(the manager's 'host:port', with cluster.token_file), not both")
    if cl.address is not None:
        match = _ADDRESS.match(cl.address)
        if not match or not 0 < int(match.group(1)) < 65536:
            out.append(f"cluster.address {cl.address!r} must be the manager's 'host:port' with port 1..65535")
        if not cl.token_file:
            out.append("cluster.backend='shared' with cluster.address needs cluster.token_file (a file holding "
                       "the cluster's submit token; or give cluster.file instead)")
    elif cl.token_file:
        out.append("cluster.token_file with cluster.backend='shared' is the submit token for cluster.address; "
                   "without cluster.address the cluster file holds it: drop cluster.token_file")
    if cl.num_workers is not None:
        out.append("cluster.num_workers is not used by cluster.backend='shared' (the cluster's workers are "
                   "`mpmd cluster up --workers N`): set it to null")
    return out


def _mesh_problems(c: Config, num_slices: int) -> list[str]:
    """mesh.* against the slices and cluster.devices_per_worker (mpmd.stages.sharding.slice_meshes
    and check_rules decide the same again in the Trainer; here they cannot: they import JAX)."""
    mesh, devices = c.mesh, c.cluster.devices_per_worker * c.cluster.processes_per_slice
    out = []
    if mesh.stages is not None and len(mesh.stages) != num_slices:
        out.append(f"mesh.stages lists {len(mesh.stages)} slice shape(s) but there are {num_slices} slices "
                   f"(pipeline.num_stages // pipeline.virtual_stages): give one per slice, or none")
    # A worker owns devices_per_worker devices; an in-process slice takes as many as its mesh.
    elif c.cluster.backend != "inprocess":
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
    for name, target in mesh.rules.items():
        targets = [] if target is None else [target] if isinstance(target, str) else target
        if not isinstance(targets, list) or not all(t in MESH_AXES for t in targets):
            out.append(f"mesh.rules.{name}={target!r}: a rule maps a logical axis name to a mesh axis "
                       f"({', '.join(MESH_AXES)}), a list of them, or null (replicated)")
    return out


# PyYAML follows YAML 1.1, where "3e-3" (no dot) is a string; accept it as the float it means.
class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)(?:\.[\d_]*)?[eE][-+]?\d+$"), list("-+0123456789"))


def _parse_value(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _leaf_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included: ['run_dir', 'model', 'model.kind', ..];
    the keys of a list of sections' entries as 'mesh.stages[].data'."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += _leaf_keys(field.annotation, f"{prefix}{name}.")
        for arg in typing.get_args(field.annotation):      # list[Section] | None
            entry = (typing.get_args(arg) or (None,))[0] if typing.get_origin(arg) is list else None
            if isinstance(entry, type) and issubclass(entry, BaseModel):
                keys += _leaf_keys(entry, f"{prefix}{name}[].")
    return keys


def _unknown_key(key: str) -> ConfigError:
    index = re.search(r"\[\d+\]", key)     # an entry of a list of sections: mesh.stages[1].x
    close = difflib.get_close_matches(re.sub(r"\[\d+\]", "[]", key), _leaf_keys(), n=1, cutoff=0.6)
    close = [c.replace("[]", index.group(0)) for c in close] if index else close
    hint = f"; did you mean '{close[0]}'?" if close else "; run with --help-config for all keys"
    return ConfigError(f"unknown key '{key}'{hint}")


def _check_keys(values: dict, model: type[BaseModel] = Config, prefix: str = "") -> None:
    """Rejects unknown keys anywhere in values, before pydantic, so the suggestion is ours."""
    for key, value in values.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            raise _unknown_key(f"{prefix}{key}")
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            if isinstance(value, dict) and typing.get_origin(section) is not dict:
                raise ConfigError(f"'{prefix}{key}' is a value, not a section: cannot set "
                                  f"'{prefix}{key}.{next(iter(value), '')}'")
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"'{prefix}{key}' is a section, not a value: set its keys, "
                              f"e.g. {prefix}{key}.{next(iter(section.model_fields))}=...")
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
    """A nested dict of overrides -> Config, or ConfigError listing every problem."""
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
    return {k: ({} if v is None and k in Config.model_fields and k not in ("run_dir", "seed")
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


def _allowed(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return " (one of: " + ", ".join(typing.get_args(annotation)) + ")"
    return ""


def describe(model: type[BaseModel] = Config, indent: str = "") -> str:
    """Every key with its default and description, as YAML (the defaults file nobody edits)."""
    lines = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            lines.append(f"{indent}{name}:")
            lines.append(describe(field.annotation, indent + "  "))
            continue
        value = yaml.safe_dump(field.default, default_flow_style=True).strip()
        value = value.removesuffix("\n...").removesuffix("...").strip()
        lines.append(f"{indent}{name}: {value}  # {field.description}{_allowed(field.annotation)}")
    return "\n".join(lines)
