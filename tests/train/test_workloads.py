"""Real workloads through the pipeline, each equal to its unpipelined JAX reference (SGD with
momentum, float32, 3 steps, within 1e-5 of each leaf's scale): a batch dict, a token-weighted
loss over microbatches holding very different numbers of real tokens, a side input that only
a middle stage reads, bool and int values crossing cuts, an auxiliary loss added inside a
stage; and the refusals, each naming what was wrong.

The fast loop runs a few schedules; the full grid (every schedule x m in {1, 4, 8}) is slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpmd
from mpmd.runtime.worker.instructions import Recv, Run, Send
from mpmd.stages import names
from tests.support import reference as ref
from tests.support import workloads as wl

RTOL = 1e-5
SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved-1f1b", 2), ("zb-h1", None), ("zb-v", 2)]
FAST = [("1f1b", None, 4), ("zb-v", 2, 8)]
GRID = [
    pytest.param(s, v, m, marks=pytest.mark.slow)
    for s, v in SCHEDULES
    for m in (1, 4, 8)
    if m > 1 or s in ("gpipe", "zb-v")
    if (s, v, m) not in FAST
]


def assert_equal_to_reference(got, want):
    losses, grads, params, _ = got
    np.testing.assert_allclose(losses, want[0], rtol=RTOL, atol=1e-6)
    ref.assert_leaves_close(grads, want[1], RTOL, "first-step gradients")
    ref.assert_leaves_close(params, want[2], RTOL, "parameters after 3 steps")


@pytest.mark.parametrize("schedule,v,m", FAST + GRID)
def test_masked_loss_is_the_weighted_mean_over_the_whole_batch(schedule, v, m):
    data = wl.batches(m=m)
    counts = [int(b["mask"][j * (wl.BATCH // m) : (j + 1) * (wl.BATCH // m)].sum()) for b in data[:1] for j in range(m)]
    assert m == 1 or max(counts) > 4 * min(counts), counts  # very different token counts
    want = wl.reference(wl.masked_stages, wl.masked_loss, data, m)
    assert_equal_to_reference(wl.pipelined(wl.masked_stages, wl.masked_loss, data, m, schedule, virtual_stages=v), want)


def test_mean_of_microbatch_means_is_not_the_objective():
    """The trap a weighted loss avoids: the same masked loss as a per-microbatch mean trains
    another objective as soon as microbatches hold different token counts."""
    data = wl.batches(m=4)

    def per_microbatch_mean(out, batch):
        total, count = wl.masked_loss(out, batch)
        return total / jnp.maximum(count, 1.0)

    want = wl.reference(wl.masked_stages, wl.masked_loss, data, 4)
    losses, grads, _, _ = wl.pipelined(wl.masked_stages, per_microbatch_mean, data, 4, "1f1b")
    assert ref.max_leaf_error(grads, want[1]) > 0.05


@pytest.mark.parametrize(
    "schedule,v,m",
    [("interleaved-1f1b", 2, 4)]
    + [
        pytest.param(s, v, m, marks=pytest.mark.slow)
        for s, v in SCHEDULES
        for m in (1, 4, 8)
        if m > 1 or s in ("gpipe", "zb-v")
        if (s, m) != ("interleaved-1f1b", 4)
    ],
)
def test_side_inputs_ints_across_cuts_and_aux_losses(schedule, v, m):
    data = wl.batches(m=m)
    want = wl.reference(wl.mixed_stages, wl.masked_loss, data, m)
    got = wl.pipelined(wl.mixed_stages, wl.masked_loss, data, m, schedule, virtual_stages=v)
    assert_equal_to_reference(got, want)
    metrics = got[3]
    assert metrics["aux_loss"] > 0 and metrics["loss"] > metrics["aux_loss"]


def test_scalar_loss_with_aux_loss_and_side_input():
    data = wl.batches(m=4)
    want = wl.reference(wl.mixed_stages, wl.mean_loss, data, 4)
    assert_equal_to_reference(wl.pipelined(wl.mixed_stages, wl.mean_loss, data, 4, "1f1b"), want)


def test_on_a_data_parallel_mesh_slice():
    """data=2 inside each slice: the weight and the loss sum run over both batch shards."""
    data = wl.batches(m=4)
    want = wl.reference(wl.mixed_stages, wl.masked_loss, data, 4)
    assert_equal_to_reference(wl.pipelined(wl.mixed_stages, wl.masked_loss, data, 4, "1f1b", mesh={"data": 2}), want)


def test_side_input_goes_straight_to_the_stage_that_reads_it():
    """`positions` is fed to stage 2's slice only, and no slice sends or receives it; the bool
    and int leaves crossing the cut 0 -> 1 go forward and nothing of them comes back."""
    pipe = mpmd.Pipeline(wl.mixed_stages(), wl.masked_loss)
    with mpmd.Trainer(pipe, wl.sgd(), schedule="gpipe", num_microbatches=2, cluster=mpmd.InProcessCluster()) as t:
        t.step(wl.batches(steps=1, m=2)[0])
        streams = [list(s) for s in t.lowered.train]
    for r, stream in enumerate(streams):
        reads = {n for ins in stream if isinstance(ins, Run) for n in ins.inputs}
        assert any(n == names.side(2, 0) for n in reads) == (r == 2), r
        moved = [ins for ins in stream if isinstance(ins, (Send, Recv))]
        assert not any(names.parse_buffer(ins.buffer).kind == "side" for ins in moved if hasattr(ins, "buffer"))
    # Slice 1 sends the cotangent of stage 1's input back: only the float leaf of (h, keep, positions).
    grad_sends = [ins for ins in streams[1] if isinstance(ins, Send) and names.parse_key(ins.key).kind == "grad"]
    assert grad_sends and all(len(ins.pieces) <= 1 for ins in grad_sends)
    recv = [ins for ins in streams[0] if isinstance(ins, Recv) and names.parse_key(ins.key).kind == "grad"]
    assert recv and all(len(ins.specs) == 1 and ins.specs[0].dtype == "float32" for ins in recv)


# -- a model cut at stage marks: side inputs and an auxiliary loss ----------------------------
def marked_reference(data, m):
    """The unpipelined MarkedMasked's (losses, grads, params), leaves in the stages' order."""
    losses, grads, params = wl.reference(lambda: [wl.MarkedMasked()], wl.masked_loss, data, m)
    order = [i for s in wl.marked_stages() for i in s.param_index]  # the global leaf of each stage leaf
    return losses, [grads[i] for i in order], [params[i] for i in order]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_marked_model_with_side_inputs_and_aux_loss(schedule):
    data = wl.batches(m=4)
    got = wl.pipelined(wl.marked_stages, wl.masked_loss, data, 4, schedule)
    assert_equal_to_reference(got, marked_reference(data, 4))
    assert got[3]["aux_loss"] > 0 and got[3]["loss"] > got[3]["aux_loss"]


def test_marked_side_inputs_go_straight_to_the_stages_that_read_them():
    """The cut gives each stage the keywords its equations read: `mask` to stage 1 (which
    recomputes what depends on it alone), `positions` to stage 2, `segment_ids` (no batch key)
    to none; nothing of them crosses a cut, and only stage 1 adds an auxiliary loss."""
    stages = wl.marked_stages()
    assert [s.keywords for s in stages] == [(), (("mask", True),), (("positions", False),)]
    batch = wl.batches(steps=1, m=2)[0]
    assert len(stages[0].apply(stages[0].param_leaves, batch["inputs"])) == 1  # h alone crosses 0 -> 1
    with mpmd.Trainer(
        mpmd.Pipeline(stages, wl.masked_loss),
        wl.sgd(),
        schedule="gpipe",
        num_microbatches=2,
        cluster=mpmd.InProcessCluster(),
    ) as t:
        # Forward-only plans feed the side inputs too; an evaluation's loss has no aux term.
        want = wl.MarkedMasked()(batch["inputs"], mask=batch["mask"], positions=batch["positions"])
        (predicted,) = t.predict(batch)
        np.testing.assert_allclose(predicted, want, rtol=1e-6, atol=1e-7)
        assert t.evaluate(batch) == pytest.approx(float(np.divide(*wl.masked_loss(want, batch))), rel=1e-6)
        t.step(batch)
        streams = [list(s) for s in t.lowered.train]
    for r, stream in enumerate(streams):
        buffers = {n for ins in stream if isinstance(ins, Run) for n in ins.inputs + ins.outputs}
        assert {k for k in range(3) if names.side(k, 0) in buffers} == ({r} if r else set()), r
        assert {k for k in range(3) if names.aux(k, 0) in buffers} == ({1} if r == 1 else set()), r
        moved = [ins for ins in stream if isinstance(ins, (Send, Recv)) and hasattr(ins, "buffer")]
        assert not any(names.parse_buffer(ins.buffer).kind == "side" for ins in moved)


def test_marked_model_refuses_a_missing_required_side_input():
    with pytest.raises(ValueError, match=r"MarkedMasked.__call__ takes the keyword-only parameter\(s\) \['mask'\]"):
        mpmd.split(wl.MarkedMasked(), sample_input=wl.batches(steps=1)[0]["inputs"])


def test_pair_shorthand_is_the_batch_dict():
    """step(inputs, targets) is {"inputs": ..., "targets": ...} with loss_fn(outputs, targets)."""
    x, y = ref.batches()[0]
    model = ref.make_gpt
    from mpmd import models

    def run(as_dict):
        pipe = mpmd.Pipeline(
            mpmd.split(model(), num_stages=2),
            models.lm_loss if not as_dict else (lambda out, b: models.lm_loss(out, b["targets"])),
        )
        with mpmd.Trainer(pipe, wl.sgd(), num_microbatches=2, cluster=mpmd.InProcessCluster()) as t:
            loss = t.step({"inputs": x, "targets": y} if as_dict else x, None if as_dict else y)["loss"]
            return loss, ref.stage_leaves(t.params())

    a, b = run(False), run(True)
    assert a[0] == b[0] and all(np.array_equal(p, q) for p, q in zip(a[1], b[1]))


# -- refusals --------------------------------------------------------------------------------
def _trainer(stages, loss=wl.masked_loss, m=2):
    return mpmd.Trainer(
        mpmd.Pipeline(stages, loss), wl.sgd(), schedule="gpipe", num_microbatches=m, cluster=mpmd.InProcessCluster()
    )


def test_refuses_a_side_input_that_is_no_batch_key():
    batch = wl.batches(steps=1)[0]
    del batch["positions"]
    with (
        _trainer(wl.mixed_stages()) as t,
        pytest.raises(ValueError, match=r"stage 2 \(Positional\).*'positions'.*no key"),
    ):
        t.step(batch)


def test_refuses_a_key_without_the_batch_on_axis_0():
    batch = wl.batches(steps=1)[0]
    batch["mask"] = batch["mask"][:3]
    with _trainer(wl.masked_stages()) as t, pytest.raises(ValueError, match=r"batch\['mask'\].*axis 0"):
        t.step(batch)


def test_refuses_a_batch_without_inputs():
    with _trainer(wl.masked_stages()) as t, pytest.raises(ValueError, match="'inputs' key"):
        t.step({"x": np.zeros((4, wl.T, wl.D), np.float32)})


def test_refuses_a_weight_that_depends_on_the_outputs():
    def bad(out, batch):
        return jnp.sum(out), jnp.sum(out > 0)

    with _trainer(wl.masked_stages(), bad) as t, pytest.raises(ValueError, match="weight that depends on the model"):
        t.step(wl.batches(steps=1)[0])


class Printing(wl.Dense):
    def __call__(self, x):
        jax.debug.print("h {}", x.sum())
        return super().__call__(x)


class CallingBack(wl.Dense):
    def __call__(self, x):
        x = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return super().__call__(x)


@pytest.mark.parametrize("stage,primitive", [(Printing, "debug_print"), (CallingBack, "pure_callback")])
def test_refuses_host_callbacks_naming_the_stage(stage, primitive):
    with pytest.raises(ValueError, match=rf"stage 1 \({stage.__name__}\) calls the host \({primitive}"):
        mpmd.Pipeline([wl.Dense(0), stage(1)], wl.mean_loss, sample_input=np.zeros((2, wl.T, wl.D), np.float32))


class Drifting(wl.Dense):
    """Changes a parameter in its forward (a running value kept in an nnx.Param)."""

    def __call__(self, x):
        self.l.bias[...] = self.l.bias[...] * 0.9
        return super().__call__(x)


class Rematted(wl.Dense):
    """nnx.remat hands every parameter back through its checkpoint unchanged: no change."""

    def __call__(self, x):
        return nnx.remat(lambda m, x: wl.Dense.__call__(m, x))(self, x)


def test_refuses_a_stage_that_changes_a_parameter_in_its_forward():
    x = np.zeros((2, wl.T, wl.D), np.float32)
    mpmd.Pipeline([wl.Dense(0), Rematted(1)], wl.mean_loss, sample_input=x)
    with pytest.raises(ValueError, match=r"stage 1 \(Drifting\) changes its parameter 'l.bias' in its forward"):
        mpmd.Pipeline([wl.Dense(0), Drifting(1)], wl.mean_loss, sample_input=x)


def test_refuses_a_loss_that_is_neither_scalar_nor_pair():
    with _trainer(wl.masked_stages(), lambda out, b: out) as t, pytest.raises(ValueError, match="scalar.*or a pair"):
        t.step(wl.batches(steps=1)[0])


@pytest.mark.slow
def test_on_worker_processes_equal_in_process(workers):
    """The same workload on two real worker processes (gRPC, the transfer data plane; the cut
    0 -> 1 with its bool and int leaves crosses between them, the side input is fed to slice
    0 where stage 2 lies): bitwise the in-process run."""
    data = wl.batches(m=4)
    remote = wl.pipelined(
        wl.mixed_stages, wl.masked_loss, data, 4, "interleaved-1f1b", cluster=workers, virtual_stages=2, close=False
    )
    local = wl.pipelined(wl.mixed_stages, wl.masked_loss, data, 4, "interleaved-1f1b", virtual_stages=2)
    assert remote[0] == local[0]
    for a, b in zip(remote[1] + remote[2], local[1] + local[2]):
        assert np.array_equal(a, b)
