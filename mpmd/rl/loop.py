"""GRPO across slice groups: a pipelined learner on one group, the sampler on another, weights
moved learner -> sampler after every update, under one controller.

    groups = Groups(mpmd.LocalCluster(3), {"learner": [{}, {}], "sampler": {}})
    rl = GRPO(groups, model, optax.sgd(0.05, momentum=0.9), reward=my_reward, num_stages=2,
              num_samples=4, max_new_tokens=8, end_token=eos)
    for step in range(100):
        metrics = rl.step(prompts, prompt_ids)      # {"loss", "reward", "length", ...}

One step t, on-policy (`off_policy_steps=0`):
  1. the learner's parameters w_t (after update t-1) go to the sampler's slice (WeightSync);
  2. the sampler program draws n completions of each prompt there (mpmd/rl/sampler.py), keyed
     by fold_in(seed, t) and the prompts' ids; the samples come back to the controller;
  3. rewards (a Python function of the prompt's and the completion's tokens, the end token
     not included), group-normalised advantages, the learner batch (mpmd/rl/grpo.py); with a
     reference group, the frozen reference's log-probabilities of the same rows, for KL;
  4. the Trainer steps on it: the GRPO loss, token-weighted, through the pipeline.
With `off_policy_steps=1` the sampler draws step t+1's samples from w_t while the learner
computes update t: the sampling run is launched before the training run, and each slice runs
its runs in order, the sampler's slice the sampling, the learner's slices (whose stream in that
run is empty) the training, at once. The batch of step t+1 was then sampled by the policy one
update behind the one it trains; the importance ratio in the loss corrects for it.

Every call goes through the Groups client, so nothing here waits for a worker except where a
result is needed on the controller: the samples (rewards are computed here) and the step's
metrics.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd.groups.client import Groups, Handle, Resident
from mpmd.runtime.control.cluster import PeerLost, WorkerLost
from mpmd.train.checkpoints import Rewound
from mpmd.rl import grpo, sampler
from mpmd.rl.sync import WeightSync
from mpmd.stages import sharding
from mpmd.stages.leaf_paths import path_string


class GroupSampler:
    """The sampler program on a group's slice, fed the learner's per-stage parameter handles
    (WeightSync's) and assembling the whole model there from them."""

    def __init__(self, groups: Groups, where, pipeline, model: nnx.Module, **settings):
        fn, leaves = sampler.program(model, **settings)
        paths = [path_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.split(model)[1])[0]]
        owner = {path: (k, j) for k, ps in enumerate(pipeline.param_paths) for j, path in enumerate(ps)}
        source = [owner.get(p) for p in paths]  # a parameter: (stage, leaf); else model state held here
        if not any(source):
            raise ValueError("the pipeline's parameters have no model paths: split the model with mpmd.split")
        self.groups, self.where = groups, where
        # What no stage trains (RNG counts, a frozen buffer), from the model as it is.
        self.rest = Resident(groups, [np.asarray(a) for a, s in zip(leaves, source) if s is None], where)
        self._slice = groups.slice_of(where)

        def program(*args):
            *stages, rest, inputs = args
            stage_leaves = [jax.tree.leaves(s) for s in stages]
            others = iter(rest)
            full = [stage_leaves[s[0]][s[1]] if s is not None else next(others) for s in source]
            return fn(full, inputs["prompts"], inputs["lens"], inputs["ids"], inputs["key"])

        self._program = program

    def __call__(self, params: Sequence[Handle], prompts, prompt_lens, prompt_ids, key_data) -> Handle:
        """A handle on the sampler's slice to the Samples of these prompts (arrays as
        sampler.program takes them; the key as uint32 key data)."""
        inputs = {
            "prompts": np.asarray(prompts, np.int32),
            "lens": np.asarray(prompt_lens, np.int32),
            "ids": np.asarray(prompt_ids, np.int32),
            "key": np.asarray(key_data, np.uint32),
        }
        # Rows split over the slice's batch axes where they divide (a data-parallel sampler).
        rows = sharding.batch_layout(inputs["prompts"].shape, self.groups.meshes[self._slice])
        fed = self.groups.put(inputs, self.where, {"prompts": rows, "lens": rows, "ids": rows, "key": P()})
        out = self.groups.run(self._program, *params, self.rest.handle, fed)
        self.groups.delete(fed)
        return out


class GroupReference:
    """A frozen copy of the model on a group's slice (its weights as given: the run's start)
    and the program that scores learner rows with it: log softmax(logits / temperature) at
    each target, for GRPO's KL term."""

    def __init__(self, groups: Groups, where, model: nnx.Module, temperature: float):
        graphdef, state = nnx.split(model)
        self.params = Resident(groups, [np.asarray(a) for a in jax.tree.leaves(state)], where)
        self.groups, self.where, treedef = groups, where, jax.tree.structure(state)

        def program(params, rows):
            frozen = nnx.merge(graphdef, jax.tree.unflatten(treedef, list(params)))
            frozen.eval()
            return grpo.token_logprobs(frozen(rows["inputs"]), rows["targets"], temperature)

        self._program = program

    def __call__(self, batch: dict) -> Handle:
        """A handle to the reference's log-probabilities [B, T] of the batch's targets."""
        rows = self.groups.put({"inputs": batch["inputs"], "targets": batch["targets"]}, self.where)
        out = self.groups.run(self._program, self.params.handle, rows)
        self.groups.delete(rows)
        return out


def padded(prompts: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompts right-padded to `width` with sampler.PAD, their lengths)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    if len(prompts) == 0 or lens.min() < 1 or lens.max() > width:
        raise ValueError(f"prompts must be 1..{width} tokens each, got lengths {lens.tolist()}")
    out = np.full((len(prompts), width), sampler.PAD, np.int32)
    for row, p in zip(out, prompts):
        row[: len(p)] = p
    return out, lens


class GRPO:
    """GRPO on `groups` (module docstring): a Trainer of `model` split into num_stages on the
    `learner` group, the sampler on the `sampler` group's slice. `reward(prompt, completion)`
    takes lists of token ids and returns a float. `trainer_kw` go to mpmd.Trainer (schedule,
    num_microbatches, mesh, ...); its mesh defaults to the learner group's meshes."""

    def __init__(
        self,
        groups: Groups,
        model: nnx.Module,
        optimizer,
        *,
        reward: Callable[[list, list], float],
        num_stages: int,
        num_samples: int = 4,
        max_new_tokens: int,
        prompt_len: int | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        end_token: int | None = None,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        reference: str | None = None,
        off_policy_steps: int = 0,
        seed: int = 0,
        learner: str = "learner",
        sampler_group: str = "sampler",
        **trainer_kw,
    ):
        if off_policy_steps not in (0, 1):
            raise ValueError(f"off_policy_steps must be 0 (on-policy) or 1 (sample ahead), got {off_policy_steps!r}")
        if kl_coef > 0 and reference is None:
            raise ValueError(f"kl_coef={kl_coef} needs a reference group to hold the frozen model (reference=...)")
        if num_samples < 2:
            raise ValueError(f"num_samples must be >= 2: GRPO compares each sample with its group's, got {num_samples}")
        self.groups, self.reward, self.num_samples = groups, reward, num_samples
        self.max_new_tokens, self.end_token, self.off_policy_steps = max_new_tokens, end_token, off_policy_steps
        self.seq_len = model.seq_len
        self.prompt_len = self.seq_len - max_new_tokens if prompt_len is None else prompt_len
        if not 1 <= self.prompt_len <= self.seq_len - max_new_tokens:
            raise ValueError(
                f"prompt_len {self.prompt_len} + max_new_tokens {max_new_tokens} must fit the model's "
                f"seq_len {self.seq_len}"
            )
        self._key = jax.random.key(seed)
        scale = 1.0 if temperature == 0 else temperature  # the sampler's log-probabilities' temperature
        loss = functools.partial(grpo.grpo_loss, clip_eps=clip_eps, kl_coef=kl_coef, temperature=scale)
        pipeline = mpmd.Pipeline(mpmd.split(model, num_stages=num_stages), loss)
        self.learner = groups.groups[learner]
        trainer_kw.setdefault("mesh", mpmd.Mesh([dict(m._asdict()) for m in self.learner.meshes]))
        self.trainer = mpmd.Trainer(pipeline, optimizer, cluster=groups.cluster_for(learner), **trainer_kw)
        self.sync = WeightSync(self.trainer, groups, learner, sampler_group)
        settings = dict(
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            end_token=end_token,
        )
        self.sampler = GroupSampler(groups, sampler_group, pipeline, model, **settings)
        self.reference = GroupReference(groups, reference, model, scale) if reference is not None else None
        self.step_count = 0
        self._ahead = None  # off-policy: (prompt ids, Samples) drawn for the next step
        self._pending = None  # the Trainer's step in flight
        self._stale = True  # the sampler's weights are not the learner's: sync before sampling
        self._to_free: list[Handle] = []
        if self.trainer.resumed is not None:  # a run_dir with a committed checkpoint: go on from it
            self._restart(self.trainer.resumed[1])

    def _sample(self, prompts, prompt_ids, step: int) -> Handle:
        tokens, lens = padded(prompts, self.prompt_len)
        key = jax.random.key_data(jax.random.fold_in(self._key, step))
        return self.sampler(self.sync.copies, tokens, lens, prompt_ids, key)

    def _batch(self, prompts, samples) -> tuple[dict, dict]:
        """(the learner batch, metrics of the samples) from fetched Samples."""
        n = self.num_samples
        lengths = np.asarray(samples.lengths)
        completions = [list(map(int, row[:k])) for row, k in zip(np.asarray(samples.tokens), lengths)]
        logprobs = [list(row[:k]) for row, k in zip(np.asarray(samples.logprobs), lengths)]
        ended = [c[-1] == self.end_token if self.end_token is not None and c else False for c in completions]
        rewards = np.array(
            [
                float(self.reward(list(prompts[i // n]), c[:-1] if e else c))
                for i, (c, e) in enumerate(zip(completions, ended))
            ],
            np.float32,
        ).reshape(len(prompts), n)
        advantages = grpo.group_advantages(rewards)
        rows = [list(prompts[i // n]) for i in range(len(completions))]
        batch = grpo.learner_batch(rows, completions, logprobs, advantages, seq_len=self.seq_len)
        metrics = {"reward": float(rewards.mean()), "length": float(lengths.mean())}
        if self.reference is not None:
            handle = self.reference(batch)
            ref = np.where(batch["loss_mask"] > 0, self.groups.fetch(handle), 0).astype(np.float32)
            self.groups.delete(handle)
            batch["ref_logprobs"] = ref
            # KL(sampler || reference) per completion token, Schulman's k3 as the loss has it.
            d = (ref - batch["old_logprobs"])[batch["loss_mask"] > 0].astype(np.float64)
            metrics["kl"] = float(np.mean(np.exp(d) - d - 1)) if d.size else 0.0
        return batch, metrics

    def run(self, prompts_of: Callable[[int], tuple], steps: int, on_step=None, on_rewind=None) -> list[dict]:
        """Steps from `step_count` to `steps`, with `prompts_of(t) -> (prompts, prompt_ids)`
        the prompts of step t (a function of t alone, so a replayed step gets the same ones).
        A worker lost on either group is replaced and the learner restored from its newest
        saved state (Trainer.recover; mpmd.Checkpointing decides what is saved); the steps
        after it are replayed, ending in the state and samples an uninterrupted run ends in.
        `on_step(t, metrics)` after each step, `on_rewind(t, rewound)` when the run goes back
        to step t; returns the metrics of the steps done by this call (a replayed step's, the
        last time)."""
        done: dict[int, dict] = {}
        while self.step_count < steps:
            t = self.step_count
            try:
                try:
                    nxt = prompts_of(t + 1) if self.off_policy_steps and t + 1 < steps else (None, None)
                    metrics = self.step(*prompts_of(t), *nxt)
                except WorkerLost as lost:
                    self._recover(lost)  # raises Rewound, or returns: step t again
                    continue
            except Rewound as rewound:
                self._rewound(rewound)
                if on_rewind is not None:
                    on_rewind(self.step_count, rewound)
                continue
            done[t] = metrics
            if on_step is not None:
                on_step(t, metrics)
        return [done[t] for t in sorted(done)]

    def step(self, prompts: Sequence[Sequence[int]], prompt_ids, next_prompts=None, next_ids=None) -> dict:
        """One GRPO step on `prompts` (lists of token ids; `prompt_ids` what each one's draws
        are keyed by). Off-policy, `next_prompts`/`next_ids` are the next step's, sampled now
        (while this step trains) from the weights it trains; the last step passes None.
        A lost worker raises WorkerLost or mpmd.Rewound; `run` recovers from both."""
        t = self.step_count
        if self._stale or self.off_policy_steps == 0:
            self.sync()
            self._stale = False
        if self._ahead is None:  # on-policy, the first step off-policy, or after a rewind
            samples = self.groups.fetch(self._drawn(self._sample(prompts, prompt_ids, t)))
        else:
            ahead_ids, samples = self._ahead
            if list(map(int, ahead_ids)) != list(map(int, prompt_ids)):
                raise ValueError("step's prompts are not the next_prompts the step before was given")
        self._ahead = None
        batch, metrics = self._batch(prompts, samples)
        handle = None
        if self.off_policy_steps and next_prompts is not None:
            # Drawn from the weights this step trains, while it trains: one update behind.
            handle = self._drawn(self._sample(next_prompts, next_ids, t + 1))
        data_state = {"next": t + 1, "ahead": None}
        self._pending = self.trainer.submit(batch, data_state=data_state)
        if handle is not None:
            ahead = self.groups.fetch(handle)  # waits for this step's training too
            # Saved with the step (both tiers take the data state when the step is collected):
            # a replay of step t + 1 trains on these samples, which no weights left can draw.
            data_state["ahead"] = [list(map(int, next_ids)), _encoded(ahead)]
            self._ahead = (next_ids, ahead)
            self._stale = True  # the next step's sampling sees this update: synced then
        metrics["loss"] = self._pending.result()["loss"]
        self._pending = None
        self.step_count += 1
        return metrics

    def _drawn(self, handle: Handle) -> Handle:
        """The handle, freed on its slice with the next call after it is fetched."""
        self._to_free.append(handle)
        if len(self._to_free) > 2:
            self.groups.delete(self._to_free.pop(0))
        return handle

    def _recover(self, lost: WorkerLost) -> None:
        """A call of ours found a worker lost. The learner's: the Trainer replaces it and
        restores its newest saved state (Rewound). The sampler's: a new worker; and if a step
        of the Trainer's is in flight, the Trainer restores too, without collecting it (its
        run may have been aborted with ours; if not, off-policy, the next step's samples that
        must be saved with it died with the sampler: it must not be the step restored to).
        With nothing in flight the learner is untouched and step t is simply done again."""
        pending, self._pending = self._pending, None
        self._stale = True
        r = lost.slice_index
        if r in self.learner.slices:
            self._ahead = None
            self.trainer.recover(WorkerLost(self.learner.slices.index(r), lost.address, str(lost)))
        self.groups.replace(r)
        if pending is not None:
            self._ahead = None
            self.trainer.recover(PeerLost(r, lost.address, str(lost)))

    def _rewound(self, rewound: Rewound) -> None:
        """Back at the step the learner was restored to: the samples saved with it, if any."""
        self._restart(rewound.data_state)

    def _restart(self, data_state) -> None:
        state = data_state or {"next": 0, "ahead": None}
        self.step_count = state["next"]
        self._pending, self._stale = None, True
        ahead = state.get("ahead")
        self._ahead = (ahead[0], _decoded(ahead[1])) if ahead is not None else None

    def data_state(self) -> dict:
        """What a checkpoint taken now must hold to go on from here (Trainer.save's data_state)."""
        ahead = None if self._ahead is None else [list(map(int, self._ahead[0])), _encoded(self._ahead[1])]
        return {"next": self.step_count, "ahead": ahead}

    def close(self) -> None:
        self.trainer.close(close_cluster=False)


def _encoded(samples) -> dict:
    """Samples as JSON (a data state goes into both checkpoint tiers): float32 log-probs are
    exact as JSON numbers, being exact as float64."""
    return {k: np.asarray(v).tolist() for k, v in samples._asdict().items()}


def _decoded(state: dict):
    dtypes = {"tokens": np.int32, "logprobs": np.float32, "lengths": np.int32}
    return sampler.Samples(**{k: np.asarray(state[k], dtypes[k]) for k in dtypes})
