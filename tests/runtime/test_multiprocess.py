"""The multi-process runtime: real worker processes, real gRPC, real transfers.

It must give exactly what the in-process cluster gives (bitwise: same compiled programs,
same threading), over every schedule, for split and for hand-written stages.
"""

import functools
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from mpmd import models
import mpmd
from tests.support import processes, reference
from tests.support.processes import alive, wait_gone
from tests.support.reference import assert_same, batches, make_gpt, train_pipeline as train
from tests.support.user_stages import UserModel, token_batches

pytestmark = [pytest.mark.slow, pytest.mark.every_jax]  # worker processes or a controller (tests/README.md)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cluster():
    c = mpmd.LocalCluster(num_workers=4)
    c.start(4)
    pids = list(c.pids)
    yield c
    c.close()
    assert wait_gone(pids) == [], "workers outlived their cluster"


# Four slices: every schedule's transfers (to the next slice and back, interleaved's wrap
# from the last slice to the first, zb-h1's deferred W) cross processes. The same schedules
# on two slices are pinned to the unpipelined model in-process (tests/train/test_pipeline_equivalence.py,
# <name>-p2-m*) and run on two worker processes bitwise like in-process elsewhere: gpipe by
# the fault tests' uninterrupted runs, 1f1b by test_static_cluster_with_mpmd_worker_processes
# and test_user_stages_same_as_inprocess, zb-h1 by tests/runtime/test_mesh_slices.py (worker
# processes); interleaved on two worker processes by tests/train/test_layout_resume.py (4xinterleaved:
# 4 stages on 2 slices, against the 4x1f1b run to 1e-6 and its own uninterrupted run bitwise).
# GPipe on four is left out: its transfers are 1f1b's (each activation to the next slice, each
# gradient back) in another order, an order tests/schedules/test_schedules.py validates and
# tests/train/test_pipeline_equivalence.py (gpipe-p4-*) runs against the unpipelined model.
# 1F1B on four is test_training_over_shared_memory_is_bitwise_training_over_sockets, which
# holds both its runs to the in-process one (merged into it on 2026-12-04: the same run
# three times over was the module's slowest test).
CASES = [(name, 4) for name in ("zb-h1", "interleaved-1f1b")]


@pytest.mark.parametrize("name,p", CASES, ids=[f"{n}-p{p}" for n, p in CASES])
def test_same_as_inprocess(cluster, name, p):
    v = 2 if name == "interleaved-1f1b" else 1
    make = lambda: mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=p * v), models.lm_loss)
    data = batches()
    local = train(make, name, 4, v, cluster, data)
    inproc = train(make, name, 4, v, mpmd.InProcessCluster(), data)
    assert_same(local, inproc)
    assert cluster.rpc_counts["Run"] > 0


def _shm_segments(pids) -> list[int]:
    """Per worker: the shared-memory segments (runtime/wire/shm.py) it maps now."""

    def count(pid):
        with open(f"/proc/{pid}/maps") as f:
            return len({line.split()[5] for line in f if "memfd:mpmd-shm" in line})

    return [count(pid) for pid in pids]


def test_training_over_shared_memory_is_bitwise_training_over_sockets(cluster):
    """Four slices of 1F1B (activations forward and gradients back between every neighbour
    pair) over shared memory, then over sockets: both bitwise the in-process run."""
    make = lambda: mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=4), models.lm_loss)
    data = batches()

    def run(transport):
        cluster.transport = transport  # from the next start: the Trainer's
        try:
            return train(make, "1f1b", 4, 1, cluster, data), _shm_segments(cluster.pids)
        finally:
            cluster.transport = "auto"

    over_shm, mapped_shm = run("shm")
    # The socket run's Setup ended the shm session: nothing of it is left mapped.
    over_socket, mapped_socket = run("socket")
    assert all(mapped_shm) and mapped_socket == [0] * 4, (mapped_shm, mapped_socket)
    assert_same(over_shm, over_socket)
    assert_same(over_shm, train(make, "1f1b", 4, 1, mpmd.InProcessCluster(), data))


def test_user_stages_same_as_inprocess(cluster):
    make = lambda: mpmd.Pipeline(UserModel().stages, models.lm_loss)
    data = token_batches()
    assert_same(train(make, "1f1b", 4, 1, cluster, data), train(make, "1f1b", 4, 1, mpmd.InProcessCluster(), data))


def test_one_run_rpc_per_worker_per_step(cluster):
    pipe = mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=4), models.lm_loss)
    trainer = mpmd.Trainer(pipe, optax.sgd(0.1), schedule="1f1b", num_microbatches=8, cluster=cluster)
    try:
        x, y = batches()[0]
        trainer.step(x, y)  # compiles and ships programs
        before = dict(cluster.rpc_counts)
        for _ in range(3):
            trainer.step(x, y)
        after = cluster.rpc_counts
        calls = {k: after[k] - before.get(k, 0) for k in after if k != "Heartbeat" and after[k] != before.get(k, 0)}
        assert calls == {"Run": 3 * 4}, calls
    finally:
        trainer.close(close_cluster=False)


def test_unreachable_worker_fails_fast_naming_it():
    cluster = mpmd.StaticCluster(["127.0.0.1:9"], token="t" * 32, connect_timeout_s=1.0)
    # "within 1 s": the connect timeout given, not a default, is what start() waited.
    with pytest.raises(Exception, match=r"worker 127\.0\.0\.1:9: did not answer within 1 s"):
        cluster.start(1)


def start_worker(token_file, *extra):
    os.chmod(token_file, 0o600)  # a token file others may read is refused
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpmd.recipes.cli",
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            str(token_file),
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("MPMD_WORKER_READY"), line + proc.stderr.read()
    return proc, line.split()[1]


@pytest.fixture
def static_workers(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789abcdef\n")
    procs = []
    try:
        addrs = []
        for _ in range(2):
            proc, addr = start_worker(token_file)
            procs.append(proc)
            addrs.append(addr)
        yield token_file, addrs, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_static_cluster_with_mpmd_worker_processes(static_workers):
    token_file, addrs, procs = static_workers
    make = lambda: mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    data = batches()[:2]
    static = train(make, "1f1b", 4, 1, mpmd.StaticCluster(addrs, token_file=str(token_file)), data)
    assert_same(static, train(make, "1f1b", 4, 1, mpmd.InProcessCluster(), data))
    for p in procs:  # closing the cluster shuts its workers down
        assert p.wait(timeout=10) == 0


# These static workers answer at once: a call that waits 5 s is a failure.
raw_call = functools.partial(processes.raw_call, timeout=5)


def test_token_is_required_and_bad_messages_get_errors(static_workers):
    import grpc
    from mpmd.runtime.wire import format as wire

    token_file, addrs, procs = static_workers
    token = token_file.read_text().strip()
    addr = addrs[0]
    hello = wire.encode({}, [])
    for bad in (None, "wrong-token-wrong-token"):
        with pytest.raises(grpc.RpcError) as e:
            raw_call(addr, "Hello", hello, bad)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for body, why in [
        (b"\x00\x00", "shorter than its 4-byte header"),
        (b"\x00\x00\x00\x05notjs", "not UTF-8 JSON"),
        (wire.encode({"slice_index": "zero"}, []), "'slice_index' must be an integer"),
        (b"\x00\x00\x00\x02{}junk", "trailing bytes"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            raw_call(addr, "Setup", body, token)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # a program that is not a jax.export serialization
        raw_call(
            addr,
            "Setup",
            wire.encode({"slice_index": 0, "transfer_host": "127.0.0.1", "transfer_secret": "ab" * 16}, []),
            token,
        )
        raw_call(
            addr,
            "LoadPrograms",
            wire.encode({"programs": [{"name": "f", "kind": "exported", "data": {"$blob": 0}}]}, [b"garbage"]),
            token,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The worker keeps serving after all of that.
    header, _ = wire.decode(raw_call(addr, "Hello", hello, token))
    assert header["pid"] == procs[0].pid
    procs[0].terminate()
    assert procs[0].wait(timeout=10) == 0
    assert "refused Hello" in procs[0].stderr.read()


CONTROLLER = """
import sys, time, mpmd
c = mpmd.LocalCluster(num_workers=2)
c.start(2)
print(*c.pids, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_controller_is_killed():
    ctl = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        pids = [int(p) for p in ctl.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        assert wait_gone(pids, timeout_s=5.0) == [], "orphaned workers outlived their controller"
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()


def test_worker_exits_cleanly_on_ctrl_c(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("another-token-0123456789\n")
    proc, _ = start_worker(token_file)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 0
    assert "shutting down: SIGINT" in proc.stderr.read()


def test_abstract_model_is_initialised_on_its_slices(cluster):
    """A model built with mpmd.abstract never materialises on the controller; each slice
    runs the module's own seeded initialiser and gets the values an eager build would."""
    make = lambda: models.GPT(32, 16, 2, 2, 8, rngs=nnx.Rngs(0))
    model = mpmd.abstract(make)
    assert all(isinstance(l, jax.ShapeDtypeStruct) for l in jax.tree.leaves(nnx.state(model, nnx.Param)))
    stages = mpmd.split(model, num_stages=4)
    trainer = mpmd.Trainer(
        mpmd.Pipeline(stages, models.lm_loss), optax.sgd(0.1), schedule="1f1b", num_microbatches=4, cluster=cluster
    )
    try:
        got = reference.stage_leaves(trainer.params())
    finally:
        trainer.close(close_cluster=False)
    want = reference.layer_leaves(make())
    reference.assert_leaves_close(got, want, rtol=1e-6)
    assert any(np.any(w != 0) for w in want)


def test_abstract_stage_not_built_by_mpmd_is_rejected():
    stage = nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"was not built by mpmd.abstract"):
        mpmd.Trainer(mpmd.Pipeline([stage], models.mse_loss), optax.sgd(0.1), schedule="gpipe", num_microbatches=1)
