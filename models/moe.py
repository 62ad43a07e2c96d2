"""Mixture of experts: a routed SwiGLU layer (`MoE`), a Llama block that uses it (`MoEBlock`)
and the Llama whose every `every`-th block is one (`MoELlama`).

Routing, per call, over the call's N = batch x time tokens (in a pipeline: one microbatch),
cut into `groups` G equal groups of consecutive tokens (G divides N; batch rows stay whole when
G divides the batch) that are routed and given capacity each on their own (GShard's groups;
an evaluation or decoding call whose tokens G does not divide, a decoding step's one token
per sequence, is routed as one group):
  router logits z = x W_r [N, E], in float32;
  softmax router: p = softmax(z); sigmoid router (DeepSeek-V3): p = sigmoid(z);
  each token goes to the top_k experts by p, weighted by their p, renormalised over its top_k
  when `renormalize` (always for the sigmoid router: its scores do not sum to 1).
Dispatch, within each group of n = N / G tokens, with a capacity C per expert (`capacity_factor`
c: C = ceil(c x n x top_k / E); None is dropless, C = n, the most one expert can get since a
token's top_k experts are distinct): the n x top_k assignments are served in priority order
rank-major, then token order (every
token's first choice before any token's second, as in GShard), and an expert keeps its first C;
an assignment over capacity is dropped (the token gets nothing from that expert: the block's
residual carries it) and counted. Experts compute on a [G, E, C, D] buffer (a scatter in, one
batched matmul per projection, a gather out), so compute is G x E x C tokens: ~c x the active
tokens with a capacity, E/top_k x them dropless.

Expert parallelism: with a `constrain` (mpmd.constrain, passed in like add_loss), the groups are
laid out along the batch's mesh axes and the buffer, once filled, along the experts' (logical
axis "expert", the mesh's `expert` axis), so the partitioner sends each group's tokens to the
devices holding their experts and the results back: one all-to-all each way over the expert
axis when G is a multiple of the devices the batch is split over. Without one (or with G = 1)
the layout is XLA's to choose; the math is the same either way.

Auxiliary losses (each call's, added through `add_loss`, e.g. mpmd.add_loss; models/ imports
no mpmd, so it comes in as an argument, like Llama's stage mark):
  load balancing (Switch / GShard): E x sum_e f_e P_e, f_e the fraction of the N x top_k
    assignments the router sends to expert e (before capacity), P_e the mean over tokens of
    p_e normalised to sum 1 per token; 1 when balanced, up to E when all go to one expert;
  router z-loss (ST-MoE): mean over tokens of logsumexp(z)^2, which keeps logits small.
Both are over all N tokens of the call, whatever G. Their sum weighted by `balance_coef` and
`z_coef` is one term. Under remat the block returns
the term out of its rematerialised forward and adds it outside (a value added from inside
jax.checkpoint would leak its tracer).

What routing did is kept as stage state (`MoEStats`, non-parameter variables a forward
changes): per expert, assignments routed to it and assignments dropped, int32 counts summed
over every training forward and wrapping modulo 2^32 (differences between two reads are exact
while one interval routes under 2^32 assignments). Evaluation (`.eval()`) leaves them.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mpmd.models.gpt import _dropped, _require_positive, axes
from mpmd.models.llama import PLAIN, REMAT_POLICIES, AttentionVariant, Block, Llama, SwiGLU, _compute_dtype

ROUTERS = ("softmax", "sigmoid")


class MoEStats(nnx.Variable):
    """Routing counts a training forward adds to (module doc); not a parameter."""


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Assignments each expert keeps: ceil(c x N x top_k / E), at most N; N when dropless (None)."""
    if capacity_factor is None:
        return num_tokens
    return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


def route(logits: jax.Array, top_k: int, router: str, renormalize: bool):
    """(weights [N, k], experts [N, k] int32, probs [N, E]) for float32 logits [N, E]: each
    token's top_k experts and their combine weights; `probs` sums to 1 per token (what the
    balancing loss averages)."""
    if router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, top_k)
        if renormalize and top_k > 1:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts, probs
    scores = jax.nn.sigmoid(logits)
    weights, experts = jax.lax.top_k(scores, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, scores / jnp.sum(scores, axis=-1, keepdims=True)


def positions_in_experts(experts: jax.Array, num_experts: int) -> jax.Array:
    """int32 [N, k]: each assignment's place in its expert's queue, served rank-major then in
    token order (module doc); a place >= capacity is dropped."""
    order = experts.T.reshape(-1)  # [k*N]: all first choices first
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)  # [k*N, E]
    place = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1
    return place.reshape(experts.shape[1], experts.shape[0]).T


def balance_loss(probs: jax.Array, experts: jax.Array, num_experts: int) -> jax.Array:
    """E x sum_e f_e P_e (module doc); float32 scalar."""
    routed = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=(0, 1))  # [E]
    fraction = routed / experts.size
    return num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def z_loss(logits: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


class MoE(nnx.Module):
    """x [B, T, D] -> [B, T, D]: num_experts SwiGLU experts of width mlp_dim, top_k routed
    (module doc), plus a dense SwiGLU of width `shared_mlp_dim` every token goes through
    (DeepSeek's shared expert; None: none). Parameters: router [D, E] (`embed`, `expert`),
    experts' gate/up [E, D, H] (`expert`, `embed`, `mlp`) and down [E, H, D]."""

    def __init__(
        self,
        d_model: int,
        mlp_dim: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None = None,
        router: str = "softmax",
        renormalize: bool = True,
        shared_mlp_dim: int | None = None,
        balance_coef: float = 0.01,
        z_coef: float = 0.001,
        dtype="float32",
        add_loss: Callable | None = None,
        groups: int = 1,
        constrain: Callable | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        _require_positive(d_model=d_model, mlp_dim=mlp_dim, num_experts=num_experts, top_k=top_k, groups=groups)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must be at most num_experts={num_experts}")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: dropless), got {capacity_factor}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router_kind, self.renormalize = router, renormalize
        self.balance_coef, self.z_coef, self.add_loss = balance_coef, z_coef, add_loss
        self.groups, self.constrain = groups, constrain or (lambda x, *names: x)
        self.dtype = _compute_dtype(dtype)
        # Router: small init, so every expert starts near-equally likely.
        self.router = nnx.Param(
            axes(nnx.initializers.normal(0.02), "embed", "expert")(rngs.params(), (d_model, num_experts), jnp.float32)
        )
        # Each expert's matrices initialised as an nnx.Linear's (LeCun normal over its input).
        init = nnx.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
        )
        make = lambda names, shape: nnx.Param(axes(init, *names)(rngs.params(), shape, jnp.float32))
        self.gate = make(("expert", "embed", "mlp"), (num_experts, d_model, mlp_dim))
        self.up = make(("expert", "embed", "mlp"), (num_experts, d_model, mlp_dim))
        self.down = make(("expert", "mlp", "embed"), (num_experts, mlp_dim, d_model))
        self.shared = SwiGLU(d_model, shared_mlp_dim, dtype, rngs=rngs) if shared_mlp_dim else None
        self.routed = MoEStats(jnp.zeros((num_experts,), jnp.int32))
        self.dropped = MoEStats(jnp.zeros((num_experts,), jnp.int32))
        self.deterministic = False  # .eval() sets it: an evaluation counts nothing

    def apply(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(output [B, T, D], this call's weighted auxiliary loss, float32 scalar)."""
        batch, num_steps, d_model = x.shape
        num_tokens, E, k, G = batch * num_steps, self.num_experts, self.top_k, self.groups
        if num_tokens % G and self.deterministic:
            G = 1  # an evaluation or decoding call's few tokens (module doc)
        elif num_tokens % G:
            raise ValueError(
                f"groups={G} must divide the {num_tokens} tokens (batch {batch} x time "
                f"{num_steps}) each training call of an MoE routes"
            )
        n = num_tokens // G
        tokens = self.constrain(x.reshape(G, n, d_model), "batch", None, None)
        logits = jnp.einsum("gnd,de->gne", tokens.astype(jnp.float32), self.router[...])  # [G, n, E]
        weights, experts, probs = route(logits, k, self.router_kind, self.renormalize)
        C = capacity(n, E, k, self.capacity_factor)
        place = jax.vmap(positions_in_experts, in_axes=(0, None))(experts, E)  # [G, n, k]
        kept = place < C
        if not self.deterministic:  # training forward: count (module doc)
            chosen = jax.nn.one_hot(experts, E, dtype=jnp.int32)  # [G, n, k, E]
            self.routed[...] = self.routed[...] + jnp.sum(chosen, axis=(0, 1, 2))
            self.dropped[...] = self.dropped[...] + jnp.sum(chosen * (~kept)[..., None], axis=(0, 1, 2))
        slot = jnp.where(kept, place, C)  # C is out of bounds: dropped

        def scatter(tokens, experts, slot):  # one group's kept assignments into its [E, C, D]
            return (
                jnp.zeros((E, C, d_model), self.dtype)
                .at[experts, slot]
                .add(jnp.broadcast_to(tokens.astype(self.dtype)[:, None, :], (n, k, d_model)), mode="drop")
            )

        buffer = jax.vmap(scatter)(tokens, experts, slot)  # [G, E, C, D]
        buffer = self.constrain(buffer, "batch", "expert", None, None)  # to the experts' devices
        cast = lambda w: w[...].astype(self.dtype)
        hidden = jax.nn.silu(jnp.einsum("gecd,edh->gech", buffer, cast(self.gate))) * jnp.einsum(
            "gecd,edh->gech", buffer, cast(self.up)
        )
        out = jnp.einsum("gech,ehd->gecd", hidden, cast(self.down))  # [G, E, C, D]
        out = self.constrain(out, "batch", None, None, None)  # and back to the tokens'
        # Gather each assignment's result back (0 where dropped) and combine by the weights.
        back = jax.vmap(lambda o, e, s: o.at[e, s].get(mode="fill", fill_value=0))(out, experts, slot)
        y = jnp.einsum("gnkd,gnk->gnd", back, weights.astype(self.dtype)).reshape(num_tokens, d_model)
        if self.shared is not None:
            y = y + self.shared(x.reshape(num_tokens, d_model))
        flat = lambda a: a.reshape(num_tokens, *a.shape[2:])
        aux = self.balance_coef * balance_loss(flat(probs), flat(experts), E) + self.z_coef * z_loss(flat(logits))
        return y.reshape(batch, num_steps, d_model), aux

    def __call__(self, x: jax.Array) -> jax.Array:
        y, aux = self.apply(x)
        if self.add_loss is not None:
            self.add_loss(aux)
        return y


class MoEBlock(Block):
    """A Llama Block whose MLP is an MoE; adds the MoE's auxiliary loss (through the MoE's
    add_loss) outside its rematerialised forward (module doc)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        moe: MoE,
        rope_theta: float = 10_000.0,
        dtype="float32",
        remat: str = "none",
        drop: nnx.Dropout | None = None,
        norm_eps: float = 1e-5,
        variant: AttentionVariant = PLAIN,
        *,
        rngs: nnx.Rngs,
    ):
        # Block makes a dense SwiGLU that the MoE replaces (width 1: negligible).
        super().__init__(
            d_model, num_heads, num_kv_heads, 1, rope_theta, dtype, remat, drop, norm_eps, variant, rngs=rngs
        )
        self.mlp = moe

    def forward(self, x, segment_ids=None, positions=None):
        x = x + _dropped(self.drop, self.attn(self.attn_norm(x), segment_ids=segment_ids, positions=positions))
        y, aux = self.mlp.apply(self.mlp_norm(x))
        return x + _dropped(self.drop, y), aux

    def __call__(self, x, *, segment_ids=None, positions=None):
        if self.remat == "none":
            y, aux = self.forward(x, segment_ids, positions)
        else:
            y, aux = nnx.remat(MoEBlock.forward, policy=REMAT_POLICIES[self.remat])(self, x, segment_ids, positions)
        if self.mlp.add_loss is not None:
            self.mlp.add_loss(aux)
        return y


class MoELlama(Llama):
    """A Llama (models/llama.py; same arguments) whose blocks every-th, 2 x every-th, ...
    (counting from 1) are MoEBlocks with an MoE made by MoE(d_model, **moe, dtype=dtype,
    rngs=rngs). The other blocks are the dense Llama's."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        seq_len: int,
        *,
        moe: dict,
        every: int = 1,
        rngs: nnx.Rngs,
        **llama,
    ):
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= num_layers:
            raise ValueError(f"every must be a block count in 1..num_layers={num_layers}, got {every!r}")
        super().__init__(vocab_size, d_model, num_heads, num_layers, seq_len, rngs=rngs, **llama)
        num_kv_heads = llama.get("num_kv_heads") or num_heads
        dtype, remat = llama.get("dtype", "float32"), llama.get("remat", "none")
        for i in self.moe_blocks(num_layers, every):
            dense = self.blocks[i]
            self.blocks[i] = MoEBlock(
                d_model,
                num_heads,
                num_kv_heads,
                MoE(d_model, **moe, dtype=dtype, rngs=rngs),
                llama.get("rope_theta", 10_000.0),
                dtype,
                remat,
                dense.drop,
                llama.get("norm_eps", 1e-5),
                llama.get("attention", PLAIN),
                rngs=rngs,
            )

    @staticmethod
    def moe_blocks(num_layers: int, every: int) -> list[int]:
        """Indices (from 0) of the blocks that are MoEBlocks."""
        return [i for i in range(num_layers) if (i + 1) % every == 0]
