"""Faults of the control plane, on real worker processes over real gRPC: no step waits
forever (an error anywhere aborts the step everywhere and names the slice and instruction; a
step without progress is aborted by the watchdog and recovered from as a lost worker), and
nobody without the token gets anything, cheaply.
"""

import itertools
import subprocess
import sys
import threading

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mpmd import models
import mpmd
from mpmd.runtime.worker import programs
from mpmd.runtime.wire import format as wire
from mpmd.runtime.control.cluster import StepFailed, WorkerLost
from mpmd.runtime.worker.instructions import Recv, Run, Send, Spec
from tests.support.processes import ROOT, mpmd_train, raw_call
from tests.support.recovery_runs import assert_same_run, run_with_fault, train

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # worker processes or a controller (tests/README.md)

F32_4 = (Spec((4,), "float32"),)
run_ids = itertools.count(10_000)  # run ids never repeat on a cluster


@pytest.fixture
def cluster(workers):
    """The session's two shared workers (tests/conftest.py), started, with a 60 s watchdog
    (the `workers` fixture puts the default back after the test)."""
    workers.start(2)
    workers.step_timeout_s = 60.0
    return workers


def ship(cluster, plans: dict[int, list], specs: dict[str, programs.ProgramSpec]):
    name = f"plan{next(run_ids)}"
    for i, stream in plans.items():
        cluster.load_programs(i, specs)
        cluster.install_plan(i, name, stream)
    return name


def double_spec():
    return programs.exported(lambda b: ((b[0] * 2,),), (jax.ShapeDtypeStruct((4,), np.float32),))


def run_ok(cluster):
    """A step that sends slice 0's doubled buffer to slice 1: the cluster still works."""
    plan = ship(
        cluster,
        {0: [Run("double", ("x",), ("y",)), Send("y", 1, "y")], 1: [Recv("y", 0, "y", F32_4)]},
        {"double": double_spec()},
    )
    results = cluster.run(plan, next(run_ids), {0: {"x": [np.arange(4, dtype=np.float32)]}}, {1: ["y"]})
    np.testing.assert_array_equal(results[1].fetched["y"][0], np.arange(4) * 2)


# -- an error anywhere aborts the step everywhere ---------------------------------------------
def test_failing_program_aborts_the_step_everywhere_naming_slice_and_instruction(cluster):
    # Slice 0's program is fed a float32[3] where it was exported for float32[4]: it fails on
    # every attempt. Slice 1 waits for what slice 0 would have sent: without the abort it
    # would wait forever.
    plan = ship(
        cluster,
        {0: [Run("double", ("x",), ("y",), label="double x"), Send("y", 1, "y")], 1: [Recv("y", 0, "y", F32_4)]},
        {"double": double_spec()},
    )
    # Left waiting, slice 1 would end the step through the watchdog (the fixture's
    # step_timeout_s=60) as WorkerLost, not as slice 0's StepFailed.
    with pytest.raises(StepFailed, match=r"slice 0 failed at plan\d+\[0\] run 'double x'.*mismatch") as e:
        cluster.run(plan, next(run_ids), {0: {"x": [np.zeros(3, np.float32)]}}, {})
    assert e.value.slice_index == 0 and "double x" in e.value.instruction
    run_ok(cluster)  # slice 1 was aborted, not left waiting: the next step runs


# 2**18 x 2**28 float32: 2**48 bytes (256 TiB), beyond any host's memory and beyond the 47-bit
# address space of a Linux process, so no allocator grants it, overcommitted or not.
HUGE = (2**18, 2**28)


class OutOfMemoryEmbed(nnx.Module):
    """A first stage whose forward keeps a 256 TiB residual for its backward (the cosine of a
    huge intermediate, which the vjp of its sine needs): a stage too big for its slice. It
    traces, lowers and exports on the controller, which allocates nothing; when the worker
    runs it, XLA refuses the allocation, on every attempt (RESOURCE_EXHAUSTED: out of
    memory), and the error surfaces where the forward's results are first waited for."""

    def __init__(self, vocab_size: int, d_model: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        huge = h[0, 0, 0] + jax.lax.broadcasted_iota(h.dtype, HUGE, 1)
        return h + jnp.sin(huge).mean()


class Head(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, rngs: nnx.Rngs):
        self.out = nnx.Linear(d_model, vocab_size, rngs=rngs)

    def __call__(self, h):
        return self.out(h)


def build_out_of_memory(cfg):
    """A `model.kind: custom` builder (two stages) whose every step fails on slice 0's worker."""
    rngs = nnx.Rngs(cfg.seed)
    return [
        OutOfMemoryEmbed(cfg.model.vocab_size, cfg.model.d_model, rngs),
        Head(cfg.model.vocab_size, cfg.model.d_model, rngs),
    ], models.lm_loss


def test_a_stage_out_of_memory_on_its_worker_ends_the_step_with_step_failed(cluster):
    rngs = nnx.Rngs(0)
    pipe = mpmd.Pipeline([OutOfMemoryEmbed(64, 16, rngs), Head(64, 16, rngs)], models.lm_loss)
    x = np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32)
    trainer = mpmd.Trainer(pipe, optax.sgd(0.1), schedule="1f1b", num_microbatches=2, cluster=cluster)
    try:
        # Dispatch is asynchronous: slice 0's forward is sent on before it has run, and its
        # error surfaces where its output is first waited for, slice 1's receive, which
        # names the sender. Slice 0 waits for gradients that never come: a step left
        # hanging would end through the watchdog as a lost worker, recovered from.
        with pytest.raises(
            StepFailed,
            match=r"slice 1 failed at train\S*\[\d+\] recv 'act1/0' from slice 0: "
            r".*Out of memory allocating 281474976710656 bytes",
        ):
            trainer.step(x, x)
        # A traced step waits for each program: the error names the forward that failed.
        with pytest.raises(
            StepFailed,
            match=r"slice 0 failed at train\S*\[\d+\] run 'F s0 mb0' .*"
            r"RESOURCE_EXHAUSTED: Out of memory allocating",
        ) as e:
            trainer.step(x, x, trace=True)
        assert e.value.slice_index == 0 and e.value.instruction.startswith("train")
        assert trainer.restarts == 0, "a deterministic failure must not be recovered from as a lost worker"
    finally:
        trainer.close(close_cluster=False)
    run_ok(cluster)  # both workers were let go of the failed steps: the next one runs


def test_mpmd_train_with_a_failing_model_exits_naming_the_slice(tmp_path):
    run_dir = tmp_path / "fails"
    proc = mpmd_train(
        "configs/custom_stages.yaml",
        "model.module=tests.runtime.test_control_faults:build_out_of_memory",
        "pipeline.num_stages=2",
        "cluster.backend=local",
        "model.d_model=16",
        "train.batch_size=8",
        "data.max_bytes=300000",
        "log.tensorboard=false",
        f"run_dir={run_dir}",
        timeout=120,
    )
    assert proc.returncode == 1  # within mpmd_train's timeout: it did not hang
    assert "slice 1 failed at" in proc.stderr, proc.stderr[-3000:]
    # One line, naming the slice, what it waited for and why, not a traceback.
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: slice 1 failed at train@0[0] recv 'act1/0' from slice 0: ")
        and "Out of memory allocating" in last
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # The worker's own account is in its log file, not on the console.
    assert "Run failed: slice 1 failed at" in (run_dir / "logs" / "worker_1.log").read_text()
    assert "worker[" not in proc.stderr


# -- the watchdog ---------------------------------------------------------------------------
def test_hung_receive_is_aborted_by_the_watchdog_as_a_lost_worker(cluster):
    # Slice 1 waits for a transfer nobody sends; its worker is alive and answers heartbeats.
    plan = ship(
        cluster, {0: [Run("nap", (), ())], 1: [Recv("z", 0, "never-sent", F32_4)]}, {"nap": programs.sleep(0.0)}
    )
    cluster.step_timeout_s = 2.0
    try:
        # The message's "2.x s" is the watchdog's own measure of the time without progress.
        with pytest.raises(
            WorkerLost,
            match=r"slice 1 .* lost: run \d+ made no progress for 2\.\d s "
            r"\(step_timeout_s=2\); unfinished slices: 1 at instruction 0 \(recv\)",
        ):
            cluster.run(plan, next(run_ids), {}, {})
    finally:
        cluster.step_timeout_s = 60.0
    run_ok(cluster)  # the watchdog aborted slice 1's step: it serves the next one


def test_a_slow_step_that_progresses_is_not_aborted(cluster):
    # 4 s of work in 0.8 s pieces with a 2 s timeout: progress, not duration, is watched.
    plan = ship(
        cluster,
        {0: [Run("nap", (), ())] * 5 + [Run("nap", (), ()), Send("x", 1, "x")], 1: [Recv("x", 0, "x", F32_4)]},
        {"nap": programs.sleep(0.8)},
    )
    cluster.step_timeout_s = 2.0
    try:
        cluster.run(plan, next(run_ids), {0: {"x": [np.ones(4, np.float32)]}}, {1: ["x"]})
    finally:
        cluster.step_timeout_s = 60.0


def test_derived_step_timeout():
    from mpmd.runtime.control.client import ControlPlane
    from mpmd.runtime.control.runs import FIRST_STEP_TIMEOUT_S, RunWatch

    plane = ControlPlane(launcher=None, token="t" * 32)
    assert plane.step_timeout() == FIRST_STEP_TIMEOUT_S
    watch = RunWatch(plane, step_timeout_s=None)  # the part of the plane that times its runs
    watch.step_times.extend([0.1, 0.2, 10.0])
    assert watch.step_timeout() == 60.0  # max(60 s, 20 x 0.2 s)
    watch.step_times.extend([10.0, 10.0])
    assert watch.step_timeout() == 200.0  # 20 x the median, 10 s
    with pytest.raises(ValueError, match="step_timeout_s must be positive or None"):
        ControlPlane(launcher=None, token="t" * 32, step_timeout_s=0)


def wedge_once(at_step: int, slice_index: int = 1):
    """A fault: just before batch `at_step`, slice 1's worker is given a train plan that sleeps
    for 10 minutes, behind the control plane's back (its record of what it shipped keeps the
    true plan). The worker stays alive and answers heartbeats, as a worker wedged in a
    device kernel would; only the watchdog can see that its step does not move. The timeout
    is 3 s for that step only: recovery compiles nothing new (the compilation cache)."""

    def fault(i, trainer):
        c = trainer.cluster
        if fault.fired:
            c.step_timeout_s = None
        elif i == at_step:
            fault.fired.append(c.pids[slice_index])
            c.step_timeout_s = 3.0
            plan = next(n for n in c._shipped[slice_index]["plans"] if n.startswith("train"))
            c._load(slice_index, {"wedge": programs.sleep(600.0)})
            c._install(slice_index, plan, [Run("wedge", (), ())])

    fault.fired = []
    return fault


def test_watchdog_recovery_ends_like_an_uninterrupted_run(tmp_path, uninterrupted, workers):
    losses, params, rewinds = run_with_fault(tmp_path, wedge_once(3), cluster=workers)
    assert rewinds == 1
    assert "made no progress" in train.rewound[0] and "(step_timeout_s=3)" in train.rewound[0], train.rewound
    assert_same_run((losses, params), uninterrupted)


# -- nobody without the token gets anything, cheaply ---------------------------------------
def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_unauthenticated_big_requests_are_refused_before_their_body_is_read(cluster):
    address, pid = cluster.addresses[0], cluster.pids[0]
    body = bytes(100 * 2**20)
    before, peak, codes = rss_mb(pid), [0.0], []
    done = threading.Event()

    def sample():
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss_mb(pid))

    def send():
        try:
            raw_call(address, "Put", body, tls=cluster.tls)
        except grpc.RpcError as e:
            codes.append(e.code())

    sampler = threading.Thread(target=sample)
    sampler.start()
    senders = [threading.Thread(target=send) for _ in range(4)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    done.set()
    sampler.join()
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    # 400 MB were sent; the worker grew by well under one body.
    assert peak[0] - before < 40, f"worker RSS {before:.0f} MB -> peak {peak[0]:.0f} MB"


def test_a_second_worker_on_a_used_port_is_refused(cluster, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t" * 32 + "\n")
    token_file.chmod(0o600)
    address = cluster.addresses[0]
    proc = subprocess.run(
        [sys.executable, "-m", "mpmd.recipes.cli", "worker", "--listen", address, "--token-file", str(token_file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "MPMD_WORKER_READY" not in proc.stdout
    assert f"cannot listen on '{address}': the address is in use" in proc.stderr


def test_token_files_others_may_read_are_refused(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t" * 32 + "\n")
    token_file.chmod(0o644)
    cmd = [
        sys.executable,
        "-m",
        "mpmd.recipes.cli",
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--token-file",
        str(token_file),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "has mode 0644" in proc.stderr and "chmod 600" in proc.stderr
    with pytest.raises(ValueError, match=r"token_file .* has mode 0644.*allow_insecure_token_file=True"):
        mpmd.StaticCluster(["127.0.0.1:1"], token_file=str(token_file))
    mpmd.StaticCluster(["127.0.0.1:1"], token_file=str(token_file), allow_insecure_token_file=True)
    proc = subprocess.Popen(
        cmd + ["--allow-insecure-token-file"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout.readline().startswith("MPMD_WORKER_READY")
    finally:
        proc.kill()
        proc.wait()


def test_a_program_calling_a_host_callback_target_is_refused_at_load(cluster):
    target = "xla_ffi_python_cpu_callback"
    fn = lambda b: ((jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((4,), np.float32))(b[0]),),)
    exp = jax.export.export(jax.jit(fn), disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)])(
        (jax.ShapeDtypeStruct((4,), np.float32),)
    )
    body = wire.encode(
        {"programs": [{"name": "cb", "kind": "exported", "data": {"$blob": 0}}]}, [bytes(exp.serialize())]
    )
    with pytest.raises(grpc.RpcError) as e:
        raw_call(
            cluster.addresses[0], "LoadPrograms", body, cluster._token, generation=cluster.generation, tls=cluster.tls
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"custom-call target '{target}'" in e.value.details()
    run_ok(cluster)


@pytest.mark.parametrize(
    "method,header,blobs",
    [
        ("InstallPlan", {"name": "p", "stream": [5]}, []),
        ("InstallPlan", {"name": "p", "stream": [{"kind": "teleport"}]}, []),
        ("InstallPlan", {"name": "p", "stream": [{"kind": "run"}]}, []),
        ("Put", {"name": "b", "arrays": [{"$blob": 0}]}, [b"raw bytes, not an array"]),
        ("Put", {"name": "b", "arrays": "x"}, []),
        ("Get", {"names": ["no such buffer"]}, []),
        ("Run", {"plan": "no such plan", "run": 1}, []),
        ("Run", {"plan": "p", "run": 1, "feeds": {"x": 3}}, []),
        ("Connect", {"peers": {"zero": 5}}, []),
        ("Connect", {"peers": {"0": "not an address"}}, []),  # was INTERNAL
        # An overflowing shape made XLA abort the whole worker process.
        (
            "LoadPrograms",
            {"programs": [{"name": "s", "kind": "sleep", "outputs": [[[[2**40, 2**40], "float32"]]]}]},
            [],
        ),
        ("InstallPlan", {"name": "p", "stream": [["recv", "b", 0, "k", [[[2**40, 2**40], "float32"]]]]}, []),
        ("Abort", {"run": "now"}, []),
        ("LoadPrograms", {"programs": [{"name": "s", "kind": "sleep", "duration_s": "long"}]}, []),
        ("LoadPrograms", {"programs": [{"name": "s", "kind": "sleep", "outputs": [[[[2], "float99"]]]}]}, []),
    ],
)
def test_malformed_requests_get_invalid_argument(cluster, method, header, blobs):
    with pytest.raises(grpc.RpcError) as e:
        raw_call(
            cluster.addresses[1],
            method,
            wire.encode(header, blobs),
            cluster._token,
            generation=cluster.generation,
            tls=cluster.tls,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    header, _ = wire.decode(
        raw_call(cluster.addresses[1], "Hello", wire.encode({}, []), cluster._token, tls=cluster.tls)
    )
    assert header["pid"] == cluster.pids[1]  # still serving


@pytest.mark.parametrize(
    "method,header,says",
    [
        ("Run", {"plan": "p"}, "Run request field 'run' must be an integer; it is missing"),
        ("Run", {"plan": "p", "run": "7"}, "Run request field 'run' must be an integer, got str"),
        ("Run", {"plan": "p", "run": True}, "Run request field 'run' must be an integer, got bool"),
        ("Run", {"plan": "p", "step": 1}, "Run request has no field 'step'"),  # the old name of the run id
        ("Abort", {}, "Abort request field 'run' must be"),
        ("Put", {"name": 3, "arrays": []}, "Put request field 'name' must be a string, got int"),
        ("FinishRestore", {"commit": "yes"}, "FinishRestore request field 'commit' must be a bool"),
        ("Setup", {"slice_index": 0, "transfer_host": "127.0.0.1"}, "Setup request field 'transfer_secret' must be"),
    ],
)
def test_a_request_that_does_not_match_its_verb_is_refused_naming_verb_and_field(cluster, method, header, says):
    # Checked by the one table of verbs (runtime/wire/verbs.py) before any handler runs:
    # a real worker answers INVALID_ARGUMENT, its slice's state untouched, and serves on.
    with pytest.raises(grpc.RpcError) as e:
        raw_call(
            cluster.addresses[1],
            method,
            wire.encode(header, []),
            cluster._token,
            generation=cluster.generation,
            tls=cluster.tls,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in e.value.details()
    run_ok(cluster)
