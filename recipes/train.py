"""One training run from a resolved config: parse -> build -> train -> close.

    cfg = config.load("configs/gpt_tiny.yaml", ["cluster.backend=inprocess"])
    summary = train.run(cfg)   # {"first_loss", "last_loss", "eval_loss", "steps", "run_dir"}

The recipe only combines library parts (models/, mpmd.Pipeline / split / Trainer, a cluster,
mpmd.recipes.data, mpmd.recipes.run_log); each piece is one small function below. A run leaves in
<run_dir>: config.yaml (resolved, written before the first step), metrics.jsonl, tb/,
trace.json (the steps in log.trace_steps), logs/ (recipes/console.py) and, for a GPT or Llama
on text, sample.txt.

Problems a user's config causes at build time (a custom module that does not import, a stage
count the model cannot take, a backend whose package is not installed, too few devices for
the in-process backend) raise ConfigError naming the key before any worker starts, so
`mpmd train` reports them like a bad key. So do a run_dir that is not a writable directory
and a resume whose config changes the math (the MATH_KEYS of recipes/config.py) without
allow_config_change. Checkpoints that cannot be restored or saved raise CheckpointError; a
step whose loss or gradient norm is not finite raises NonFinite (train.on_nonfinite=stop).
Any other error is a bug and stays itself.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import optax

import mpmd
from mpmd.recipes import config as config_lib
from mpmd.recipes import console
from mpmd.recipes import data
from mpmd.recipes import exact_match
from mpmd.recipes import generate
from mpmd.recipes import preempt
from mpmd.recipes import registry
from mpmd.recipes import run_log
from mpmd.recipes import tokenizer as tokenizer_lib
from mpmd.lowering import core as lowering
from mpmd.report import html as report_html, record as report_record
from mpmd.schedules import core as schedules
from mpmd.stages import leaf_paths
from mpmd.stages import sharding
from mpmd.train.checkpoints import CheckpointError, NonFinite  # noqa: F401  (raised through run())
from mpmd.stages.sharding import LayoutError
from mpmd.stages.split import cut
from mpmd.recipes.config import Config, ConfigError
from mpmd.train.options import Checkpointing, Recovery
from mpmd.runtime.worker.slice_store import CheckpointStore
from mpmd.runtime.launchers.ray import RayMissingError
from mpmd.runtime.launchers.shared import JobRefused


@contextlib.contextmanager
def _config_problem(key: str, errors: tuple[type[Exception], ...] = (ValueError,)):
    """An error of `errors` raised inside comes from the config's value of `key` (a stage count
    the model cannot take, arguments a cluster refuses): re-raise it as ConfigError naming it."""
    try:
        yield
    except ConfigError:
        raise
    except errors as e:
        raise ConfigError(f"{key}: {e}") from e


# -- build ---------------------------------------------------------------------------------
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
    spec = registry.get_model_spec(cfg.model.kind)
    built, loss_fn = _built(cfg, abstract)
    stages = spec.split(cfg, built, sample_input)
    return (stages if stages is not None else split_stages(cfg, built, sample_input)), loss_fn


def split_stages(cfg: Config, built, sample_input) -> list:
    """The usual split: a model with .layers() by mpmd.split (at pipeline.cuts, else balanced
    by cost), a list of stages as it is (or runs of it at pipeline.cuts)."""
    num_stages, cuts = cfg.pipeline.num_stages, cfg.pipeline.cuts
    if callable(getattr(built, "layers", None)):
        with _config_problem(f"pipeline.num_stages={num_stages}" if cuts is None else f"pipeline.cuts={cuts}"):
            return mpmd.split(built, num_stages, sample_input, cuts=cuts)  # Stages: leaves named by model path
    stages = built if isinstance(built, list) else list(built)  # mpmd.split's Stages keep their paths
    if cuts is not None:  # a run of the builder's stages per pipeline stage
        with _config_problem(f"pipeline.cuts={cuts}"):
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
    built, loss_fn = _built(cfg, abstract=False)
    units = spec.units(cfg, built)
    if units is None:
        units = list(built.layers()) if callable(getattr(built, "layers", None)) else list(built)
    return units, loss_fn


def _built(cfg: Config, abstract: bool):
    """(model or list of stages, loss_fn) as model.kind's spec builds them."""
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
    with _config_problem(f"cluster.backend='{c.backend}'", (ValueError, RayMissingError)):
        # failure_timeout_s: null (or a backend without it) leaves the cluster's own default.
        failure_timeout_s = getattr(c, "failure_timeout_s", None)
        timeouts = dict(
            step_timeout_s=c.step_timeout_s,
            **({"failure_timeout_s": failure_timeout_s} if failure_timeout_s is not None else {}),
        )
        if hasattr(c, "transport"):  # the backends whose slices are worker processes
            timeouts["transport"] = c.transport
        return registry.get_backend_spec(c.backend).build(cfg, timeouts)


def trainer_options(cfg: Config, metadata: dict) -> tuple[Checkpointing, Recovery]:
    """The Trainer's option records of the checkpoint section (with `metadata` in every
    manifest) and of the cluster section's recovery keys; the config checked both rules
    already, by building them."""
    return cfg.checkpoint.record(metadata), cfg.cluster.recovery(cfg.train.on_nonfinite)


# -- pieces of the loop --------------------------------------------------------------------
def _args(batch) -> tuple:
    """A loader's batch as the Trainer takes it: (inputs, targets), or a batch dict alone."""
    return batch if isinstance(batch, tuple) else (batch,)


def evaluate(trainer: mpmd.Trainer, eval_loader: data.Loader, num_batches: int) -> float:
    """Mean forward-only loss over the same first num_batches eval batches every time."""
    losses = [trainer.evaluate(*_args(eval_loader.batch_at(i))) for i in range(num_batches)]
    return float(np.mean(losses))


def sample(trainer: mpmd.Trainer, cfg: Config, prompt: str, num_tokens: int) -> str:
    """The prompt and its continuation by num_tokens tokens, drawn as train.sample_temperature
    and train.sample_top_k say (mpmd.models.decoding.next_token), from a generator seeded by
    cfg.seed: the same run samples the same text. Decoded as `mpmd generate` decodes
    (mpmd.recipes.generate), with the key-value cache, from the trainer's parameters fetched
    to this process."""
    model = generate.model_with(cfg, generate.trainer_params(trainer))
    t = cfg.train
    return generate.continue_text(
        model, generate.tokenizer_of(cfg.run_dir), prompt, num_tokens, t.sample_temperature, t.sample_top_k, cfg.seed
    )[0]


def _first_microbatch(loader: data.Loader, num_microbatches: int):
    batch = loader.batch_at(0)
    inputs = batch[0] if isinstance(batch, tuple) else batch["inputs"]
    return inputs[: len(inputs) // num_microbatches]


def _first_micro(loader: data.Loader, rows: int) -> tuple:
    """(inputs, targets) of the first batch's first `rows` rows; a batch dict's as (dict, None)."""
    batch = loader.batch_at(0)
    if isinstance(batch, tuple):
        return tuple(part[:rows] for part in batch)
    return {k: v[:rows] for k, v in batch.items()}, None


def _should_eval(cfg: Config, step: int) -> bool:
    every = cfg.train.eval_every
    return every > 0 and (step % every == 0 or step == cfg.train.steps)


def resume_metadata(cfg: Config, allow_config_change: bool = False) -> dict:
    """What every manifest of this run records about its config: the math keys' hash and
    values. A run directory whose newest committed step has other values is refused
    (ConfigError listing the changed keys) unless allow_config_change; then both hashes
    are recorded."""
    now = {"math_hash": cfg.math_hash(), "math": cfg.math(), **data_metadata(cfg)}
    store = CheckpointStore(cfg.run_dir)
    committed = store.committed() if Path(cfg.run_dir).is_dir() else []
    saved = store.manifest(committed[-1]) if committed else None
    _check_data_unchanged(cfg, saved or {}, now, allow_config_change)
    if not saved or "math_hash" not in saved or saved["math_hash"] == now["math_hash"]:
        return now
    changes = config_lib.math_changes(saved.get("math", {}), now["math"])
    if not changes:  # the same values, hashed as an older schema listed them
        return {**now, "math_hash_before": saved["math_hash"]}
    if not allow_config_change:
        raise ConfigError(
            f"run_dir={cfg.run_dir!r} holds checkpoints trained with other values "
            f"of keys that change training ({'; '.join(changes)}): resume with "
            f"the same values, use another run_dir, or pass --allow-config-change"
        )
    print(
        f"resuming with a changed config (math hash {saved['math_hash']} -> {now['math_hash']}): {'; '.join(changes)}"
    )
    return {**now, "math_hash_before": saved["math_hash"]}


def data_metadata(cfg: Config) -> dict:
    """What every manifest records of the data beyond the config's values: the tokenizer's
    content hash (a tokenizer other than bytes) and the tokenized corpus's (data.source=tokens).
    Nothing for the byte tokenizer on the byte corpus or synthetic data."""
    if cfg.data.source == "tokens":
        from mpmd.recipes import grain_data

        return grain_data.metadata(cfg)
    if cfg.data.source == "jsonl":
        from mpmd.recipes import sft

        return sft.metadata(cfg)
    if cfg.data.tokenizer != tokenizer_lib.BYTES:
        return {"tokenizer_hash": tokenizer_lib.load(cfg.data.tokenizer).hash}
    return {}


def _check_data_unchanged(cfg: Config, saved: dict, now: dict, allow_config_change: bool) -> None:
    """A checkpoint trained on another tokenizer or corpus (by content, whatever the paths) is
    refused (ConfigError naming both hashes) unless allow_config_change."""
    if "math_hash" not in saved:
        return
    changed = [
        f"{key} {saved.get(key, 'bytes' if key == 'tokenizer_hash' else None)} -> "
        f"{now.get(key, 'bytes' if key == 'tokenizer_hash' else None)}"
        for key in ("tokenizer_hash", "corpus_hash")
        if saved.get(key) != now.get(key)
        and not (key == "tokenizer_hash" and {saved.get(key), now.get(key)} <= {None, "bytes"})
    ]
    if not changed:
        return
    if not allow_config_change:
        raise ConfigError(
            f"run_dir={cfg.run_dir!r} holds checkpoints trained on other data ({'; '.join(changed)}): "
            f"the tokenizer or the tokenized corpus changed since; resume on the same ones, use "
            f"another run_dir, or pass --allow-config-change"
        )
    print(f"resuming on changed data: {'; '.join(changed)}")


def check_run_dir(run_dir: str) -> None:
    """run_dir and its checkpoints/ must be directories this process can write in; made if
    missing. Found here, before any worker starts, not when the first checkpoint fails."""
    for d in (Path(run_dir), Path(run_dir) / "checkpoints"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(d) else ""
            raise ConfigError(f"run_dir={run_dir!r}: cannot write in {d}{where}: {e.strerror or e}") from None


def check_layout(cfg: Config, pipeline, optimizer):
    """The run's mpmd.lowering.core.Layout; ConfigError naming the parameter a mesh cannot lay
    out (an axis that does not divide its dimension, a logical axis without a rule), or a
    mesh.fsdp_gather=per_step with nothing to gather, before any worker starts."""
    p = cfg.pipeline
    with _config_problem("mesh", (LayoutError,)):
        placement = schedules.make(p.schedule, pipeline.num_stages, p.num_microbatches, p.virtual_stages).placement
        meshes = sharding.slice_meshes(cfg.slice_shapes(), max(placement) + 1)
        lay = lowering.layout(
            pipeline, optimizer, meshes, placement, sharding.check_rules(layout_rules(cfg) or {}), cfg.mesh.fsdp_gather
        )
        lowering.check_gather(lay, placement)
    return lay


def layout_rules(cfg: Config) -> dict | None:
    """The logical-axis rules beyond mpmd's own: the family's, then mesh.rules over them;
    None when neither has any."""
    return {**registry.get_model_spec(cfg.model.kind).rules, **cfg.mesh.rules} or None


# -- the run -------------------------------------------------------------------------------
def run(cfg: Config, allow_config_change: bool = False, source: tuple[str | None, list[str]] = (None, [])) -> dict:
    """Trains cfg.train.steps steps; returns a summary of the run. `source`: the config file and
    key=value overrides cfg was loaded from, recorded for the report (mpmd.report.record)."""
    p = cfg.pipeline
    # Everything that can reject the config runs before a worker starts, and all but the
    # run directory's own check before a run directory exists.
    train_loader, eval_loader = data.make_loaders(cfg)
    sample_input = _first_microbatch(train_loader, p.num_microbatches)
    # Pretrained weights (model.init_from) are read stage by stage onto the slices: the model
    # here needs only its shapes.
    init_params = registry.get_model_spec(cfg.model.kind).init_params(cfg)
    stages, loss_fn = build_model(cfg, sample_input, abstract=init_params is not None)
    pipeline = mpmd.Pipeline(stages, loss_fn, sample_input=sample_input)
    optimizer = build_optimizer(cfg)
    metadata = resume_metadata(cfg, allow_config_change)
    if cfg.data.source == "tokens" or cfg.data.tokenizer != tokenizer_lib.BYTES:
        print(tokenizer_lib.vocab_note(tokenizer_lib.of_config(cfg), cfg.model.vocab_size))
    check_layout(cfg, pipeline, optimizer)
    cluster = build_cluster(cfg)  # checks the cluster keys; starts nothing yet
    check_run_dir(cfg.run_dir)  # the first thing written, once the config is known good
    controller_log = console.ControllerLog(cfg.run_dir, console.level(cfg.log.level))
    try:
        # A shared cluster's manager may refuse the job (JobRefused).
        with _config_problem(f"cluster.backend='{cfg.cluster.backend}'", (JobRefused,)):
            ckpt, recovery = trainer_options(cfg, metadata)
            trainer = mpmd.Trainer(
                pipeline,
                optimizer,
                schedule=p.schedule,
                num_microbatches=p.num_microbatches,
                cluster=cluster,
                virtual_stages=p.virtual_stages,
                max_grad_norm=cfg.optimizer.max_grad_norm,
                run_dir=cfg.run_dir,
                run_ahead=cfg.train.run_ahead,
                mesh=cfg.slice_shapes(),
                rules=layout_rules(cfg),
                fsdp_gather=cfg.mesh.fsdp_gather,
                checkpoint=ckpt,
                recovery=recovery,
                init_params=init_params,
            )
    except BaseException:
        cluster.close()  # whatever start() got going before it failed
        controller_log.close()
        raise
    abandon = False
    try:
        run_dir = Path(cfg.run_dir)
        config_lib.dump(cfg, run_dir / "config.yaml")
        tok = tokenizer_lib.of_config(cfg)
        tokenizer_lib.save_to_run(tok, run_dir)
        report_record.write_run_info(
            run_dir,
            pipeline,
            optimizer,
            trainer.schedule,
            *_first_micro(train_loader, len(sample_input)),
            *source,
            tokenizer={"spec": tok.spec, "hash": tok.hash, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
            layout=trainer.programs.layout,
        )
        return train(cfg, trainer, train_loader, eval_loader, run_dir)
    except preempt.Preempted:
        abandon = True  # out of time: what is in flight is dropped, the last commit stays
        raise
    finally:
        try:
            trainer.close(abandon=abandon)
        finally:
            controller_log.close()


def train(
    cfg: Config, trainer: mpmd.Trainer, train_loader: data.Loader, eval_loader: data.Loader, run_dir: Path
) -> dict:
    t = cfg.train
    lr = learning_rate(cfg)
    # Tokens for sequence models; examples (one "token" each) for a regressor.
    tokens_per_step = t.batch_size * registry.get_model_spec(cfg.model.kind).tokens_per_example(cfg)
    # A run directory with a committed checkpoint resumes from it (the Trainer restored every
    # slice when it started): the data order continues from the saved position, and metric
    # lines of steps after it belong to work that is about to be redone.
    start_step = 0
    if trainer.resumed is not None:
        start_step, data_state = trainer.resumed
        _seek(train_loader, data_state)
    metrics_log = run_log.MetricsLog(run_dir)
    metrics_log.truncate_after(start_step)
    # Where scalars go beside metrics.jsonl: TensorBoard, Weights & Biases.
    boards = ([run_log.TensorBoard(run_dir)] if cfg.log.tensorboard else []) + (
        [run_log.WandB(run_dir, cfg.log.wandb_project, cfg.model_dump(mode="json"))] if cfg.log.wandb else []
    )
    progress = run_log.Progress(t.steps, tokens_per_step, cfg.log.progress, cfg.log.every, start_step)
    # What happened before the next record's step, for the report (mpmd.report.load's marks).
    marks = {"resumed_from": start_step} if start_step else {}
    if start_step:
        progress.message(f"resumed from {run_dir}/checkpoints/{start_step}")
    if start_step >= t.steps:
        progress.message(
            f"nothing to train: the run is at step {start_step} and train.steps={t.steps}; "
            f"raise train.steps to train further"
        )
    if trainer.layout_change:
        progress.message(f"layout changed: {trainer.layout_change}")
    # Held-out exact match (train.exact_match): before the first step, then with each eval and
    # at the end; the first record carries the score before ("exact_match_before").
    scorer = exact_match.Scorer(cfg) if t.exact_match else None
    scores: dict[int, float] = {}
    if scorer is not None:
        scores[start_step] = marks["exact_match_before"] = scorer(trainer)
        progress.message(
            f"exact match on {len(scorer.examples)} held-out examples at step {start_step}: {scores[start_step]:.3f}"
        )
    traces: dict[int, list] = {}
    losses: dict[int, float] = {}  # step -> loss; a replayed step counts once
    eval_loss = None
    stop = preempt.StopRequest(t.preempt_grace_s)
    # Steps sent to the slices and not yet logged, oldest first: up to train.run_ahead are
    # sent beyond the oldest (Trainer.submit), so a slice starts the next step as soon as it
    # is done with the current one; a step's metrics are logged only once it is collected.
    pending: collections.deque = collections.deque()
    logged_changes = 0  # trainer.layout_changes already in a metrics record
    # What the family reads from its stages' state on eval steps (an MoE's routing counts),
    # when nothing runs ahead of the step, so the state is the step's own.
    read_state = registry.get_model_spec(cfg.model.kind).state_metrics(cfg)
    # step -> CRC-32 of its batch, logged with a tokens run's metrics: which data each step read.
    digests: dict[int, int] | None = {} if cfg.data.source == "tokens" else None
    try:
        step = done = start_step  # the last step sent, the last one collected and logged
        t_done = time.perf_counter()
        while True:
            try:
                # Never send past a step that evaluates: its eval must see the state after it.
                if (
                    step < t.steps
                    and not stop.requested
                    and len(pending) <= trainer.run_ahead
                    and not (pending and _should_eval(cfg, pending[-1][0]))
                ):
                    step += 1
                    batch = train_loader.next()
                    if digests is not None:
                        digests[step] = batch_crc32(batch)
                    pending.append(
                        (
                            step,
                            trainer.submit(
                                *_args(batch), trace=step in cfg.log.trace_steps, data_state=train_loader.state()
                            ),
                        )
                    )
                    continue
                if not pending:
                    # The final state is always committed: at the end, and when stopped by a
                    # signal. A slice lost before it committed rewinds like one lost in a step.
                    trainer.save(data_state=train_loader.state(), wait=True)
                    break
                done, sent = pending.popleft()
                out = sent.result()
                step_eval = evaluate(trainer, eval_loader, t.eval_batches) if _should_eval(cfg, done) else None
                if scorer is not None and (step_eval is not None or done == t.steps):
                    scores[done] = scorer(trainer)
            except mpmd.Rewound as e:
                # A slice was lost (and replaced, or left out); every slice is back at step
                # e.step, and the steps in flight were discarded with nothing of them applied
                # or logged.
                progress.message(f"recovered: {e}")
                marks["recovered"] = str(e)
                step = done = e.step
                pending.clear()
                losses = {k: v for k, v in losses.items() if k <= step}
                scores = {k: v for k, v in scores.items() if k <= step}
                _seek(train_loader, e.data_state)
                metrics_log.truncate_after(step)
                t_done = time.perf_counter()
                continue
            now = time.perf_counter()
            wall_s, t_done = now - t_done, now
            # optax evaluates the schedule at the count of updates already applied.
            record = {
                "loss": out["loss"],
                "step_s": out["step_s"],
                "tokens_per_s": tokens_per_step / wall_s,
                "lr": float(lr(done - 1)),
            }
            if "grad_norm" in out:
                record["grad_norm"] = out["grad_norm"]
            if "aux_loss" in out:  # the stages' auxiliary losses, included in "loss"
                record["aux_loss"] = out["aux_loss"]
            if "checkpoint" in out:  # the tiers this step was saved to
                record["checkpoint"] = out["checkpoint"]
            if "events" in out:
                traces[done] = out["events"]
                record["bubble"] = run_log.measured_bubble(out["events"])
                # Written at once, so a report of the run in progress shows the step.
                run_log.write_trace(run_dir / "trace.json", traces)
            if done in scores:
                record["exact_match"] = scores[done]
            if step_eval is not None:
                eval_loss = record["eval_loss"] = step_eval
                if read_state is not None:
                    record.update(read_state(done, state_by_path(trainer)))
            record.update(_elastic_record(trainer, logged_changes))
            logged_changes = len(trainer.layout_changes)
            losses[done] = out["loss"]
            # Not TensorBoard scalars: when it was logged, what happened before, the batch's CRC, peak bytes
            # per slice.
            metrics_log.write(
                done,
                {
                    **record,
                    "time": time.time(),
                    **marks,
                    **({"batch_crc32": digests.pop(done)} if digests is not None else {}),
                    **({"peak_bytes": out["peak_bytes"]} if "peak_bytes" in out else {}),
                },
            )
            marks = {}
            for board in boards:
                board.write(done, record)
                if done % cfg.log.every == 0:
                    board.flush()
            progress.update(done, record)
        if stop.requested:
            progress.message(
                f"stopped by {stop.requested} after step {step}; checkpoint committed, "
                f"resume with the same command" + (f" (exit code {preempt.PREEMPTED_EXIT})" if stop.preempted else "")
            )
        text = _final_sample(cfg, trainer, progress) if not stop.requested else None
        if text is not None:
            (run_dir / "sample.txt").write_text(text)
    finally:
        stop.restore()
        progress.close()
        for board in boards:
            board.close()
    summary = {
        "first_loss": losses[min(losses)] if losses else None,
        "last_loss": losses[max(losses)] if losses else None,
        "eval_loss": eval_loss,
        "steps": len(losses),
        "run_dir": str(run_dir),
        "goodput": trainer.goodput(),
        "preempted": stop.preempted,
    }
    if scores:
        summary["exact_match_before"], summary["exact_match"] = scores[min(scores)], scores[max(scores)]
    summary["report"] = str(report_html.write(run_dir))
    matched = f", exact match {summary['exact_match_before']:.3f} -> {summary['exact_match']:.3f}" if scores else ""
    print(
        f"done: {summary['steps']} steps, loss {_fmt(summary['first_loss'])} -> "
        f"{_fmt(summary['last_loss'])}, eval_loss {_fmt(eval_loss)}{matched}; wrote {run_dir}, "
        f"report {summary['report']}"
    )
    print(goodput_line(summary["goodput"]))
    return summary


def state_by_path(trainer: mpmd.Trainer) -> dict:
    """{path in the model (blocks.1.mlp.routed): host array} of every stage's state leaf, as
    checkpoints name them (`stage<k>/...` where a stage's parameters cannot say)."""
    pipeline, out = trainer.pipeline, {}
    for k, (fn, leaves) in enumerate(zip(pipeline.fns, trainer.state())):
        if fn.state is not None:
            paths = leaf_paths.state_paths(fn, pipeline.param_paths[k], k, pipeline.scoped_paths)
            out.update({path: leaves[local] for path, local in zip(paths, fn.state.paths)})
    return out


def batch_crc32(batch) -> int:
    """CRC-32 over a batch's arrays, key by key in sorted order (a pair as inputs, targets)."""
    import zlib

    arrays = batch if isinstance(batch, tuple) else [batch[k] for k in sorted(batch)]
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return crc


def _elastic_record(trainer: mpmd.Trainer, logged_changes: int) -> dict:
    """What a step's metrics record says about failures: the layout changes since the last
    record ("layout_changes") and, once anything was lost, the run's goodput so far
    ("goodput", cumulative: the last record has the totals)."""
    out = {}
    if len(trainer.layout_changes) > logged_changes:
        out["layout_changes"] = trainer.layout_changes[logged_changes:]
    goodput = trainer.goodput()
    if goodput["failures"] or goodput["layout_changes"]:
        out["goodput"] = goodput
    return out


def goodput_line(g: dict) -> str:
    """The summary's line on time lost to failures and run at reduced width."""
    if not g["failures"] and not g["layout_changes"]:
        return "goodput: no worker lost"
    return (
        f"goodput: {g['failures']} worker(s) lost, {g['lost_s']:.1f} s lost (aborted steps and detection "
        f"{g['aborted_s']:.1f} s, replacing {g['replace_s']:.1f} s, waiting for capacity "
        f"{g['capacity_s']:.1f} s, relayout {g['relayout_s']:.1f} s, "
        f"restore {g['restore_s']:.1f} s, {g['replayed_steps']} replayed step(s) {g['replayed_s']:.1f} s); "
        f"{g['reduced_width_s']:.1f} s on fewer slices, {g['layout_changes']} layout change(s)"
    )


def _seek(loader: data.Loader, data_state) -> None:
    """Put the loader where a checkpoint says it stood (the start when nothing was saved)."""
    loader.restore(data_state)


def _final_sample(cfg: Config, trainer: mpmd.Trainer, progress: run_log.Progress):
    t = cfg.train
    if not t.sample_tokens:
        return None
    if not registry.get_model_spec(cfg.model.kind).samples_text or cfg.data.source == "synthetic":
        # Only a language model trained on bytes has logits that decode to text.
        texts = [name for name, spec in registry.model_specs().items() if spec.samples_text]
        progress.message(
            f"sample skipped: needs model.kind={registry.one_of(texts)} on text data "
            f"(got '{cfg.model.kind}' on '{cfg.data.source}')"
        )
        return None
    text = sample(trainer, cfg, t.sample_prompt, t.sample_tokens)
    how = (
        "greedy"
        if t.sample_temperature == 0
        else f"temperature {t.sample_temperature:g}, top-k {t.sample_top_k or 'off'}, seed {cfg.seed}"
    )
    progress.message(f"sample ({t.sample_tokens} bytes, {how}) continuing the prompt {t.sample_prompt!r}:\n{text}")
    return text


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
