"""The receive window: a slice posts a receive only once the one `window` receives before it
has been used, so the received data it holds but has not used never exceeds the schedule's
own peak of live activations; and nothing computed changes."""

import math

import jax
import numpy as np
import optax
import pytest

from mpmd import models
import mpmd
from mpmd.lowering import core as lowering
from mpmd.schedules import core as schedules
from mpmd.schedules import simulate
from mpmd.runtime.worker import instructions
from mpmd.runtime.worker import streams
from mpmd.runtime.worker.instructions import Delete, Recv, Run, Send, Spec
from tests.support import reference
from tests.support.reference import BATCH, batches, make_gpt

# Many training runs against the unpipelined model, each seconds: outside the fast loop.
pytestmark = pytest.mark.slow

UNBOUNDED = 10**6  # every receive posted when the step starts (the runtime before the window)


def traced_run(name: str, p: int, m: int, recv_window=None):
    """(losses, final leaves, the last step's per-slice "held" and "peak_bytes") of the small
    GPT on `p` in-process slices, every step traced."""
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=p), models.lm_loss)
    with mpmd.Trainer(
        pipe,
        optax.sgd(0.1, momentum=0.9),
        schedule=name,
        num_microbatches=m,
        recv_window=recv_window,
        cluster=mpmd.InProcessCluster(),
    ) as trainer:
        outs = [trainer.step(x, y, trace=True) for x, y in batches()[:2]]
        return (
            [o["loss"] for o in outs],
            reference.stage_leaves(trainer.params()),
            outs[-1]["held"],
            outs[-1]["peak_bytes"],
        )


def largest_transfer_bytes(p: int, m: int) -> int:
    """The largest bundle any slice receives: an activation or its cotangent (same shape)."""
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=p), models.lm_loss)
    x = jax.ShapeDtypeStruct((BATCH // m, reference.SEQ), np.int32)
    acts = pipe.activation_specs(x)
    return max(sum(math.prod(l.shape) * l.dtype.itemsize for l in jax.tree.leaves(a)) for a in acts[1:-1])


@pytest.mark.parametrize("name,p,m", [("1f1b", 4, 8), ("zb-h1", 2, 4)])
def test_received_but_unused_data_stays_within_the_schedules_bound(name, p, m):
    bound = simulate.simulate(schedules.make(name, p, m)).peak_live_activations
    assert lowering.recv_windows(schedules.make(name, p, m)) == bound
    losses, params, held, peak_bytes = traced_run(name, p, m)
    act_bytes = largest_transfer_bytes(p, m)
    for r, (count, nbytes) in enumerate(held):
        assert 1 <= count <= bound[r], (r, held, bound)
        assert nbytes <= bound[r] * act_bytes, (r, held, bound, act_bytes)
    # Without the window the first slice holds every cotangent of the step from its start:
    # more than the schedule keeps alive there. The window is what bounds it.
    free_losses, free_params, free_held, free_peak = traced_run(name, p, m, UNBOUNDED)
    assert free_held[0][0] == m > bound[0]
    assert free_peak[0] > peak_bytes[0]
    # Only when receives are posted changes: the run is the same, bit for bit.
    reference.assert_same((losses, params), (free_losses, free_params))
    print(
        f"{name} p={p} m={m}: held per slice (count, bytes) {held} bound {bound} x {act_bytes} B; "
        f"peak bytes {peak_bytes}, unbounded {free_held} {free_peak}"
    )


def outstanding(stream) -> int:
    """The most receives posted and not yet walked at once, walking `stream` as the executor does."""
    posted, most = set(), 0
    for i, ins in enumerate([None] + list(stream)):
        i -= 1  # -1: the step's start
        posted |= {j for j, r in enumerate(stream) if isinstance(r, Recv) and r.post_after == i}
        if isinstance(ins, Recv):
            assert stream.index(ins) in posted, f"instruction {i} walked before it was posted"
            posted.discard(stream.index(ins))
        most = max(most, len(posted))
    return most


def test_with_recv_window_marks_and_wire_form():
    act = (Spec((4, 8), "float32"),)
    stream = [
        Recv(f"a{j}", 0, f"act/{j}", act) if j % 2 == 0 else Run("f", (f"a{j - 1}",), (f"y{j}",)) for j in range(12)
    ] + [Send("y1", 0, "out"), Delete("y1")]
    for window in (1, 2, 3, 100):
        marked = list(streams.with_recv_window(stream, window))
        assert outstanding(marked) == min(window, 6)
        assert [instructions.from_json(instructions.to_json(i)) for i in marked] == marked
    # The first receive posted at the start; with window 2, the third after the first is walked.
    marked = list(streams.with_recv_window(stream, 2))
    assert [i.post_after for i in marked if isinstance(i, Recv)][:3] == [-1, -1, 0]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="receive window must be a positive integer"):
            streams.with_recv_window(stream, bad)


def test_a_receive_posted_after_its_use_is_refused():
    from mpmd.runtime.worker.executor import Executor
    from mpmd.runtime.control.inprocess import MemoryTransport, _Hub, meshes_for

    mesh = meshes_for([(1, 1, 1)])[0]
    ex = Executor(0, mesh, MemoryTransport(_Hub(), mesh))
    with pytest.raises(ValueError, match=r"instruction 0 \(recv 'k'\) is posted after instruction 0"):
        ex.install_plan("bad", [Recv("a", 1, "k", (Spec((2,), "float32"),), (), 0)])


def test_recv_window_must_be_positive():
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    with pytest.raises(ValueError, match="recv_window must be a positive integer"):
        mpmd.Trainer(pipe, optax.sgd(0.1), schedule="1f1b", num_microbatches=2, recv_window=0)
