"""Unpipelined training of the same model in plain JAX, the reference every pipeline must equal,
and the small models, data and comparisons the test modules share (no test module imports
another: pytest would collect the imported tests twice)."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

from mpmd import models
import mpmd

# The small GPT most tests train: vocabulary, width, heads, blocks, sequence length, batch, steps.
VOCAB, D, HEADS, BLOCKS, SEQ, BATCH, STEPS = 32, 16, 2, 6, 8, 8, 3


def make_gpt():
    return models.GPT(VOCAB, D, HEADS, BLOCKS, SEQ, rngs=nnx.Rngs(0))


def batches():
    rng = np.random.default_rng(1)
    return [
        (rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32), rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
        for _ in range(STEPS)
    ]


def layer_leaves(model) -> list[np.ndarray]:
    """Parameter leaves layer by layer, in the order a split pipeline's stages hold them."""
    return [np.asarray(l) for layer in model.layers() for l in jax.tree.leaves(nnx.state(layer, nnx.Param))]


def stage_leaves(per_stage) -> list[np.ndarray]:
    return [np.asarray(l) for s in per_stage for l in jax.tree.leaves(s)]


def train(make_model, loss_fn, batches, optimizer, max_grad_norm=None):
    """(losses, first-step grads, final params), with leaves ordered as `layer_leaves`."""
    model = make_model()
    layers = list(model.layers())
    params = [nnx.state(l, nnx.Param) for l in layers]
    graphs = [nnx.split(l, nnx.Param, ...) for l in layers]

    def loss_of(params, x, y):
        for (g, _, rest), p in zip(graphs, params):
            x = nnx.merge(g, p, rest)(x)
        return loss_fn(x, y)

    if max_grad_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)
    return descend(loss_of, params, batches, optimizer)


def descend(objective, params, batches, optimizer):
    """(losses, first-step grads, final params) of `optimizer` stepping on
    jax.value_and_grad(objective)(params, *batch) for each batch (a tuple of arguments)."""
    state = optimizer.init(params)
    step = jax.jit(jax.value_and_grad(objective))
    losses, first_grads = [], None
    for batch in batches:
        loss, grads = step(params, *batch)
        if first_grads is None:
            first_grads = [np.asarray(l) for l in jax.tree.leaves(grads)]
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, first_grads, [np.asarray(l) for l in jax.tree.leaves(params)]


def leaf_errors(got, want) -> list[tuple[float, float]]:
    """Per leaf, (max absolute error, the leaf's largest magnitude in `want`)."""
    out = []
    for g, w in zip(got, want):
        scale = max(float(np.max(np.abs(w))), 1e-30) if w.size else 1.0
        err = float(np.max(np.abs(g.astype(np.float64) - w))) if w.size else 0.0
        out.append((err, scale))
    return out


def max_leaf_error(got, want) -> float:
    """The largest error of any leaf relative to that leaf's scale (see assert_leaves_close)."""
    return max(err / scale for err, scale in leaf_errors(got, want))


def assert_leaves_close(got, want, rtol, what="parameters"):
    """Each leaf within `rtol` of the reference, relative to that leaf's largest magnitude.

    Relative to the leaf's scale, not elementwise: a microbatched sum rounds differently from
    one batched sum, and an element that is a near-cancelling sum keeps an absolute error of
    a few ulps of the leaf's scale, which elementwise would read as a large relative error.
    """
    assert len(got) == len(want), f"{what}: {len(got)} leaves, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what} leaf {i}: shape {g.shape}, expected {w.shape}"
    for i, (w, (err, scale)) in enumerate(zip(want, leaf_errors(got, want))):
        assert err <= rtol * scale, f"{what} leaf {i} {w.shape}: max error {err:.3g} > {rtol} x scale {scale:.3g}"


def train_pipeline(pipe_factory, schedule, m, v, cluster, data):
    """(per-step losses, final per-stage leaves) of a pipeline trained with AdamW on `cluster`;
    a LocalCluster is left running for the next test."""
    trainer = mpmd.Trainer(
        pipe_factory(), optax.adamw(1e-3), schedule=schedule, num_microbatches=m, virtual_stages=v, cluster=cluster
    )
    try:
        losses = [trainer.step(x, y)["loss"] for x, y in data]
        return losses, stage_leaves(trainer.params())
    finally:
        trainer.close(close_cluster=not isinstance(cluster, mpmd.LocalCluster))


def assert_same(a, b):
    """Two `train_pipeline` results are bitwise equal."""
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    assert len(a[1]) == len(b[1])
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert np.array_equal(x, y), f"parameter leaf {i} differs (max {np.max(np.abs(x - y))})"
