"""Programs on groups of slices and handles moved between them, on real worker processes:
two workers of two devices each, one group per worker, on unlike meshes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mpmd.groups.client import WINDOW, Groups

pytestmark = [pytest.mark.slow, pytest.mark.every_jax]


@pytest.fixture(scope="module")
def groups(multi_device_workers):
    g = Groups(multi_device_workers(2), {"learner": {"data": 2}, "sampler": {"tensor": 2}})
    yield g
    g.close(close_cluster=False)


def tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((8, 6)).astype(np.float32),
        "ids": rng.integers(-(2**31), 2**31 - 1, (4,), dtype=np.int32),
        "h": rng.standard_normal((2, 4)).astype(ml_dtypes.bfloat16),
        "s": np.float32(rng.standard_normal()),
    }


def assert_bitwise(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def test_a_handle_moved_between_unlike_meshes_arrives_bitwise(groups):
    want = tree()
    h = groups.put(want, "learner", {"w": P("data"), "ids": P("data"), "h": P(), "s": P()})
    there = groups.move(h, "sampler", {"w": P(None, "tensor"), "ids": P(), "h": P(None, "tensor"), "s": None})
    back = groups.move(there, "learner", P())  # and back, replicated
    assert there.slice == groups.slice_of("sampler") and back.slice == groups.slice_of("learner")
    assert there.specs[3].layout == (None, "tensor")  # leaves in key order: h, ids, s, w
    assert_bitwise(groups.fetch(there), want)
    assert_bitwise(groups.fetch(back), want)
    assert_bitwise(groups.fetch(h), want)  # a move leaves the original in place


def test_a_program_runs_where_its_arguments_live_and_its_result_stays_there(groups):
    x = tree(1)
    h = groups.put(x, "sampler", {"w": P(None, "tensor"), "ids": None, "h": None, "s": None})

    def step(t):
        return {"w": t["w"] * 2 + t["s"], "n": jnp.sum(t["ids"] % 7)}

    y = groups.run(step, h, out_layouts={"w": P(None, "tensor"), "n": P()})
    assert y.slice == h.slice
    got = groups.fetch(y)
    assert_bitwise(got, jax.tree.map(np.asarray, jax.jit(step)(x)))
    assert y.specs[1].layout == (None, "tensor")


def test_calls_run_ahead_in_dependency_order(groups):
    """WINDOW x 3 calls, each reading the last one's result, alternating between the groups,
    dispatched without the controller waiting for any; the result is the chain's."""
    h = groups.put({"x": np.arange(8, dtype=np.int32)}, "learner", P("data"))
    want = np.arange(8, dtype=np.int32)
    inc = lambda t: {"x": t["x"] * 3 + 1}
    for i in range(WINDOW * 3):
        old = h
        h = groups.run(inc, h, out_layouts=P("data") if h.slice == 0 else P())
        want = want * 3 + 1
        groups.delete(old)
        h = groups.move(h, "sampler" if h.slice == 0 else "learner", P())
    assert np.array_equal(groups.fetch(h)["x"], want)
    assert len(groups._pending) == 0


def test_programs_compile_once_per_signature(groups):
    double = lambda t: t * 2
    a = groups.put(np.ones(4, np.float32), "learner")
    before = dict(groups._programs)
    b = groups.run(double, a)
    groups.run(double, b)
    assert len(groups._programs) == len(before) + 1
    groups.run(double, groups.put(np.ones(6, np.float32), "learner"))  # a new shape: a new program
    assert len(groups._programs) == len(before) + 2


def test_a_deleted_handle_is_gone_from_its_slice(groups):
    h = groups.put(np.ones(3, np.float32), "sampler")
    groups.delete(h)
    groups.run(lambda t: t + 1, groups.put(np.zeros(2, np.float32), "sampler"))  # carries the delete
    with pytest.raises(Exception, match=h.name):
        groups.fetch(h)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda g: g.put(np.ones(4), "nope"), r"no group 'nope'; the groups are \['learner', 'sampler'\]"),
        (lambda g: g.put(np.ones(3, np.float32), "learner", P("data")), "does not divide"),
        (lambda g: g.put(np.ones(4, np.float32), "learner", P("model")), r"names mesh axes \['model'\]"),
        (lambda g: g.put(np.ones(4, np.float32), "learner", k=1), "has no slice 1"),
        (lambda g: g.run(lambda t: t, np.ones(4)), "run takes handles"),
        (
            lambda g: g.run(lambda a, b: a, g.put(np.ones(2), "learner"), g.put(np.ones(2), "sampler")),
            "move them to one slice first",
        ),
    ],
)
def test_bad_calls_are_named(groups, call, match):
    with pytest.raises(ValueError, match=match):
        call(groups)


def test_a_group_of_several_slices_asks_which(multi_device_workers):
    g = Groups(multi_device_workers(2), {"learner": [{"data": 2}, {"tensor": 2}]})
    try:
        with pytest.raises(ValueError, match="has 2 slices: say which"):
            g.put(np.ones(2), "learner")
        h = g.put(np.arange(4, dtype=np.float32), "learner", P("data"), k=0)
        moved = g.move(h, "learner", P(), k=1)
        assert moved.slice == 1 and np.array_equal(g.fetch(moved), np.arange(4, dtype=np.float32))
    finally:
        g.close(close_cluster=False)
