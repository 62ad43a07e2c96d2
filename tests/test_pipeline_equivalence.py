"""Every schedule trains exactly like the unpipelined model: loss, gradients, parameters."""
import numpy as np
import optax
import pytest
from flax import nnx

import models
import mpmd
from tests import reference

VOCAB, D, HEADS, BLOCKS, SEQ, BATCH = 32, 16, 2, 6, 8, 8
LR = 3e-4   # Adam turns relative gradient rounding into relative update error (~ LR per step); keep steps small
STEPS = 3


def make_gpt():
    return models.GPT(VOCAB, D, HEADS, BLOCKS, SEQ, rngs=nnx.Rngs(0))


def batches():
    rng = np.random.default_rng(1)
    return [(rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
             rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def gpt_reference():
    return reference.train(make_gpt, models.lm_loss, batches(), optax.adamw(LR))


def cases():
    for p in (1, 2, 4):
        for m in (1, 4, 8):
            for name in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"):
                v = 2 if name == "interleaved-1f1b" else 1
                if name != "gpipe" and (m < p or m % p and v > 1):
                    continue
                yield pytest.param(name, p, m, v, id=f"{name}-p{p}-m{m}")


def check_trainer(trainer, ref, rtol_grad=1e-5):
    ref_losses, ref_grads, ref_params = ref
    data = batches()
    loss, grads = trainer.grads(*data[0])
    assert loss == pytest.approx(ref_losses[0], rel=1e-5)
    reference.assert_leaves_close(reference.stage_leaves(grads), ref_grads, rtol=rtol_grad,
                                  what="gradients")
    losses = [trainer.step(x, y)["loss"] for x, y in data]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    reference.assert_leaves_close(reference.stage_leaves(trainer.params()), ref_params, rtol=1e-5)


@pytest.mark.parametrize("name,p,m,v", list(cases()))
def test_schedule_matches_unpipelined(gpt_reference, name, p, m, v):
    stages = mpmd.split(make_gpt(), num_stages=p * v)
    pipe = mpmd.Pipeline(stages, models.lm_loss)
    with mpmd.Trainer(pipe, optimizer=optax.adamw(LR), schedule=name, num_microbatches=m,
                      cluster=mpmd.InProcessCluster(), virtual_stages=v) as trainer:
        assert trainer.num_slices == p
        check_trainer(trainer, gpt_reference)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_global_norm_clipping_matches_optax(name):
    # SGD, because Adam is nearly invariant to gradient scale and would hide a wrong clip
    # factor; a tight bound so clipping really triggers.
    data = batches()
    sgd = optax.sgd(0.1)
    ref = reference.train(make_gpt, models.lm_loss, data, sgd, max_grad_norm=0.05)
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=4), models.lm_loss)
    with mpmd.Trainer(pipe, optimizer=sgd, schedule=name, num_microbatches=4, max_grad_norm=0.05) as trainer:
        norms = []
        for x, y in data:
            norms.append(trainer.step(x, y)["grad_norm"])
        reference.assert_leaves_close(reference.stage_leaves(trainer.params()), ref[2], rtol=1e-5)
    assert min(norms) > 0.05, "the test must exercise clipping"
    # The trap: clipping each stage by its own norm is a different update.
    per_stage = reference.train(make_gpt, models.lm_loss, data,
                                optax.chain(optax.clip(0.05), sgd))
    assert not all(np.allclose(a, b, rtol=1e-5) for a, b in zip(ref[2], per_stage[2]))


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_forward_only_evaluate_and_predict(name, v):
    model = make_gpt()
    x, y = batches()[0]
    want_logits = np.asarray(model(x))
    want_loss = float(models.lm_loss(model(x), y))
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=4), models.lm_loss)
    with mpmd.Trainer(pipe, optax.adamw(LR), schedule=name, num_microbatches=4, virtual_stages=v) as trainer:
        before = reference.stage_leaves(trainer.params())
        assert trainer.evaluate(x, y) == pytest.approx(want_loss, rel=1e-5)
        (logits,) = trainer.predict(x)
        after = reference.stage_leaves(trainer.params())
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert all(np.array_equal(a, b) for a, b in zip(before, after)), "forward-only must not update"
