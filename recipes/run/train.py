"""One training run from a resolved config: parse -> build -> train -> close.

    cfg = config.load("configs/gpt_tiny.yaml", ["cluster.backend=inprocess"])
    summary = train.run(cfg)   # {"first_loss", "last_loss", "eval_loss", "steps", "run_dir"}

The recipe only combines library parts (models/, mpmd.Pipeline / split / Trainer, a cluster,
mpmd.recipes.data.loaders, mpmd.recipes.run.run_log); each piece is one small function below. A run leaves in
<run_dir>: config.yaml (resolved, written before the first step), metrics.jsonl, tb/,
trace.json (the steps in log.trace_steps), logs/ (recipes/run/console.py) and, for a GPT or Llama
on text, sample.txt. A config with rl.algorithm set runs in recipes/run/rl.py instead (GRPO).

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
import os
import time
from pathlib import Path

import numpy as np

import mpmd
from mpmd.recipes import registry
from mpmd.recipes.config import Config, ConfigError
from mpmd.recipes.data import exact_match
from mpmd.recipes.data import loaders as data
from mpmd.recipes.data import tokenizer as tokenizer_lib
from mpmd.recipes.run import build, console, generate, preempt
from mpmd.recipes.run.records import StepRecords, record_run
from mpmd.recipes.run.resume import resume_metadata
from mpmd.recipes.run.sinks import Sinks
from mpmd.report import record as report_record
from mpmd.runtime.launchers.shared import JobRefused
from mpmd.train.checkpoints import CheckpointError, NonFinite  # noqa: F401  (raised through run())


# -- pieces of the loop --------------------------------------------------------------------
def _args(batch) -> tuple:
    """A loader's batch as the Trainer takes it: (inputs, targets), or a batch dict alone."""
    return batch if isinstance(batch, tuple) else (batch,)


def evaluate(trainer: mpmd.Trainer, eval_loader: data.Loader, num_batches: int) -> float:
    """Mean forward-only loss over the same first num_batches eval batches every time."""
    losses = [trainer.evaluate(*_args(eval_loader.batch_at(i))) for i in range(num_batches)]
    return float(np.mean(losses))


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


def should_eval(cfg: Config, step: int) -> bool:
    every = cfg.train.eval_every
    return every > 0 and (step % every == 0 or step == cfg.train.steps)


# -- the run -------------------------------------------------------------------------------
def run(cfg: Config, allow_config_change: bool = False, source: tuple[str | None, list[str]] = (None, [])) -> dict:
    """Trains cfg.train.steps steps; returns a summary of the run. `source`: the config file and
    key=value overrides cfg was loaded from, recorded for the report (mpmd.report.record)."""
    if cfg.rl.algorithm is not None:
        raise ConfigError(f"rl.algorithm={cfg.rl.algorithm!r} runs in mpmd.recipes.run.rl.run, a loop of its own")
    p = cfg.pipeline
    # Everything that can reject the config runs before a worker starts, and all but the
    # run directory's own check before a run directory exists.
    train_loader, eval_loader = data.make_loaders(cfg)
    sample_input = _first_microbatch(train_loader, p.num_microbatches)
    # Pretrained weights (model.init_from) are read stage by stage onto the slices: the model
    # here needs only its shapes.
    init_params = registry.get_model_spec(cfg.model.kind).init_params(cfg)
    built, loss_fn = build.built_model(cfg, abstract=init_params is not None)
    template = generate.template_of(built)  # the end-of-run sample's model, without building it again
    stages = build.cut_model(cfg, built, sample_input)
    pipeline = mpmd.Pipeline(stages, loss_fn, sample_input=sample_input)
    optimizer = build.build_optimizer(cfg)
    if registry.get_data_source(cfg.data.source).tokenizer is not None or cfg.data.tokenizer != tokenizer_lib.BYTES:
        print(tokenizer_lib.vocab_note(tokenizer_lib.of_config(cfg), cfg.model.vocab_size))
    layout = build.check_layout(cfg, pipeline, optimizer)
    cluster = build.build_cluster(cfg)  # checks the cluster keys; starts nothing yet
    # A shared cluster's job claims its run_dir first: one that overlaps another job's is
    # refused before anything under it is read (resume_metadata) or written.
    if hasattr(cluster, "claim"):
        with build.config_problem(f"cluster.backend='{cfg.cluster.backend}'", (JobRefused,)):
            cluster.claim(len(layout.meshes), os.path.abspath(cfg.run_dir), list(layout.meshes))
    try:
        metadata = resume_metadata(cfg, allow_config_change)
        build.check_run_dir(cfg.run_dir, cfg.run_dir_mode)  # the first thing written, once the config is known good
    except BaseException:
        cluster.close()
        raise
    controller_log = console.ControllerLog(cfg.run_dir, console.level(cfg.log.level))
    micro = _first_micro(train_loader, len(sample_input))
    memory = report_record.memory_meanwhile(pipeline, optimizer, layout.schedule, micro, layout.layout)
    try:
        # A shared cluster's manager may refuse the job (JobRefused).
        with build.config_problem(f"cluster.backend='{cfg.cluster.backend}'", (JobRefused,)):
            ckpt, recovery = build.trainer_options(cfg, metadata)
            trainer = mpmd.Trainer(
                pipeline,
                optimizer,
                layout=layout,
                cluster=cluster,
                max_grad_norm=cfg.optimizer.max_grad_norm,
                run_dir=cfg.run_dir,
                run_ahead=cfg.train.run_ahead,
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
        # The layout traced for is the Trainer's unless it started on another (a resumed run's).
        same = trainer.schedule is layout.schedule and trainer.programs.layout is layout.layout
        run_dir = record_run(cfg, trainer, micro, source, memory.result() if same else None)
        return train(cfg, trainer, train_loader, eval_loader, run_dir, template)
    except preempt.Preempted:
        abandon = True  # out of time: what is in flight is dropped, the last commit stays
        raise
    finally:
        try:
            trainer.close(abandon=abandon)
        finally:
            controller_log.close()


def train(
    cfg: Config,
    trainer: mpmd.Trainer,
    train_loader: data.Loader,
    eval_loader: data.Loader,
    run_dir: Path,
    template: tuple | None = None,
) -> dict:
    """The loop: a window of steps sent ahead (train.run_ahead) and collected in order, each
    collected step's record (StepRecords) handed to the run's Sinks; a lost slice rewinds the
    window to the step every slice is back at (mpmd.Rewound). `template`: the run's model as
    generate.template_of keeps it, for the end-of-run sample."""
    t = cfg.train
    # Tokens for sequence models; examples (one "token" each) for a regressor.
    tokens_per_step = t.batch_size * registry.get_model_spec(cfg.model.kind).tokens_per_example(cfg)
    # A run directory with a committed checkpoint resumes from it (the Trainer restored every
    # slice when it started): the data order continues from the saved position.
    start_step = 0
    if trainer.resumed is not None:
        start_step, data_state = trainer.resumed
        _seek(train_loader, data_state)
    sinks = Sinks(cfg, run_dir, tokens_per_step, start_step)
    records = StepRecords(cfg, tokens_per_step, start_step)
    if start_step:
        sinks.message(f"resumed from {run_dir}/checkpoints/{start_step}")
    if start_step >= t.steps:
        sinks.message(
            f"nothing to train: the run is at step {start_step} and train.steps={t.steps}; "
            f"raise train.steps to train further"
        )
    if trainer.layout_change:
        sinks.message(f"layout changed: {trainer.layout_change}")
    scorer = score_before(cfg, trainer, records, sinks, start_step)
    stop = preempt.StopRequest(t.preempt_grace_s)
    # Steps sent to the slices and not yet logged, oldest first: up to train.run_ahead are
    # sent beyond the oldest (Trainer.submit), so a slice starts the next step as soon as it
    # is done with the current one; a step's metrics are logged only once it is collected.
    pending: collections.deque = collections.deque()
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
                    and not (pending and should_eval(cfg, pending[-1][0]))
                ):
                    step += 1
                    batch = train_loader.next()
                    records.sent(step, batch)
                    trace = step in cfg.log.trace_steps
                    pending.append((step, trainer.submit(*_args(batch), trace=trace, data_state=train_loader.state())))
                    continue
                if not pending:
                    # The final state is always committed: at the end, and when stopped by a
                    # signal. A slice lost before it committed rewinds like one lost in a step.
                    trainer.save(data_state=train_loader.state(), wait=True)
                    break
                done, sent = pending.popleft()
                out = sent.result()
                step_eval = evaluate(trainer, eval_loader, t.eval_batches) if should_eval(cfg, done) else None
                if scorer is not None and (step_eval is not None or done == t.steps):
                    records.scores[done] = scorer(trainer)
            except mpmd.Rewound as e:
                # A slice was lost (and replaced, or left out); every slice is back at step
                # e.step, and the steps in flight were discarded with nothing of them applied
                # or logged.
                sinks.message(f"recovered: {e}")
                step = done = e.step
                pending.clear()
                records.rewind(step, str(e))
                _seek(train_loader, e.data_state)
                sinks.rewind(step)
                t_done = time.perf_counter()
                continue
            now = time.perf_counter()
            wall_s, t_done = now - t_done, now
            sinks.write(done, *records.build(trainer, done, out, wall_s, step_eval, sinks))
        if stop.requested:
            sinks.message(
                f"stopped by {stop.requested} after step {step}; checkpoint committed, "
                f"resume with the same command" + (f" (exit code {preempt.PREEMPTED_EXIT})" if stop.preempted else "")
            )
        text = final_sample(cfg, trainer, sinks, template) if not stop.requested else None
        if text is not None:
            (run_dir / "sample.txt").write_text(text)
    finally:
        stop.restore()
        sinks.close()
    return records.summary(trainer, run_dir, stop.preempted)


def score_before(cfg: Config, trainer, records, sinks, step: int):
    """Held-out exact match (train.exact_match) at `step`, before training on: scored again with
    each eval and at the end; the first record carries it ("exact_match_before"). The Scorer,
    or None when the config scores nothing."""
    scorer = exact_match.Scorer(cfg) if cfg.train.exact_match else None
    if scorer is not None:
        records.scores[step] = records.marks["exact_match_before"] = scorer(trainer)
        sinks.message(
            f"exact match on {len(scorer.examples)} held-out examples at step {step}: {records.scores[step]:.3f}"
        )
    return scorer


def _seek(loader: data.Loader, data_state) -> None:
    """Put the loader where a checkpoint says it stood (the start when nothing was saved)."""
    loader.restore(data_state)


def final_sample(cfg: Config, trainer: mpmd.Trainer, sinks: Sinks, template: tuple | None = None):
    t = cfg.train
    if not t.sample_tokens:
        return None
    if not registry.get_model_spec(cfg.model.kind).samples_text or not registry.get_data_source(cfg.data.source).text:
        # Only a language model trained on text has logits that decode to text.
        texts = [name for name, spec in registry.model_specs().items() if spec.samples_text]
        sources = [name for name, spec in registry.data_sources().items() if spec.text]
        sinks.message(
            f"sample skipped: needs model.kind={registry.one_of(texts)} on data.source={registry.one_of(sources)} "
            f"(got '{cfg.model.kind}' on '{cfg.data.source}')"
        )
        return None
    text = generate.sample_of(trainer, cfg, t.sample_prompt, t.sample_tokens, template)
    how = (
        "greedy"
        if t.sample_temperature == 0
        else f"temperature {t.sample_temperature:g}, top-k {t.sample_top_k or 'off'}, seed {cfg.seed}"
    )
    sinks.message(f"sample ({t.sample_tokens} bytes, {how}) continuing the prompt {t.sample_prompt!r}:\n{text}")
    return text
