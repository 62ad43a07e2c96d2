"""Packed sequences: documents packed into one row, told apart by `segment_ids`, with
`positions` restarting per document. Each document's logits are those of the model on the
document alone, unpipelined and pipelined over 2 worker processes; a layer-split GPT trained
through the pipeline on such batches equals the unpipelined model trained on them, with the
mean loss and with the token-weighted one over a loss mask (models.masked_lm_loss); each side
input reaches only the stages whose layers take it.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mpmd
from mpmd import models
from mpmd.models.llama import Llama
from mpmd.runtime.worker.instructions import Recv, Run, Send
from mpmd.stages import batch as batches
from mpmd.stages import names
from mpmd.stages.leaf_paths import path_string
from tests.support import reference as ref
from tests.support import workloads as wl

VOCAB, SEQ = 32, 8
# Per row, the lengths of the documents packed into it (each row SEQ tokens).
DOCS = [(5, 3), (2, 6), (1, 4, 3)]


def packing(doc_lengths) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) int32 [rows, SEQ]: document j of a row is segment j, its
    tokens at positions 0, 1, ..."""
    seg = [np.repeat(np.arange(len(row)), row) for row in doc_lengths]
    pos = [np.concatenate([np.arange(n) for n in row]) for row in doc_lengths]
    return np.stack(seg).astype(np.int32), np.stack(pos).astype(np.int32)


MODELS = {
    "gpt": lambda: models.GPT(VOCAB, 16, 2, 2, SEQ, rngs=nnx.Rngs(0)),
    "llama": lambda: Llama(VOCAB, 16, 2, 2, SEQ, rngs=nnx.Rngs(0)),
    "llama-gqa-remat": lambda: Llama(VOCAB, 16, 4, 2, SEQ, num_kv_heads=2, remat="block", rngs=nnx.Rngs(0)),
}


def assert_each_document_alone(model, tokens, packed):
    """Each document of DOCS' packed rows `tokens` has in `packed` (logits) the logits the
    unpipelined model gives it alone: at the start of its own row, padded after its end (which
    a causal model's logits at the document's tokens cannot see), all in one call."""
    unpacked = np.asarray(model(tokens))
    where = [(r, start, n) for r, row in enumerate(DOCS) for start, n in zip(np.cumsum((0,) + row), row)]
    alone = np.zeros((len(where), SEQ), np.int32)
    for i, (r, start, n) in enumerate(where):
        alone[i, :n] = tokens[r, start : start + n]
    alone = np.asarray(model(alone))
    for i, (r, start, n) in enumerate(where):
        np.testing.assert_allclose(
            packed[r, start : start + n], alone[i, :n], rtol=1e-5, atol=1e-5, err_msg=f"row {r}, document at {start}"
        )
        if start:  # unpacked, the row's later documents see the earlier ones
            assert not np.allclose(unpacked[r, start : start + n], alone[i, :n], atol=1e-3)


def packed_rows() -> dict:
    tokens = np.random.default_rng(0).integers(0, VOCAB, (len(DOCS), SEQ)).astype(np.int32)
    segment_ids, positions = packing(DOCS)
    return {"inputs": tokens, "segment_ids": segment_ids, "positions": positions}


@pytest.mark.parametrize("name", MODELS)
def test_a_packed_row_gives_each_document_the_logits_it_has_alone(name):
    model, rows = MODELS[name](), packed_rows()
    packed = np.asarray(model(rows["inputs"], segment_ids=rows["segment_ids"], positions=rows["positions"]))
    assert_each_document_alone(model, rows["inputs"], packed)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_pipelined_over_two_workers_each_document_gets_its_logits_alone(name, workers, tmp_path):
    """The model split in 2 stages on 2 worker processes (segment_ids and positions put to the
    slices whose layers take them): the packed rows' logits (float32) are each document's alone
    within 1e-5."""
    rows = packed_rows()
    pipe = mpmd.Pipeline(mpmd.split(MODELS[name](), num_stages=2), models.masked_lm_loss)
    batch = {**rows, "targets": rows["inputs"], "loss_mask": np.ones(rows["inputs"].shape, np.float32)}
    with mpmd.Trainer(
        pipe, optax.sgd(0.1), schedule="1f1b", num_microbatches=3, cluster=workers, run_dir=tmp_path
    ) as trainer:
        (packed,) = trainer.predict(batch)
    assert packed.dtype == np.float32
    assert_each_document_alone(MODELS[name](), rows["inputs"], np.asarray(packed))


def packed_batches(steps: int = ref.STEPS, seed: int = 2) -> list[dict]:
    """Batches of ref.BATCH rows, each packing 1 to 3 documents of random lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(ref.BATCH):
            cuts = np.sort(rng.choice(np.arange(1, SEQ), rng.integers(0, 3), replace=False))
            rows.append(np.diff([0, *cuts, SEQ]))
        segment_ids, positions = packing(rows)
        out.append(
            {
                "inputs": rng.integers(0, VOCAB, (ref.BATCH, SEQ)).astype(np.int32),
                "targets": rng.integers(0, VOCAB, (ref.BATCH, SEQ)).astype(np.int32),
                "segment_ids": segment_ids,
                "positions": positions,
            }
        )
    return out


def packed_loss(logits, batch):
    return models.lm_loss(logits, batch["targets"])


def with_loss_mask(data: list[dict]) -> list[dict]:
    """The batches with a loss_mask: 0 on padding at each row's end (0 to SEQ - 1 tokens), so
    the microbatches hold different numbers of real tokens."""
    rng = np.random.default_rng(3)
    return [
        {**b, "loss_mask": (np.arange(SEQ) < rng.integers(1, SEQ + 1, (ref.BATCH, 1))).astype(np.float32)} for b in data
    ]


def masked_objective(logits, batch):
    """The token-weighted loss over the whole batch at once: what the pipeline's step means."""
    loss_sum, weight = models.masked_lm_loss(logits, batch)
    return loss_sum / weight


def unpipelined(data, loss=packed_loss) -> tuple[list, dict, dict]:
    """(losses, first-step gradients, final parameters) of ref.make_gpt() called whole with
    the batches' segment_ids and positions, trained in plain JAX; leaves keyed by model path."""
    graphdef, params, rest = nnx.split(ref.make_gpt(), nnx.Param, ...)
    paths = [path_string(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def objective(params, batch):
        logits = nnx.merge(graphdef, params, rest)(
            batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"]
        )
        return loss(logits, batch)

    losses, grads, final = ref.descend(objective, params, [(b,) for b in data], wl.sgd())
    return losses, dict(zip(paths, grads)), dict(zip(paths, final))


@pytest.mark.parametrize(
    "schedule,v,num_stages,weighted",
    [
        ("1f1b", None, 3, False),
        pytest.param("zb-v", 2, 4, False, marks=(pytest.mark.slow, pytest.mark.every_jax)),
        ("1f1b", None, 3, True),
    ],
)
def test_pipelined_packed_training_equals_the_unpipelined_model(schedule, v, num_stages, weighted):
    data = with_loss_mask(packed_batches()) if weighted else packed_batches()
    split = lambda: mpmd.split(ref.make_gpt(), num_stages=num_stages)
    paths = [p for stage in split().param_paths for p in stage]
    want_losses, want_grads, want_params = unpipelined(data, masked_objective if weighted else packed_loss)
    assert sorted(paths) == sorted(want_grads)  # the split's leaves are the model's
    losses, grads, params, _ = wl.pipelined(
        split, models.masked_lm_loss if weighted else packed_loss, data, 4, schedule, virtual_stages=v
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    ref.assert_leaves_close(grads, [want_grads[p] for p in paths], 1e-5, "first-step gradients")
    ref.assert_leaves_close(params, [want_params[p] for p in paths], 1e-5, "parameters after 3 steps")


def test_each_side_input_goes_only_to_the_stages_whose_layers_take_it():
    """Embed | 6 Blocks | Head: positions reach stage 0 only, segment_ids stage 1 only, the
    head neither; no slice sends or receives either."""
    pipe = mpmd.Pipeline(mpmd.split(ref.make_gpt(), num_stages=3, cuts=[1, 7]), packed_loss)
    assert [fn.keywords for fn in pipe.fns] == [(("positions", False),), (("segment_ids", False),), ()]
    batch = packed_batches(steps=1)[0]
    plan = batches.plan(pipe, batches.micro_specs(batch, 2), pair=False)
    assert plan.side_keys == (("positions",), ("segment_ids",), ())
    with mpmd.Trainer(pipe, wl.sgd(), schedule="gpipe", num_microbatches=2, cluster=mpmd.InProcessCluster()) as t:
        t.step(batch)
        streams = [list(s) for s in t.lowered.train]
    for r, stream in enumerate(streams):
        reads = {n for ins in stream if isinstance(ins, Run) for n in ins.inputs}
        assert {n for n in reads if names.parse_buffer(n).kind == "side"} == (
            {names.side(r, j) for j in range(2)} if r < 2 else set()
        ), r
        moved = [ins for ins in stream if isinstance(ins, (Send, Recv)) and hasattr(ins, "buffer")]
        assert not any(names.parse_buffer(ins.buffer).kind == "side" for ins in moved)


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize(
    "key,value",
    [
        ("segment_ids", np.zeros((3, SEQ), np.int32)),
        ("positions", np.zeros((2, SEQ - 1), np.int32)),
        ("positions", np.zeros((2, SEQ), np.float32)),
    ],
)
def test_refuses_ids_that_are_not_one_integer_per_token(name, key, value):
    with pytest.raises(ValueError, match=rf"{key} must be integers of shape \[batch, time\] = \(2, {SEQ}\)"):
        MODELS[name]()(np.zeros((2, SEQ), np.int32), **{key: value})
