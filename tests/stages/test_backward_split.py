"""Zero-bubble B and W split one backward without recomputation (mpmd/stages/backward_split.py):
B + W costs one full backward by XLA's cost analysis, B's kept values live from B to W and
are counted, and split-backward training equals unpipelined training under SGD + momentum
(Adam would hide a wrong gradient scale) with clipping, remat and tied weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mpmd import models
import mpmd
from mpmd.stages import backward_split
from mpmd.stages import names
from mpmd.schedules import core as schedules
from mpmd.stages import costs as stage_costs
from mpmd.schedules.simulate import peak_saved_bytes
from mpmd.runtime.worker.instructions import Delete, Run
from tests.support import reference


def sgd():
    return optax.sgd(0.1, momentum=0.9)


# -- cost: B + W = one backward ------------------------------------------------------------

LLAMA = dict(vocab_size=32, d_model=16, num_heads=4, num_blocks=2, seq_len=8, num_kv_heads=2)


def _llama(**kw):
    a = LLAMA
    return models.Llama(
        a["vocab_size"],
        a["d_model"],
        a["num_heads"],
        a["num_blocks"],
        a["seq_len"],
        num_kv_heads=a["num_kv_heads"],
        rngs=nnx.Rngs(0),
        **kw,
    )


def _gpt():
    pipe = mpmd.Pipeline(mpmd.split(models.GPT(64, 32, 2, 4, 16, rngs=nnx.Rngs(0)), num_stages=3), models.lm_loss)
    tokens = jax.ShapeDtypeStruct((2, 16), np.int32)
    return pipe, tokens, tokens


def _mlp():
    pipe = mpmd.Pipeline(mpmd.split(models.MLP(8, 64, 4, 4, rngs=nnx.Rngs(0)), num_stages=3), models.mse_loss)
    return pipe, jax.ShapeDtypeStruct((4, 8), np.float32), jax.ShapeDtypeStruct((4, 4), np.float32)


def _remat_llama():
    # remat's recomputation must run once (in B), not again in W
    pipe = mpmd.Pipeline(mpmd.split(_llama(remat="block"), 2), models.lm_loss)
    tokens = jax.ShapeDtypeStruct((2, LLAMA["seq_len"]), np.int32)
    return pipe, tokens, tokens


@pytest.mark.parametrize("make", [_gpt, _mlp, _remat_llama], ids=["gpt", "mlp", "llama-remat"])
def test_b_plus_w_costs_one_full_backward(make):
    pipe, x, y = make()
    flops = stage_costs.measure(pipe, x, y, flops_only=True)
    assert flops[0]["B"] == 0  # the first stage's input is data: W does it all
    for k, c in enumerate(flops):
        assert c["B"] + c["W"] <= 1.05 * c["BW"], (k, c)
        if k > 0:
            # Both halves do real work; before the split W alone cost a whole backward.
            assert 0.2 * c["BW"] < c["W"] < 0.8 * c["BW"], (k, c)
            assert 0.2 * c["BW"] < c["B"] < 0.8 * c["BW"], (k, c)


def _user_stage(p, x):
    """A stage as a user might write one: a weight used twice (tied), jitted and custom-jvp
    activations, a remat block and a scan (control flow is split whole, not per op)."""
    w, b, u = p
    h = jax.nn.gelu(x @ w + b)
    h = jax.checkpoint(
        lambda h: jax.nn.relu(h @ w.T) * jnp.tanh(h @ w.T),
        policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    )(h)
    h, _ = jax.lax.scan(lambda c, s: (jnp.sin(c * s), None), h, u)
    return h @ w


def test_split_is_exact_for_any_stage_function():
    key = jax.random.key(0)
    p = tuple(jax.random.normal(jax.random.fold_in(key, i), s) for i, s in enumerate([(6, 6), (6,), (3, 4, 6)]))
    x = jax.random.normal(jax.random.fold_in(key, 9), (4, 6))
    y, vjp = jax.vjp(_user_stage, p, x)
    g = jax.random.normal(jax.random.fold_in(key, 10), y.shape)
    leaves, tree = jax.tree.flatten(vjp)

    def backward(*a):
        dp, dx = jax.tree.unflatten(tree, list(a[: len(leaves)]))(a[-1])
        return (*dp, dx)

    args = (*leaves, g)
    parts = backward_split.split(backward, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args), 3)
    assert parts.num_input_grads == 1 and parts.kept
    dx, *kept = jax.jit(parts.input_grad)(*args)
    dp = jax.jit(parts.weight_grad)(*args, *kept)
    want = jax.jit(backward)(*args)
    for got, ref in zip((*dp, dx), want):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert [k.shape for k in kept] == [s.shape for s in parts.kept]


# -- B's kept values: named, freed when W runs, counted in memory ---------------------------


def test_kept_bytes_count_from_b_until_w():
    schedule = schedules.make("zb-h1", 2, 4)
    # slice 1 runs F B F B W F B W F B W W: at most two microbatches' residuals and two kept
    # sets at once; slice 0 (the first stage) keeps nothing.
    assert peak_saved_bytes(schedule, [100, 100], [0, 1]) == (200, 202)
    assert peak_saved_bytes(schedule, [100, 100]) == (200, 200)
    one_f_one_b = schedules.make("1f1b", 2, 4)  # no split: nothing is kept between B and W
    assert peak_saved_bytes(one_f_one_b, [100, 100], [0, 1]) == peak_saved_bytes(one_f_one_b, [100, 100]) == (200, 100)
    with pytest.raises(ValueError, match="kept_bytes has 1 entries; the schedule has 2 stages"):
        peak_saved_bytes(schedule, [100, 100], [1])
    pipe, x, y = _gpt()
    per_stage = stage_costs.memory(pipe, sgd(), x, y)
    assert per_stage[0]["kept"] == 0 and all(m["kept"] > 0 for m in per_stage[1:])
    with_kept = stage_costs.slice_memory(schedules.make("zb-h1", 3, 4), per_stage)
    without = stage_costs.slice_memory(schedules.make("zb-h1", 3, 4), [dict(m, kept=0) for m in per_stage])
    assert [a["activations"] > b["activations"] for a, b in zip(with_kept, without)] == [False, True, True]


def _check_kept_lifetimes(lowered, num_stages):
    """Every non-first stage's B writes kept{k}/{j}, its W reads it, and it is deleted right
    after: the only buffers B and W share besides the residuals and the cotangent."""
    seen = 0
    for stream in lowered.train:
        for ins in stream:
            if isinstance(ins, Run) and names.parse_program(ins.program).kind == "bwd_in":
                k, j = names.parse_program(ins.program).stage, names.parse_buffer(ins.outputs[0]).microbatch
                kept = names.kept(k, j)
                assert ins.outputs == (names.cotangent(k - 1, j), kept)
                users = [n for n, later in enumerate(stream) if kept in getattr(later, "inputs", ())]
                assert len(users) == 1 and stream[users[0]].label == f"W s{k} mb{j}", users
                after = stream[users[0] + 1 :]
                freed = after[: next((n for n, i in enumerate(after) if not isinstance(i, Delete)), len(after))]
                assert Delete(kept) in freed, freed
                seen += 1
    assert seen == (num_stages - 1) * 4


# -- training equals unpipelined ------------------------------------------------------------

CLIP = 0.2


@pytest.mark.slow  # the fast loop has zb-h1 with clipping in the tied test below
@pytest.mark.every_jax
def test_zb_h1_with_clipping_equals_unpipelined_under_sgd_momentum():
    data = reference.batches()
    want = reference.train(reference.make_gpt, models.lm_loss, data, sgd(), max_grad_norm=CLIP)
    pipe = mpmd.Pipeline(mpmd.split(reference.make_gpt(), num_stages=3), models.lm_loss)
    with mpmd.Trainer(
        pipe, sgd(), schedule="zb-h1", num_microbatches=4, max_grad_norm=CLIP, cluster=mpmd.InProcessCluster()
    ) as trainer:
        loss, grads = trainer.grads(*data[0])
        _check_kept_lifetimes(trainer.lowered, 3)
        metrics = [trainer.step(x, y) for x, y in data]
        params = reference.stage_leaves(trainer.params())
    assert loss == pytest.approx(want[0][0], rel=1e-5)
    reference.assert_leaves_close(reference.stage_leaves(grads), want[1], 1e-5, "gradients")
    np.testing.assert_allclose([m["loss"] for m in metrics], want[0], rtol=1e-5)
    assert all(m["grad_norm"] > CLIP for m in metrics), "clipping must trigger at every step"
    reference.assert_leaves_close(params, want[2], 1e-5)


@pytest.mark.parametrize("remat", ["block", "dots_saveable"])
def test_zb_h1_with_remat_equals_unpipelined(remat):
    data = reference.batches()
    want = reference.train(lambda: _llama(), models.lm_loss, data, sgd())
    pipe = mpmd.Pipeline(mpmd.split(_llama(remat=remat), 2), models.lm_loss)
    with mpmd.Trainer(pipe, sgd(), schedule="zb-h1", num_microbatches=4, cluster=mpmd.InProcessCluster()) as trainer:
        _, grads = trainer.grads(*data[0])
        losses = [trainer.step(x, y)["loss"] for x, y in data]
        params = reference.stage_leaves(trainer.params())
    np.testing.assert_allclose(losses, want[0], rtol=1e-5)
    reference.assert_leaves_close(reference.stage_leaves(grads), want[1], 1e-5, "gradients")
    reference.assert_leaves_close(params, want[2], 1e-5)


def test_zb_h1_with_tied_embedding_and_clipping_equals_unpipelined():
    make = lambda: _llama(tie_embeddings=True)

    class Whole:  # the tied model as one layer, for reference.train
        def layers(self):
            return [make()]

    data = reference.batches()
    want = reference.train(Whole, models.lm_loss, data, sgd(), max_grad_norm=CLIP)
    model = make()
    model.cut_after([1], mpmd.stage_boundary)  # embed + block 0 | block 1 + head (tied)
    stages = mpmd.split(model, 2)
    pipe = mpmd.Pipeline(stages, models.lm_loss)
    assert len(pipe.shared) == 1
    in_stage_order = lambda leaves: [leaves[i] for s in stages for i in s.param_index]
    with mpmd.Trainer(
        pipe, sgd(), schedule="zb-h1", num_microbatches=4, max_grad_norm=CLIP, cluster=mpmd.InProcessCluster()
    ) as trainer:
        _, grads = trainer.grads(*data[0])
        metrics = [trainer.step(x, y) for x, y in data]
        params = reference.stage_leaves(trainer.params())
    np.testing.assert_allclose([m["loss"] for m in metrics], want[0], rtol=1e-5)
    assert all(m["grad_norm"] > CLIP for m in metrics), "clipping must trigger at every step"
    reference.assert_leaves_close(reference.stage_leaves(grads), in_stage_order(want[1]), 1e-5, "gradients")
    reference.assert_leaves_close(params, in_stage_order(want[2]), 1e-5)
