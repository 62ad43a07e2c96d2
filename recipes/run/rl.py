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
the end. With rl.kl_coef > 0 a frozen copy of the starting model on one more worker scores each
step's rows for the KL penalty, and each record has kl (k3 between sampler and reference).

Checkpoints: checkpoint.every and checkpoint.memory_every as for any run, and always at the end
(so `mpmd generate`, `mpmd export` and another run's model.init_from=run:<dir> read the trained
policy). Each holds GRPO's data state beside the learner's state: the next step and, with
rl.off_policy_steps=1, the samples drawn ahead for it. The same command again resumes from the
newest; a worker lost on either group is replaced and the run goes on from the newest state
saved, replaying the steps since (mpmd/rl/loop.py GRPO.run), bitwise as if uninterrupted.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np

from mpmd.groups.client import Groups
from mpmd.recipes import registry
from mpmd.recipes.config import Config
from mpmd.recipes.data import sft
from mpmd.recipes.data import tokenizer as tokenizer_lib
from mpmd.recipes.rl import rewards
from mpmd.recipes.rl.prompts import Prompts
from mpmd.recipes.run import build, console, generate
from mpmd.recipes.run.records import StepRecords
from mpmd.recipes.run.resume import resume_metadata
from mpmd.recipes.run.sinks import Sinks
from mpmd.recipes.run.records import record_run
from mpmd.recipes.run.train import final_sample, score_before, should_eval
from mpmd.rl import grpo as grpo_lib
from mpmd.rl.loop import GRPO
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
    template = generate.template_of(model)  # the end-of-run sample's model
    init_params = spec.init_params(cfg)
    optimizer = build.build_optimizer(cfg)
    ckpt, recovery = build.trainer_options(cfg, resume_metadata(cfg))
    cluster = build.build_cluster(cfg)
    build.check_run_dir(cfg.run_dir, cfg.run_dir_mode)
    controller_log = console.ControllerLog(cfg.run_dir, console.level(cfg.log.level))
    devices = cfg.cluster.devices_per_worker * cfg.cluster.processes_per_slice
    meshes = {"learner": cfg.slice_shapes(), "sampler": r.sampler_mesh.resolved(devices)}
    if r.kl_coef > 0:  # a frozen copy of the starting model, on a worker of its own
        meshes["reference"] = r.sampler_mesh.resolved(devices)
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
            kl_coef=r.kl_coef,
            reference="reference" if r.kl_coef > 0 else None,
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
            [[0]] * rows,
            [[0]] * rows,
            [[0.0]] * rows,
            np.zeros(rows),
            seq_len=model.seq_len,
            ref_logprobs=[[0.0]] * rows if r.kl_coef > 0 else None,
        )
        run_dir = record_run(cfg, grpo.trainer, (micro, None), source)
        return train(cfg, grpo, prompts, reward, run_dir, template)


def train(
    cfg: Config,
    run: GRPO,
    prompts: Prompts,
    reward: rewards.TokenReward,
    run_dir: Path,
    template: tuple | None = None,
) -> dict:
    """The loop: GRPO.run's steps (it overlaps sampling and training itself with
    rl.off_policy_steps=1, and recovers a lost worker of either group), each step's record to
    the run's Sinks; a recovery rewinds them to the step the learner is back at. `template`:
    the model as generate.template_of keeps it, for the end-of-run sample."""
    t, r = cfg.train, cfg.rl
    trainer = run.trainer
    start = run.step_count  # > 0 when the run directory's checkpoint was resumed
    tokens_per_step = r.prompts_per_step * r.num_samples * cfg.model.seq_len  # the learner's rows
    sinks = Sinks(cfg, run_dir, tokens_per_step, start)
    records = StepRecords(cfg, tokens_per_step, start)
    if start:
        sinks.message(f"resumed from {run_dir}/checkpoints/{start}")
    scorer = score_before(cfg, trainer, records, sinks, start)

    def prompts_of(s: int):  # GRPO's step s (from 0) is the run's step s + 1
        ids = prompts.of_step(s, r.prompts_per_step, r.seed)
        tokens, texts, responses = prompts.take(ids)
        reward.use(tokens, texts, responses)
        return tokens, ids

    rewards_seen: dict[int, float] = {}
    clock = [time.perf_counter()]

    def on_step(s: int, out: dict) -> None:
        step, now = s + 1, time.perf_counter()
        wall_s, clock[0] = now - clock[0], now
        if scorer is not None and should_eval(cfg, step):
            records.scores[step] = scorer(trainer)
        record, extra = records.build(trainer, step, {"loss": out["loss"], "step_s": wall_s}, wall_s, None, sinks)
        record.update(reward=out["reward"], completion_length=out["length"])
        if "kl" in out:
            record["kl"] = out["kl"]
        rewards_seen[step] = out["reward"]
        sinks.write(step, record, extra)

    def on_rewind(s: int, rewound) -> None:
        sinks.message(f"recovered: {rewound}")
        records.rewind(s, str(rewound))
        sinks.rewind(s)
        clock[0] = time.perf_counter()

    try:
        run.run(prompts_of, t.steps, on_step, on_rewind)
        # The policy, for generate, export and model.init_from=run:, and where to go on from.
        trainer.save(data_state=run.data_state(), wait=True)
        text = final_sample(cfg, trainer, sinks, template)
        if text is not None:
            (run_dir / "sample.txt").write_text(text)
    finally:
        sinks.close()
    summary = records.summary(trainer, run_dir, preempted=False)
    if rewards_seen:
        first, last = rewards_seen[min(rewards_seen)], rewards_seen[max(rewards_seen)]
        summary["reward_first"], summary["reward_last"] = first, last
        print(f"reward (mean over each step's completions) {first:.3f} -> {last:.3f}")
    return summary
