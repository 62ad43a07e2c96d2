"""The Llama-style model: pipelined equals unpipelined training (float32 and bfloat16, every
schedule, on a tensor-parallel mesh, with tied embeddings cut at marks), rematerialisation
keeps gradients and cuts saved activations, seeded sampling, and the 1B dry run.

Every pipelined run is compared with plain unpipelined JAX training of the same model in the
same precision (tests/support/reference.py), with SGD + momentum: Adam's update is nearly invariant
to gradient scale and would hide a wrong gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mpmd import models
import mpmd
from mpmd.stages import sharding
from mpmd.stages import costs as stage_costs
from mpmd.recipes import config
from mpmd.recipes.run import plan
from mpmd.recipes.commands import train as train_cli
from mpmd.runtime.worker.instructions import Recv
from tests.support import reference
from tests.support.processes import ROOT

# Many training runs against the unpipelined model, each seconds: outside the fast loop.
pytestmark = pytest.mark.slow

# vocabulary, width, query heads, key/value heads, blocks, sequence length: 4 layers, so 4 stages fit
VOCAB, D, HEADS, KV_HEADS, BLOCKS, SEQ = 32, 16, 4, 2, 2, 8
M = 4


def make_llama(dtype="float32", remat="none", **kw):
    return lambda: models.Llama(
        VOCAB, D, HEADS, BLOCKS, SEQ, num_kv_heads=KV_HEADS, dtype=dtype, remat=remat, rngs=nnx.Rngs(0), **kw
    )


def sgd():
    return optax.sgd(0.1, momentum=0.9)


def data():
    return reference.batches()  # 3 batches of 8 rows of 8 tokens below 32


@pytest.fixture(scope="module")
def unpipelined():
    """dtype -> (losses, first-step grads, final params) of plain JAX training."""
    return {
        dtype: reference.train(make_llama(dtype), models.lm_loss, data(), sgd()) for dtype in ("float32", "bfloat16")
    }


def run(make, schedule="1f1b", num_stages=2, v=None, mesh=None):
    """(losses, first-step grads, final params, trainer's lowering) of the pipelined model."""
    pipe = mpmd.Pipeline(mpmd.split(make(), num_stages), models.lm_loss)
    with mpmd.Trainer(
        pipe, sgd(), schedule=schedule, num_microbatches=M, virtual_stages=v, mesh=mesh, cluster=mpmd.InProcessCluster()
    ) as trainer:
        batches = data()
        _, grads = trainer.grads(*batches[0])
        losses = [trainer.step(x, y)["loss"] for x, y in batches]
        return losses, reference.stage_leaves(grads), reference.stage_leaves(trainer.params()), trainer


def global_rel(got, want) -> float:
    """||got - want|| / ||want|| over all leaves together."""
    err = sum(np.sum((g.astype(np.float64) - w) ** 2) for g, w in zip(got, want))
    return float(np.sqrt(err / sum(np.sum(np.square(w.astype(np.float64))) for w in want)))


def test_layers_are_the_model_causal_grouped_and_float32_out():
    model = make_llama("bfloat16")()
    x = data()[0][0]

    @nnx.jit
    def by_layers(model, x):
        for layer in model.layers():
            x = layer(x)
        return x

    forward = nnx.jit(lambda model, x: model(x))  # op by op, even this model takes seconds
    logits = forward(model, x)
    np.testing.assert_array_equal(logits, by_layers(model, x))
    assert logits.shape == (8, SEQ, VOCAB) and logits.dtype == jnp.float32
    assert model.layers()[0](x).dtype == jnp.bfloat16  # activations in the compute dtype
    assert all(l.dtype == jnp.float32 for l in jax.tree.leaves(nnx.state(model, nnx.Param)))
    attn = model.blocks[0].attn
    assert attn.q.kernel.shape == (D, D) and attn.k.kernel.shape == (D, D * KV_HEADS // HEADS)
    changed = x.copy()
    changed[:, 5] = (changed[:, 5] + 1) % VOCAB
    after = forward(model, changed)
    np.testing.assert_array_equal(logits[:, :5], after[:, :5])
    assert not np.allclose(logits[:, 5:], after[:, 5:])
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        models.Llama(VOCAB, D, HEADS, BLOCKS, SEQ, num_kv_heads=3, rngs=nnx.Rngs(0))


# float32 under GPipe here and under 1F1B with tensor=2 below: every schedule runs this Llama
# in bfloat16 (the next test), and in float32 the GPT (tests/train/test_pipeline_equivalence.py,
# 1f1b, zb-h1 and interleaved-1f1b at p=2 and p=4).
@pytest.mark.parametrize("name,stages,v", [("gpipe", 2, None)])
def test_float32_pipeline_matches_unpipelined(unpipelined, name, stages, v):
    losses, grads, params, _ = run(make_llama(), name, stages, v)
    want = unpipelined["float32"]
    np.testing.assert_allclose(losses, want[0], rtol=1e-5)
    reference.assert_leaves_close(grads, want[1], 1e-5, "gradients")
    reference.assert_leaves_close(params, want[2], 1e-5, "parameters")


@pytest.mark.parametrize(
    "name,stages,v", [("gpipe", 2, None), ("1f1b", 2, None), ("zb-h1", 2, None), ("interleaved-1f1b", 4, 2)]
)
def test_bfloat16_pipeline_matches_unpipelined_bfloat16(unpipelined, name, stages, v):
    """Tolerances. bfloat16 keeps 8 significant bits: each rounding is off by up to 2^-9 ~ 0.2%.
    Microbatching changes which values are rounded (a matmul over 2 rows instead of 8 rounds
    to bf16 at other points, gradients are summed over microbatches in float32 instead of in
    one bf16 backward), so pipelined and unpipelined bf16 agree to rounding, not to 1e-5.
    Measured here: gradients 1.8% apart (relative L2 over all leaves), parameters after 3
    steps 0.06%, losses 7e-5; unpipelined bf16 itself is 3.9% from float32 in gradients. The
    bounds below are ~3x the measured gaps (a wrong microbatch, stage or cotangent gives
    O(1)), and the pipeline must be no further from float32 than unpipelined bf16 is (x1.5):
    pipelining adds no error beyond what bf16 itself makes."""
    losses, grads, params, trainer = run(make_llama("bfloat16"), name, stages, v)
    b16, f32 = unpipelined["bfloat16"], unpipelined["float32"]
    # what crosses between slices really is bfloat16
    recvs = [i for stream in trainer.lowered.train for i in stream if isinstance(i, Recv)]
    assert recvs and all(s.dtype == "bfloat16" for i in recvs for s in i.specs)
    np.testing.assert_allclose(losses, b16[0], rtol=3e-4)
    assert global_rel(grads, b16[1]) < 0.05
    assert global_rel(params, b16[2]) < 2e-3
    assert global_rel(b16[1], f32[1]) > 1e-3, "the bf16 reference must differ from float32, else this is vacuous"
    assert global_rel(grads, f32[1]) < 1.5 * global_rel(b16[1], f32[1])


def test_tensor_parallel_mesh_lays_out_heads_and_matches(unpipelined):
    """Heads, MLP width and vocabulary split over tensor=2 (mpmd.stages.sharding.RULES); key/value
    projections (kv) replicated. Shardings change only the order of float sums: 1e-5."""
    losses, grads, params, trainer = run(make_llama(), "1f1b", 2, mesh={"tensor": 2})
    want = unpipelined["float32"]
    np.testing.assert_allclose(losses, want[0], rtol=1e-5)
    reference.assert_leaves_close(grads, want[1], 1e-5, "gradients")
    reference.assert_leaves_close(params, want[2], 1e-5, "parameters")
    pipe = trainer.pipeline
    layouts = [
        (path, layout)
        for k, fn in enumerate(pipe.fns)
        for path, layout in zip(sharding.param_paths(fn), trainer.layout.params[k])
    ]
    layout_of = lambda suffix: {layout for path, layout in layouts if path.endswith(suffix)}
    assert layout_of("attn/q/kernel") == {P(None, "tensor")}
    assert layout_of("attn/k/kernel") == {P(None, None)}
    assert layout_of("attn/out/kernel") == {P("tensor", None)}
    assert layout_of("mlp/gate/kernel") == {P(None, "tensor")}
    assert layout_of("token/embedding") == {P("tensor", None)}


def _residual_bytes(remat: str, dtype: str) -> list[int]:
    pipe = mpmd.Pipeline(mpmd.split(make_llama(dtype, remat)(), 2), models.lm_loss)
    x = jax.ShapeDtypeStruct((8 // M, SEQ), jnp.int32)
    return [m["residuals"] for m in stage_costs.memory(pipe, sgd(), x, x)]


def test_remat_keeps_gradients_and_cuts_saved_activations():
    x, y = data()[0]
    grads = {}
    for remat in ("none", "block", "dots_saveable"):
        model = make_llama(remat=remat)()
        grads[remat] = jax.tree.leaves(nnx.jit(nnx.grad(lambda m: models.lm_loss(m(x), y)))(model))
    for remat in ("block", "dots_saveable"):
        reference.assert_leaves_close(
            [np.asarray(g) for g in grads[remat]], [np.asarray(g) for g in grads["none"]], 1e-6, f"{remat} gradients"
        )
    # Bytes each stage's forward program stores per microbatch for its backward.
    for dtype in ("float32", "bfloat16"):
        saved = {remat: _residual_bytes(remat, dtype) for remat in ("none", "block", "dots_saveable")}
        for k in range(2):
            assert saved["block"][k] < saved["dots_saveable"][k] < saved["none"][k], (dtype, saved)
        # block keeps only what enters each block: far below everything the vjp would keep
        assert sum(saved["block"]) < 0.25 * sum(saved["none"]), (dtype, saved)


def test_tied_embeddings_are_cut_at_marks_and_train_like_the_unpipelined_model():
    make = make_llama(tie_embeddings=True)
    with pytest.raises(ValueError, match="cannot be cut by layers"):
        mpmd.split(make(), 2)

    class Whole:  # the tied model as one layer, for reference.train
        def layers(self):
            return [make()]

    want = reference.train(Whole, models.lm_loss, data(), sgd())
    model = make()
    model.cut_after([1], mpmd.stage_boundary)  # embed + block 0 | block 1 + head
    stages = mpmd.split(model, 2)
    pipe = mpmd.Pipeline(stages, models.lm_loss)
    assert len(pipe.shared) == 1  # the token table, in both stages
    with mpmd.Trainer(pipe, sgd(), num_microbatches=M, cluster=mpmd.InProcessCluster()) as trainer:
        losses = [trainer.step(x, y)["loss"] for x, y in data()]
        params = trainer.params()
    np.testing.assert_allclose(losses, want[0], rtol=1e-5)
    (a, i), (b, j) = pipe.shared[0]
    first, last = jax.tree.leaves(params[a])[i], jax.tree.leaves(params[b])[j]
    np.testing.assert_array_equal(first, last)  # the two copies stayed one weight
    table = jax.tree.leaves(nnx.state(make().embed, nnx.Param))[0]
    trained = next(p for p in want[2] if p.shape == table.shape)
    reference.assert_leaves_close([np.asarray(first)], [trained], 1e-5, "tied embedding")


def test_llama_1b_dry_run_prints_size_memory_and_step_without_allocating(capsys):
    cfg = config.load(ROOT / "configs/llama_1b.yaml")
    summary = plan.dry_run(cfg)
    assert 1.05e9 < summary["num_params"] < 1.3e9
    for m in summary["slices"]:
        # float32 parameters and gradients, two float32 Adam moments (and step counts)
        assert m["params"] == m["grads"] > 0 and 0 <= m["optimizer"] - 2 * m["params"] < 1024
        assert 0 < m["activations"] < m["params"]  # remat block: only block inputs are kept
    assert summary["step_s"] > 0 and 0 < summary["bubble"] < 1
    text = plan.describe(summary)
    assert f"parameters: {summary['num_params']:,}" in text and "predicted step:" in text
    assert sum(line.startswith("slice ") for line in text.splitlines()) == cfg.num_workers
    # the command line, on the tiny recipe (the same code; seconds)
    assert train_cli.main([str(ROOT / "configs/llama_tiny.yaml"), "--dry-run", "model.remat=block"]) == 0
    out = capsys.readouterr().out
    assert "parameters: " in out and "remat block" in out and "predicted step:" in out
