"""A run's parts from its config: the model cut into stages, the optimizer, the cluster, the
Trainer's option records, the checked layout. Each raises ConfigError naming the key a
problem comes from, before any worker starts (recipes/run/train.py, the dry run and
`mpmd tune` build from here alike)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

import optax

import mpmd
from mpmd.recipes import registry
from mpmd.recipes.config import Config, ConfigError
from mpmd.runtime.launchers.ray import RayMissingError
from mpmd.stages.sharding import LayoutError
from mpmd.stages.split import cut
from mpmd.train.layout import Mesh, RunLayout, run_layout
from mpmd.train.options import Checkpointing, Recovery


@contextlib.contextmanager
def config_problem(key: str, errors: tuple[type[Exception], ...] = (ValueError,)):
    """An error of `errors` raised inside comes from the config's value of `key` (a stage count
    the model cannot take, arguments a cluster refuses): re-raise it as ConfigError naming it."""
    try:
        yield
    except ConfigError:
        raise
    except errors as e:
        raise ConfigError(f"{key}: {e}") from e


def build_model(cfg: Config, sample_input=None, abstract: bool = False) -> tuple[list, Callable]:
    """(stages, loss_fn): model.kind's family (its ModelSpec, mpmd.recipes.registry) built
    and cut into cfg.pipeline.num_stages nnx.Module stages; `abstract` (where the family
    can): shapes only (mpmd.abstract), each stage initialised on its slice.

    `sample_input` (one microbatch of inputs) lets mpmd.split balance stages by FLOPs rather
    than by parameter count; pipeline.cuts, where given, says where to cut instead. A family
    may cut its model itself (a tied Llama, at stage marks). What the family builds is a
    model exposing `.layers()`, split like the built-in ones, or a list of stages, either
    alone or paired with its loss as (built, loss_fn); alone, its loss is the spec's.
    """
    built, loss_fn = built_model(cfg, abstract)
    return cut_model(cfg, built, sample_input), loss_fn


def cut_model(cfg: Config, built, sample_input=None) -> list:
    """built_model's model (or list of stages) cut into the pipeline's stages, as build_model says."""
    stages = registry.get_model_spec(cfg.model.kind).split(cfg, built, sample_input)
    return stages if stages is not None else split_stages(cfg, built, sample_input)


def split_stages(cfg: Config, built, sample_input) -> list:
    """The usual split: a model with .layers() by mpmd.split (at pipeline.cuts, else balanced
    by cost), a list of stages as it is (or runs of it at pipeline.cuts)."""
    num_stages, cuts = cfg.pipeline.num_stages, cfg.pipeline.cuts
    if callable(getattr(built, "layers", None)):
        with config_problem(f"pipeline.num_stages={num_stages}" if cuts is None else f"pipeline.cuts={cuts}"):
            return mpmd.split(built, num_stages, sample_input, cuts=cuts)  # Stages: leaves named by model path
    stages = built if isinstance(built, list) else list(built)  # mpmd.split's Stages keep their paths
    if cuts is not None:  # a run of the builder's stages per pipeline stage
        with config_problem(f"pipeline.cuts={cuts}"):
            return cut(stages, cuts)
    if len(stages) != num_stages:
        raise ConfigError(
            f"model.kind={cfg.model.kind!r} built {len(stages)} stages but "
            f"pipeline.num_stages={num_stages}; set pipeline.num_stages={len(stages)}"
        )
    return stages


def model_units(cfg: Config) -> tuple[list, Callable]:
    """(units, loss_fn): the pieces `mpmd tune` cuts stages from: the model's layers(), or a
    builder's own list of stages (unless the family says otherwise)."""
    spec = registry.get_model_spec(cfg.model.kind)
    built, loss_fn = built_model(cfg, abstract=False)
    units = spec.units(cfg, built)
    if units is None:
        units = list(built.layers()) if callable(getattr(built, "layers", None)) else list(built)
    return units, loss_fn


def built_model(cfg: Config, abstract: bool):
    """(model or list of stages, loss_fn) as model.kind's spec builds them, whole; `abstract`
    (where the family can): shapes only."""
    spec = registry.get_model_spec(cfg.model.kind)
    built = spec.build(cfg, abstract and spec.can_be_abstract(cfg))
    loss_fn = None
    if isinstance(built, tuple) and len(built) == 2 and callable(built[1]):
        built, loss_fn = built
    return built, (loss_fn if loss_fn is not None else spec.loss(cfg))


def learning_rate(cfg: Config) -> optax.Schedule:
    """Linear warmup from 0 to optimizer.lr over warmup_steps updates, then constant."""
    o = cfg.optimizer
    if o.warmup_steps == 0:
        return optax.constant_schedule(o.lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, o.lr, o.warmup_steps), optax.constant_schedule(o.lr)], [o.warmup_steps]
    )


def build_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The optax optimizer with the warmup schedule. No clipping here: an optax clip would
    see one stage's gradients only, so clipping is mpmd.Trainer(max_grad_norm=...), whose
    norm spans every stage."""
    o, lr = cfg.optimizer, learning_rate(cfg)
    if o.name == "adamw":
        return optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    if o.name == "adam":
        return optax.adam(lr, b1=o.b1, b2=o.b2)
    assert o.name == "sgd", o.name
    return optax.sgd(lr, momentum=o.b1 or None)


def build_cluster(cfg: Config):
    """The cluster object of cluster.backend's spec; workers start when the Trainer starts it."""
    c = cfg.cluster
    # Ray is optional: without it RayCluster raises RayMissingError (an ImportError), which
    # says how to install it.
    with config_problem(f"cluster.backend='{c.backend}'", (ValueError, RayMissingError)):
        # failure_timeout_s: null (or a backend without it) leaves the cluster's own default.
        failure_timeout_s = getattr(c, "failure_timeout_s", None)
        timeouts = dict(
            step_timeout_s=c.step_timeout_s,
            **({"failure_timeout_s": failure_timeout_s} if failure_timeout_s is not None else {}),
        )
        if hasattr(c, "transport"):  # the backends whose slices are worker processes
            timeouts["transport"] = c.transport
            if c.tls != "auto":  # auto: the backend's own default (its cluster class's tls=)
                timeouts["tls"] = False if c.tls == "off" else os.path.expanduser(c.tls)
            if c.hot_spares:
                timeouts["hot_spares"] = c.hot_spares
        cluster = registry.get_backend_spec(c.backend).build(cfg, timeouts)
    if hasattr(c, "probe_timeout_s") and hasattr(cluster, "probe_timeout_s"):
        cluster.probe_timeout_s = c.probe_timeout_s  # the control plane's (runtime/control/heartbeat.py)
    return cluster


def trainer_options(cfg: Config, metadata: dict) -> tuple[Checkpointing, Recovery]:
    """The Trainer's option records of the checkpoint section (with `metadata` in every
    manifest) and of the cluster section's recovery keys; the config checked both rules
    already, by building them."""
    return cfg.checkpoint.record(metadata), cfg.cluster.recovery(cfg.train.on_nonfinite)


def check_run_dir(run_dir: str, mode: str = "0700") -> None:
    """run_dir and its checkpoints/ must be directories this process can write in; made if
    missing. Found here, before any worker starts, not when the first checkpoint fails.

    Both get `mode` (run_dir_mode; 0700: the owner's only) whatever the umask, and this
    process's umask becomes the mode's complement, so that what the run writes (files 0600
    under 0700) and the local workers it starts (they inherit the umask) follow it."""
    bits = int(mode, 8)
    os.umask(0o777 & ~bits)
    for d in (Path(run_dir), Path(run_dir) / "checkpoints"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if d.stat().st_uid == os.getuid():
                os.chmod(d, bits)
            probe = d / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(d) else ""
            raise ConfigError(f"run_dir={run_dir!r}: cannot write in {d}{where}: {e.strerror or e}") from None


def check_layout(cfg: Config, pipeline, optimizer) -> RunLayout:
    """The run's checked layout (mpmd/train/layout.py: the schedule, each slice's mesh, every
    stage's layouts), as the Trainer takes it; ConfigError naming the parameter a mesh cannot
    lay out (an axis that does not divide its dimension, a logical axis without a rule), or a
    mesh.fsdp_gather=per_step with nothing to gather, before any worker starts."""
    p = cfg.pipeline
    mesh = Mesh(cfg.slice_shapes(), layout_rules(cfg), cfg.mesh.fsdp_gather)
    with config_problem("mesh", (LayoutError,)):
        return run_layout(pipeline, optimizer, p.schedule, p.num_microbatches, p.virtual_stages, mesh)


def layout_rules(cfg: Config) -> dict | None:
    """The logical-axis rules beyond mpmd's own: the family's, then mesh.rules over them;
    None when neither has any."""
    return {**registry.get_model_spec(cfg.model.kind).rules, **cfg.mesh.rules} or None
