"""One GRPO run from a resolved config with rl.algorithm='grpo' (recipes/run/train.py hands it
over): mpmd.rl.GRPO on mpmd.Groups, the learner on the pipeline's slices, the sampler on one
more worker, the prompts those of data.path's fine-tuning examples.

    cfg = config.load("configs/llama_grpo.yaml")
    summary = rl.run(cfg)   # {"first_loss", ..., "exact_match_before", "exact_match", "reward_first", ...}

The pieces are the library's: the model as model.kind's family builds it (its parameters from
model.init_from, e.g. run:runs/llama_sft), the optimizer of the optimizer section, the learner's
meshes of the mesh section, the sampler's of rl.sampler_mesh. What the run directory holds is
what an ordinary run leaves (config.yaml, run.json, metrics.jsonl, tb/, logs/, report.html,
sample.txt, the summary line), but no trace. Each step's record has reward (the mean over its
prompts_per_step x num_samples completions), completion_length (their mean tokens, the end
marker included), loss (GRPO's, token-weighted), step_s (sampling and training) and lr; the
held-out exact match (train.exact_match examples, greedy, recipes/data/exact_match.py) is
scored on the learner's parameters before the first step, every train.eval_every steps and at
the end. No KL penalty (the loop has no reference model yet), so none is logged.

Checkpoints: the parameters are saved once, at the end (checkpoint.every=0 is required), so
`mpmd generate`, `mpmd export` and another run's model.init_from=run:<dir> read the trained
policy. Resuming an RL run is not built: a run_dir that already holds a checkpoint is refused.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np

from mpmd.groups.client import Groups
from mpmd.recipes import registry
from mpmd.recipes.config import Config, ConfigError
from mpmd.recipes.data import exact_match, sft
from mpmd.recipes.data import tokenizer as tokenizer_lib
from mpmd.recipes.rl import rewards
from mpmd.recipes.rl.prompts import Prompts
from mpmd.recipes.run import build, console
from mpmd.recipes.run.records import StepRecords
from mpmd.recipes.run.resume import resume_metadata
from mpmd.recipes.run.sinks import Sinks
from mpmd.recipes.run.train import final_sample, record_run, should_eval
from mpmd.rl import grpo as grpo_lib
from mpmd.rl.loop import GRPO
from mpmd.runtime.worker.slice_store import CheckpointStore
from mpmd.train.layout import Mesh


def run(cfg: Config, source: tuple[str | None, list[str]] = (None, [])) -> dict:
    """Trains cfg.train.steps GRPO steps; returns the run's summary."""
    r = cfg.rl
    # What can reject the config runs before a worker starts: the data, the reward, the model.
    tok = tokenizer_lib.of_config(cfg)
    prompts = Prompts.of(sft.splits(cfg)[0], tok, room=cfg.model.seq_len - r.max_new_tokens)
    reward = rewards.TokenReward(rewards.resolve(r.reward), tok, sft.end_marker(tok), r.max_new_tokens)
    spec = registry.get_model_spec(cfg.model.kind)
    model = spec.build(cfg, False)  # whole: the sampler is built from it (its parameters from the learner)
    model = model[0] if isinstance(model, tuple) else model  # a family may pair it with its loss
    init_params = spec.init_params(cfg)
    optimizer = build.build_optimizer(cfg)
    if Path(cfg.run_dir).is_dir() and CheckpointStore(cfg.run_dir).committed():
        raise ConfigError(
            f"run_dir={cfg.run_dir!r} holds checkpoints: resuming an rl run is not built yet; use another run_dir"
        )
    ckpt, recovery = build.trainer_options(cfg, resume_metadata(cfg))
    cluster = build.build_cluster(cfg)
    build.check_run_dir(cfg.run_dir, cfg.run_dir_mode)
    controller_log = console.ControllerLog(cfg.run_dir, console.level(cfg.log.level))
    devices = cfg.cluster.devices_per_worker * cfg.cluster.processes_per_slice
    meshes = {"learner": cfg.slice_shapes(), "sampler": r.sampler_mesh.resolved(devices)}
    try:
        groups = Groups(cluster, meshes, cfg.run_dir)  # starts every worker
    except BaseException:
        cluster.close()  # whatever start() got going before it failed
        controller_log.close()
        raise
    with contextlib.ExitStack() as closing:  # last opened, first closed; each closed whatever the others do
        closing.callback(controller_log.close)
        closing.callback(groups.close)
        p = cfg.pipeline
        grpo = GRPO(
            groups,
            model,
            optimizer,
            reward=reward,
            num_stages=p.num_stages,
            num_samples=r.num_samples,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_k=r.top_k,
            end_token=reward.end_token,
            clip_eps=r.clip_eps,
            off_policy_steps=r.off_policy_steps,
            seed=r.seed,
            schedule=p.schedule,
            num_microbatches=p.num_microbatches,
            virtual_stages=p.virtual_stages,
            mesh=Mesh(cfg.slice_shapes(), build.layout_rules(cfg), cfg.mesh.fsdp_gather),
            max_grad_norm=cfg.optimizer.max_grad_norm,
            run_dir=cfg.run_dir,
            checkpoint=ckpt,
            recovery=recovery,
            init_params=init_params,
        )
        closing.callback(grpo.close)
        rows = r.prompts_per_step * r.num_samples // p.num_microbatches  # one microbatch, for run.json
        micro = grpo_lib.learner_batch(
            [[0]] * rows, [[0]] * rows, [[0.0]] * rows, np.zeros(rows), seq_len=model.seq_len
        )
        run_dir = record_run(cfg, grpo.trainer, (micro, None), source)
        return train(cfg, grpo, prompts, reward, run_dir)


def train(cfg: Config, run: GRPO, prompts: Prompts, reward: rewards.TokenReward, run_dir: Path) -> dict:
    """The loop: one GRPO step at a time (GRPO overlaps sampling and training itself with
    rl.off_policy_steps=1), each step's record to the run's Sinks."""
    t, r = cfg.train, cfg.rl
    trainer = run.trainer
    tokens_per_step = r.prompts_per_step * r.num_samples * cfg.model.seq_len  # the learner's rows
    sinks = Sinks(cfg, run_dir, tokens_per_step, 0)
    records = StepRecords(cfg, tokens_per_step, 0)
    scorer = exact_match.Scorer(cfg) if t.exact_match else None
    if scorer is not None:
        records.scores[0] = records.marks["exact_match_before"] = scorer(trainer)
        sinks.message(f"exact match on {len(scorer.examples)} held-out examples at step 0: {records.scores[0]:.3f}")
    of_step = lambda s: prompts.of_step(s - 1, r.prompts_per_step, r.seed) if s <= t.steps else None
    rewards_seen: list[float] = []
    try:
        for step in range(1, t.steps + 1):
            ids, ahead = of_step(step), of_step(step + 1) if r.off_policy_steps else None
            tokens, texts, responses = prompts.take(ids)
            reward.use(tokens, texts, responses)
            start = time.perf_counter()
            out = run.step(tokens, ids, None if ahead is None else prompts.take(ahead)[0], ahead)
            wall_s = time.perf_counter() - start
            if scorer is not None and should_eval(cfg, step):
                records.scores[step] = scorer(trainer)
            record, extra = records.build(trainer, step, {"loss": out["loss"], "step_s": wall_s}, wall_s, None, sinks)
            record.update(reward=out["reward"], completion_length=out["length"])
            rewards_seen.append(out["reward"])
            sinks.write(step, record, extra)
        trainer.save(wait=True)  # the policy, for generate, export and model.init_from=run:
        text = final_sample(cfg, trainer, sinks)
        if text is not None:
            (run_dir / "sample.txt").write_text(text)
    finally:
        sinks.close()
    summary = records.summary(trainer, run_dir, preempted=False)
    summary["reward_first"], summary["reward_last"] = rewards_seen[0], rewards_seen[-1]
    print(f"reward (mean over each step's completions) {rewards_seen[0]:.3f} -> {rewards_seen[-1]:.3f}")
    return summary
