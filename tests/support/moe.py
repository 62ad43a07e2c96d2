"""A tiny MoE Llama (models/moe.py), its data, and its unpipelined NNX reference: the whole
model stepping through the microbatches in order, each microbatch's objective its mean
next-token loss plus the auxiliary losses its MoE blocks add (mpmd.collect_losses), averaged
over the microbatches; SGD with momentum, float32. Capacity is per call, so the reference
routes per microbatch as the pipeline does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mpmd
from mpmd import models
from mpmd.models.moe import MoELlama

VOCAB, D, HEADS, BLOCKS, SEQ, BATCH, STEPS = 32, 16, 2, 4, 8, 8, 3
# Capacity 1.0 with top-2 of 4: routing of random tokens drops some assignments at m=1 and m=4.
MOE = dict(num_experts=4, top_k=2, mlp_dim=16, capacity_factor=1.0, balance_coef=0.1, z_coef=0.01)


def make_model(**overrides) -> MoELlama:
    """Blocks 1 and 3 (of 0..3) are MoE blocks."""
    moe = {**MOE, "add_loss": mpmd.add_loss, "constrain": mpmd.constrain, **overrides}
    return MoELlama(VOCAB, D, HEADS, BLOCKS, SEQ, moe=moe, every=2, num_kv_heads=1, rngs=nnx.Rngs(0))


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32), rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
        for _ in range(steps)
    ]


def sgd():
    return optax.sgd(0.1, momentum=0.9)


def reference(data, m: int, make=make_model):
    """(losses with their auxiliary terms, final parameter leaves layer by layer, summed aux
    loss of the last step) of the unpipelined model (module doc)."""
    model = make()
    layers = model.layers()

    def objective(model, x, y):
        # The module steps through the microbatches in order, so its routing counts advance
        # as the pipeline's do (they are state, not differentiated).
        total, aux_total = 0.0, 0.0
        for xs, ys in zip(jnp.split(x, m), jnp.split(y, m)):
            with mpmd.collect_losses() as aux:
                logits = model(xs)
            total = total + (models.lm_loss(logits, ys) + sum(aux)) / m
            aux_total = aux_total + sum(aux) / m
        return total, aux_total

    optimizer = sgd()
    state = optimizer.init(nnx.state(model, nnx.Param))
    step = nnx.jit(nnx.value_and_grad(objective, has_aux=True))
    losses, aux_losses = [], []
    for x, y in data:
        (loss, aux), grads = step(model, x, y)
        params = nnx.state(model, nnx.Param)
        updates, state = optimizer.update(grads, state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        losses.append(float(loss))
        aux_losses.append(float(aux))
    leaves = [np.asarray(l) for layer in layers for l in jax.tree.leaves(nnx.state(layer, nnx.Param))]
    return losses, leaves, aux_losses
