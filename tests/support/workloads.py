"""Workloads that are not mpmd's own models, as a new user writes them, and the unpipelined
JAX reference each must equal: a token-masked loss over microbatches holding very different
numbers of real tokens, a side input (positions) that only a middle stage reads, integer and
boolean values crossing cuts, an auxiliary loss added inside a stage; the same in one model cut
at stage marks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mpmd
from mpmd.stages.pipeline import keywords_of
from tests.support import reference as reference_training

D, T, BATCH, STEPS = 6, 5, 16, 3


class Dense(nnx.Module):
    """A plain stage: tanh(x W + b)."""

    def __init__(self, seed: int):
        self.l = nnx.Linear(D, D, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return jnp.tanh(self.l(x))


class Carry(nnx.Module):
    """Returns (h, keep, positions): a bool mask and int32 positions cross the cut after it."""

    def __init__(self, seed: int):
        self.l = nnx.Linear(D, D, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        keep = x[..., 0] > -0.5  # bool [b, T], from the data
        positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32)[::-1], x.shape[:2])
        return jnp.tanh(self.l(x)), keep, positions


class UsesCarried(nnx.Module):
    """Takes (h, keep, positions) from the stage before: uses both, and adds an auxiliary loss."""

    def __init__(self, seed: int):
        self.l = nnx.Linear(D, D, rngs=nnx.Rngs(seed))
        self.table = nnx.Param(jax.random.normal(jax.random.key(seed), (T, D)) * 0.1)

    def __call__(self, carried):
        h, keep, positions = carried
        h = jnp.where(keep[..., None], h, 0.5 * h) + self.table[...][positions]
        mpmd.add_loss(0.05 * jnp.mean(jnp.square(h)))
        return jnp.tanh(self.l(h))


class Positional(nnx.Module):
    """A middle stage that reads the batch's `positions` as a side input."""

    def __init__(self, seed: int):
        self.l = nnx.Linear(D, D, rngs=nnx.Rngs(seed))
        self.table = nnx.Param(jax.random.normal(jax.random.key(seed + 100), (T, D)) * 0.1)

    def __call__(self, x, *, positions):
        return jnp.tanh(self.l(x + self.table[...][positions]))


class MarkedMasked(nnx.Module):
    """The same kinds of workload as one model cut at mpmd.stage_boundary marks into three
    stages: the bool `mask` is read only by the middle stage (a value derived from it alone is
    recomputed there), which also adds an auxiliary loss; the int `positions` only by the last;
    `segment_ids`, which no batch names, keeps its default."""

    def __init__(self, seed: int = 0):
        self.a, self.b, self.c = (nnx.Linear(D, D, rngs=nnx.Rngs(seed + i)) for i in range(3))
        self.table = nnx.Param(jax.random.normal(jax.random.key(seed + 100), (T, D)) * 0.1)

    def __call__(self, x, *, mask, positions=None, segment_ids=None):
        h = mpmd.stage_boundary(jnp.tanh(self.a(x)))
        keep = jnp.where(mask, 1.0, 0.5)[..., None]  # depends on the side input only
        h = h * keep
        mpmd.add_loss(0.05 * jnp.mean(jnp.square(h)))
        h = mpmd.stage_boundary(jnp.tanh(self.b(h)))
        if positions is not None:
            h = h + self.table[...][positions]
        if segment_ids is not None:
            h = h * 0.0  # never here: no batch names it
        return jnp.tanh(self.c(h))


def marked_stages():
    """MarkedMasked cut at its marks, from a sample batch naming its side inputs."""
    return mpmd.split(MarkedMasked(), sample_input=batches(steps=1)[0])


def masked_loss(out, batch):
    """(sum over real tokens of the squared error, count of real tokens)."""
    per_token = jnp.sum(jnp.square(out - batch["targets"]), axis=-1)
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(per_token * mask), jnp.sum(mask)


def mean_loss(out, batch):
    return jnp.mean(jnp.square(out - batch["targets"]))


def masked_stages():
    return [Dense(0), Dense(1), Dense(2), Dense(3)]


def mixed_stages():
    """Side input into stage 2, bool and int values across the cut 0 -> 1, an auxiliary loss
    on stage 1."""
    return [Carry(0), UsesCarried(1), Positional(2), Dense(3)]


def batches(steps: int = STEPS, m: int = 4, seed: int = 0) -> list[dict]:
    """Batches whose microbatches (of m) hold very different numbers of real tokens: the
    fraction of real tokens falls from ~all in the first microbatch to ~none in the last (and
    the last always keeps one), different per step."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        keep = rng.random((BATCH, T)) < (np.linspace(1.0, 0.0, BATCH) ** 3)[:, None]
        keep[-1, 0] = True
        positions = np.stack([rng.permutation(T) for _ in range(BATCH)]).astype(np.int32)
        out.append(
            {
                "inputs": rng.normal(size=(BATCH, T, D)).astype(np.float32),
                "targets": rng.normal(size=(BATCH, T, D)).astype(np.float32),
                "mask": keep,
                "positions": positions,
            }
        )
    return out


def sgd():
    return optax.sgd(0.1, momentum=0.9)


def reference(make_stages, loss_fn, data, m: int, steps: int = STEPS):
    """(losses, first-step gradients, final parameters) of the stages trained unpipelined in
    plain JAX: the objective is the weighted mean over the whole batch of a (loss_sum, weight)
    loss (one batched call) or the mean of a scalar loss, plus each stage's auxiliary losses
    averaged over the m microbatches (collected per microbatch, in order)."""
    stages = make_stages()
    graphs = [nnx.split(s, nnx.Param, ...) for s in stages]
    params = [p for _, p, _ in graphs]
    words = [[k for k, _ in keywords_of(s)] for s in stages]

    def forward(params, batch):
        h = batch["inputs"]
        with mpmd.collect_losses() as aux:
            for (g, _, rest), p, kws in zip(graphs, params, words):
                h = nnx.merge(g, p, rest)(h, **{k: batch[k] for k in kws if k in batch})
        return h, aux

    def objective(params, batch):
        out, _ = forward(params, batch)
        value = loss_fn(out, batch)
        main = value[0] / value[1] if isinstance(value, tuple) else value
        aux = 0.0
        for j in range(m):  # auxiliary losses: per microbatch, averaged
            mb = jax.tree.map(lambda a: jnp.split(a, m)[j], batch)
            _, terms = forward(params, mb)
            aux = aux + sum(terms) / m if terms else aux
        return main + aux

    return reference_training.descend(objective, params, [(b,) for b in data[:steps]], sgd())


def pipelined(
    make_stages,
    loss_fn,
    data,
    m: int,
    schedule: str,
    cluster=None,
    steps: int = STEPS,
    virtual_stages=None,
    mesh=None,
    close: bool = True,
):
    """(losses, first-step gradients, final parameters, last metrics) of the same stages
    pipelined (one stage per slice, or virtual_stages per slice)."""
    pipe = mpmd.Pipeline(make_stages(), loss_fn)
    trainer = mpmd.Trainer(
        pipe,
        sgd(),
        schedule=schedule,
        num_microbatches=m,
        virtual_stages=virtual_stages,
        mesh=mesh,
        cluster=cluster or mpmd.InProcessCluster(),
    )
    try:
        _, grads = trainer.grads(data[0])
        metrics = [trainer.step(batch) for batch in data[:steps]]
        params = trainer.params()
    finally:
        trainer.close(close_cluster=close)
    leaves = lambda per_stage: [np.asarray(l) for s in per_stage for l in jax.tree.leaves(s)]
    return [r["loss"] for r in metrics], leaves(grads), leaves(params), metrics[-1]


# -- stage state: dropout and batch statistics -----------------------------------------------
class Noisy(nnx.Module):
    """Dropout (an nnx.Rngs stream) and, with `norm`, BatchNorm (running statistics)."""

    def __init__(self, seed: int, norm: bool = False, rate: float = 0.3):
        self.l = nnx.Linear(D, D, rngs=nnx.Rngs(seed))
        self.drop = nnx.Dropout(rate, rngs=nnx.Rngs(seed + 10))
        self.norm = nnx.BatchNorm(D, momentum=0.8, rngs=nnx.Rngs(seed)) if norm else None

    def __call__(self, x):
        h = self.drop(jnp.tanh(self.l(x)))
        return self.norm(h) if self.norm is not None else h


class NoisyModel(nnx.Module):
    """Four Noisy layers as one model that mpmd.split cuts by layers (any stage count)."""

    def __init__(self):
        self.blocks = nnx.List([Noisy(0), Noisy(1, norm=True), Noisy(2), Noisy(3, norm=True)])

    def layers(self):
        return list(self.blocks)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class MarkedNoisy(nnx.Module):
    """NoisyModel's four layers as one model with a mark after each of the first three: each
    stage's dropout stream and batch statistics are its own state."""

    def __init__(self):
        self.blocks = nnx.List([Noisy(0), Noisy(1, norm=True), Noisy(2), Noisy(3, norm=True)])

    def __call__(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i < len(self.blocks) - 1:
                x = mpmd.stage_boundary(x)
        return x


def marked_stateful_stages():
    """MarkedNoisy cut at its marks."""
    return mpmd.split(MarkedNoisy(), sample_input=float_batches(steps=1)[0][0])


def stateful_stages():
    return list(NoisyModel().layers())


def square_loss(out, targets):
    return jnp.mean(jnp.square(out - targets))


def float_batches(steps: int = STEPS, batch: int = 64, seed: int = 3) -> list[tuple]:
    """(inputs, targets) pairs; 64 rows, so each of 8 microbatches holds 8 (batch statistics of
    few rows amplify rounding: 4 rows came within 1e-5 of the tolerance)."""
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(batch, D)).astype(np.float32), rng.normal(size=(batch, D)).astype(np.float32))
        for _ in range(steps)
    ]


def nnx_reference(make_layers, loss_fn, data, m: int, steps: int = STEPS):
    """(losses, final parameters, final non-parameter state, model) of the layers trained by
    NNX itself: nnx.value_and_grad over the model stepping microbatch by microbatch in order
    0..m-1 (each call advances its RNG streams and running statistics), gradients of loss/m
    summed, one SGD-with-momentum update per batch."""
    model = nnx.Sequential(*make_layers())
    optimizer = sgd()
    state = optimizer.init(nnx.state(model, nnx.Param))
    value_and_grad = nnx.value_and_grad(lambda model, x, y: loss_fn(model(x), y) / m)
    losses = []
    for x, y in data[:steps]:
        total, grads = 0.0, None
        for j in range(m):
            loss, g = value_and_grad(model, np.split(x, m)[j], np.split(y, m)[j])
            total += float(loss)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        params = nnx.state(model, nnx.Param)
        updates, state = optimizer.update(grads, state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        losses.append(total)
    return losses, [np.asarray(l) for l in jax.tree.leaves(nnx.state(model, nnx.Param))], model
