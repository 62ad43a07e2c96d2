"""model.kind='moe': the Llama of models/llama.py with every model.moe.every-th block's MLP
replaced by a mixture of SwiGLU experts (models/moe.py); its auxiliary losses (load balancing,
router z-loss) go into the objective through mpmd.add_loss from whichever stage holds the
block, and its routing counts are stage state."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd.recipes.config import Config
from mpmd.recipes.config.schema import _Section
from mpmd.recipes.families.gpt import lm_loss, seq_len, LM_READS
from mpmd.recipes.families.llama import LlamaSection, _problems as llama_problems, attention_variant
from mpmd.recipes.registry import ModelSpec, flax_build, register_model_spec


class MoESection(_Section):
    """model.moe.*: the experts and their routing."""

    num_experts: int = Field(8, ge=2, le=2**14, description="routed SwiGLU experts in each MoE block")
    top_k: int = Field(2, gt=0, description="experts each token is sent to; at most num_experts")
    every: int = Field(1, gt=0, description="every k-th block (k, 2k, ... counting from 1) is an MoE block; 1 = all")
    expert_mlp_dim: int | None = Field(
        None,
        gt=0,
        le=2**20,
        description="each expert's SwiGLU width; null = model.mlp_dim (itself 8/3 x d_model rounded up to 64 "
        "when null)",
    )
    capacity_factor: float | None = Field(
        None,
        gt=0,
        description="each expert keeps ceil(c x tokens x top_k / num_experts) assignments "
        "per microbatch, the rest are dropped (counted); null = dropless",
    )
    router: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="softmax over experts, or independent sigmoid scores (DeepSeek-V3); "
        "top_k weights then renormalised",
    )
    renormalize: bool = Field(True, description="softmax router: renormalise a token's top_k weights to sum 1")
    shared_mlp_dim: int | None = Field(
        None, gt=0, le=2**20, description="width of a shared SwiGLU expert every token goes through; null = none"
    )
    balance_coef: float = Field(
        0.01, ge=0, description="weight of the Switch/GShard load-balancing loss E x sum_e f_e P_e of each MoE block"
    )
    z_coef: float = Field(0.001, ge=0, description="weight of the router z-loss mean(logsumexp(logits)^2)")
    groups: int = Field(
        1,
        gt=0,
        description="groups of consecutive tokens each microbatch is routed in, each with its own "
        "capacity; with mesh.expert > 1 a multiple of the devices a microbatch is split "
        "over (data x fsdp x expert) lets each group's dispatch be one all-to-all",
    )


class MoELlamaSection(LlamaSection):
    kind: Literal["moe"] = Field("moe", description="which model to build")
    moe: MoESection = Field(default_factory=MoESection, description="the experts and their routing")


def _problems(cfg: Config) -> list[str]:
    m, e = cfg.model, cfg.model.moe
    out = llama_problems(cfg)
    if e.top_k > e.num_experts:
        out.append(f"model.moe.top_k={e.top_k} must be at most model.moe.num_experts={e.num_experts}")
    if e.every > m.num_layers:
        out.append(
            f"model.moe.every={e.every} is more than model.num_layers={m.num_layers}: no block would be an MoE block"
        )
    micro_tokens = cfg.train.batch_size // cfg.pipeline.num_microbatches * m.seq_len
    if micro_tokens % e.groups:
        out.append(
            f"model.moe.groups={e.groups} must divide the {micro_tokens} tokens of a microbatch "
            f"(train.batch_size / pipeline.num_microbatches x model.seq_len)"
        )
    if m.init_from is not None:
        out.append(
            f"model.init_from={m.init_from!r} is not supported with model.kind='moe' (Hugging Face "
            f"weights map onto the dense Llama only); use model.kind='llama' or init_from=null"
        )
    if m.tie_embeddings:
        out.append(
            "model.tie_embeddings=true is not supported with model.kind='moe' (a tied model is cut at "
            "stage marks); use model.kind='llama' or tie_embeddings=false"
        )
    return out


def moe_arguments(cfg: Config) -> dict:
    """MoE(...)'s keyword arguments from model.moe (add_loss and constrain aside)."""
    import math

    m, e = cfg.model, cfg.model.moe
    width = e.expert_mlp_dim or m.mlp_dim or math.ceil(8 * m.d_model / 3 / 64) * 64
    return dict(
        mlp_dim=width,
        num_experts=e.num_experts,
        top_k=e.top_k,
        capacity_factor=e.capacity_factor,
        router=e.router,
        renormalize=e.renormalize,
        shared_mlp_dim=e.shared_mlp_dim,
        balance_coef=e.balance_coef,
        z_coef=e.z_coef,
        groups=e.groups,
    )


def _moe(cfg: Config, rngs):
    import mpmd
    from mpmd.models.moe import MoELlama

    m = cfg.model
    return MoELlama(
        m.vocab_size,
        m.d_model,
        m.num_heads,
        m.num_layers,
        m.seq_len,
        moe={**moe_arguments(cfg), "add_loss": mpmd.add_loss, "constrain": mpmd.constrain},
        every=m.moe.every,
        num_kv_heads=m.num_kv_heads,
        mlp_dim=m.mlp_dim,
        rope_theta=m.rope_theta,
        dtype=m.dtype,
        remat=m.remat,
        dropout_rate=m.dropout,
        dropout_seed=cfg.seed,
        norm_eps=m.norm_eps,
        attention=attention_variant(m),
        rngs=rngs,
    )


def routing_reader(cfg: Config):
    """read(step, state) -> {"tokens_dropped", "dropped_fraction", "expert_load"}, `state`
    {path in the model: stage state leaf}: over the assignments routed since the previous read
    (the first read, or one after a rewind to an earlier step: since step 0, a resumed run's
    steps before it included), how many the experts' capacity dropped, their share, and per
    MoE block (its path, blocks.1.mlp) each expert's share of what was routed. The counts are int32 stage state wrapping modulo 2^32
    (models/moe.py), so a difference is exact while an interval routes under 2^32."""
    import numpy as np

    before: dict = {}
    last_step = [None]

    def read(step: int, state: dict) -> dict:
        if last_step[0] is not None and step <= last_step[0]:
            before.clear()
        last_step[0] = step
        now = {
            path: np.asarray(v).astype(np.uint32) for path, v in state.items() if path.endswith((".routed", ".dropped"))
        }
        delta = {key: (v - before.get(key, np.zeros_like(v))).astype(np.int64) for key, v in now.items()}
        before.clear()
        before.update(now)
        routed = {key[: -len(".routed")]: v for key, v in delta.items() if key.endswith(".routed")}
        dropped = sum(int(v.sum()) for key, v in delta.items() if key.endswith(".dropped"))
        total = sum(int(v.sum()) for v in routed.values())
        return {
            "tokens_dropped": dropped,
            "dropped_fraction": dropped / total if total else 0.0,
            "expert_load": {
                block: [round(float(c) / max(int(v.sum()), 1), 4) for c in v] for block, v in routed.items()
            },
        }

    return read


def active_params(cfg: Config, sizes: dict) -> int:
    """Every parameter but the routed experts', which count top_k / num_experts (a token goes
    through top_k of them); the router and a shared expert are used by every token."""
    import re

    e = cfg.model.moe
    routed = sum(n for path, n in sizes.items() if re.search(r"\.mlp\.(gate|up|down)$", path))
    return sum(sizes.values()) - routed + routed * e.top_k // e.num_experts


SPEC = register_model_spec(
    ModelSpec(
        "moe",
        MoELlamaSection,
        build=flax_build(_moe),
        loss=lm_loss,
        reads=LM_READS,
        tokens_per_example=seq_len,
        samples_text=True,
        problems=_problems,
        state_metrics=routing_reader,
        active_params=active_params,
    )
)
