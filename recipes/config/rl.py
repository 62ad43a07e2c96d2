"""rl.*: reinforcement learning from a fine-tuned start (recipes/run/rl.py runs it): which
algorithm, the reward, the sampler's settings and slice. Null rl.algorithm (the default) is
ordinary training and reads none of the other keys.

A reward that does not import, is not a function or does not take the reward's arguments is
refused while the config loads (mpmd.recipes.rl.rewards.resolve), before JAX or a worker starts.
What spans sections (the data source, the backend, the batch, checkpoints) is `problems`,
run with the other cross-section checks (problems.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from mpmd.recipes import registry
from mpmd.recipes.config.sections import SliceShape, _Section
from mpmd.runtime.worker.mesh import devices_problem

if TYPE_CHECKING:
    from mpmd.recipes.config.schema import Config


class RLConfig(_Section):
    algorithm: Literal["grpo"] | None = Field(
        None,
        description="null = ordinary training (the rest of rl.* unused); grpo = Group Relative Policy "
        "Optimization (mpmd/rl/loop.py): a pipelined learner on the pipeline's slices, a sampler "
        "on one more worker, prompts from data.path's jsonl examples (docs/rl-recipe.md)",
    )
    reward: str = Field(
        "mpmd.recipes.rl.rewards:exact_match",
        description="'module:function' called as fn(prompt, completion, *, response, ended) -> float "
        "(the prompt's and the completion's text, the completion without its end marker; the "
        "example's response; whether the completion ended with the end marker); built in: "
        "mpmd.recipes.rl.rewards:exact_match, mpmd.recipes.rl.rewards:format",
    )
    num_samples: int = Field(
        8, ge=2, le=2**16, description="completions drawn per prompt (GRPO's group: each is compared with its group's)"
    )
    prompts_per_step: int = Field(
        16,
        gt=0,
        le=2**20,
        description="prompts per step, in an order shuffled from rl.seed each epoch; the learner's "
        "batch is prompts_per_step x num_samples rows (train.batch_size is not read)",
    )
    max_new_tokens: int = Field(
        16,
        gt=0,
        le=2**20,
        description="most tokens a completion draws, its end marker included; the longest prompt "
        "+ this must fit model.seq_len",
    )
    temperature: float = Field(
        1.0, gt=0, description="the sampler's softmax temperature (> 0: a greedy group has no spread)"
    )
    top_k: int = Field(0, ge=0, description="draw among the k likeliest tokens; 0 = all")
    clip_eps: float = Field(
        0.2, gt=0, description="PPO's clip: a token's probability ratio is clipped to [1 - clip_eps, 1 + clip_eps]"
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the KL penalty to the starting model; > 0 holds a frozen copy of it on "
        "one more worker (its mesh rl.sampler_mesh) that scores each step's rows, and logs kl",
    )
    off_policy_steps: Literal[0, 1] = Field(
        0,
        description="0 = on-policy (sample with the weights of the last update); 1 = sample step t+1 "
        "while step t trains (the sampler and the learner at once, one update behind)",
    )
    sampler_mesh: SliceShape = Field(
        SliceShape(),
        description="the sampler slice's mesh {data, fsdp, tensor, expert}, on its own worker",
    )
    seed: int = Field(0, ge=0, description="seeds the prompts' order and every sampled token")

    @field_validator("reward")
    @classmethod
    def _importable(cls, spec: str) -> str:
        from mpmd.recipes.rl import rewards  # pure Python: no JAX while the config loads

        rewards.resolve(spec, "rl.reward")
        return spec


def problems(c: Config) -> list[str]:
    """What rl.algorithm needs of the other sections; none without it."""
    r = c.rl
    if r.algorithm is None:
        return []
    out = []
    if c.data.source != "jsonl":
        out.append(
            f"rl.algorithm='{r.algorithm}' samples the prompts of fine-tuning examples: it needs "
            f"data.source='jsonl', got '{c.data.source}'"
        )
    if not registry.get_model_spec(c.model.kind).samples_text:
        texts = [name for name, spec in registry.model_specs().items() if spec.samples_text]
        out.append(f"rl.algorithm needs a language model to sample from: model.kind={registry.one_of(texts)}")
    elif r.max_new_tokens >= c.model.seq_len:
        out.append(
            f"rl.max_new_tokens={r.max_new_tokens} must be below model.seq_len={c.model.seq_len} "
            f"(a prompt and its completion are one row of seq_len)"
        )
    rows = r.prompts_per_step * r.num_samples
    if rows % c.pipeline.num_microbatches:
        out.append(
            f"rl.prompts_per_step x rl.num_samples = {rows} rows must be divisible by "
            f"pipeline.num_microbatches={c.pipeline.num_microbatches} (equal-sized microbatches)"
        )
    # Groups and its GroupCluster are tested on worker processes this machine starts.
    if c.cluster.backend != "local":
        out.append(
            f"rl.algorithm runs on cluster.backend='local' (the pipeline's workers and the sampler's), "
            f"got '{c.cluster.backend}'"
        )
    if getattr(c.model, "tie_embeddings", False):  # cut at stage marks, which GRPO's mpmd.split does not place
        out.append("rl.algorithm cannot train a llama with model.tie_embeddings=true yet: set it false")
    if c.pipeline.cuts is not None:
        out.append("rl.algorithm splits the model where the stages balance: set pipeline.cuts=null")
    cl = c.cluster
    devices = cl.devices_per_worker * cl.processes_per_slice
    shape = r.sampler_mesh.resolved(devices)
    if problem := devices_problem(shape, devices, f"cluster.devices_per_worker={devices}"):
        out.append(f"rl.sampler_mesh: {problem}")
    return out
