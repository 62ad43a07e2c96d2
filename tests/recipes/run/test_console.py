"""The console of `mpmd train`: progress, the workers' warnings (one line each, naming the
slice and its log file) and the summary; Orbax's, absl's and JAX's logging go to the log files
under <run_dir>/logs, and MPMD_LOG=debug brings them back to the console."""

import logging
import re

import grpc
import pytest

from mpmd.recipes import config
from mpmd.recipes.run import console
from mpmd.runtime.control.client import WorkerClient, WorkerError
from mpmd.runtime.worker.main import on_console
from tests.support.processes import TINY_GPT, Controller

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)

ARGS = [
    "configs/gpt_tiny.yaml",
    "train.steps=20",
    *TINY_GPT,
    "log.every=5",
    "cluster.backend=local",
    "train.sample_tokens=4",
    "log.tensorboard=false",
    "checkpoint.every=10",
    # In the clear, so that a caller with a wrong token reaches the token check (with the
    # default mutual TLS a stranger is refused at the handshake, before anything is logged).
    "cluster.tls=off",
]
# JAX_PLATFORMS unset (as a user has it): JAX tries its other backends and says so at start-up.
ENV = {"JAX_PLATFORMS": ""}
# What Orbax logs when a slice saves (its logger is absl's), as a worker's log file has it.
ORBAX = re.compile(r"INFO .*(orbax|[Ss]ave checkpoint)")


def serving_address(log: str) -> str:
    return re.search(r"INFO serving slice on (\S+); in the clear;", log).group(1)


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """A default run whose slice 1 is sent one RPC with a wrong token mid-run, which the worker
    logs as a warning: (run_dir, stdout, stderr)."""
    run_dir = tmp_path_factory.mktemp("console") / "run"
    ctl = Controller(run_dir, ARGS, env=ENV)
    ctl.wait_for_step(1)
    log_1 = run_dir / "logs" / "worker_1.log"
    intruder = WorkerClient(serving_address(log_1.read_text()), "not-the-token-0123456789", {"Heartbeat": 0})
    try:
        with pytest.raises(WorkerError) as refused:
            intruder.call("Heartbeat", timeout_s=10)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        intruder.close()
    out = ctl.succeed()
    return run_dir, out, ctl.stderr_path.read_text()


def test_console_holds_progress_summary_and_no_library_logging(quiet_run):
    run_dir, out, err = quiet_run
    assert "step 20/20" in out and "done: 20 steps" in out
    console = out + err
    for noise in ("INFO", "DEBUG", "tpu", "libtpu", "orbax", "absl", "serving slice", "shutting down", "worker["):
        assert noise not in console, f"{noise!r} on the console:\n{console}"


def test_worker_logs_hold_what_the_console_does_not(quiet_run):
    run_dir, _, _ = quiet_run
    logs = {n: (run_dir / "logs" / f"worker_{n}.log").read_text() for n in (0, 1)}
    for n, log in logs.items():
        assert re.search(r"worker\[\d+\] INFO serving slice on ", log), log[:2000]
        assert ORBAX.search(log), f"no Orbax line in worker_{n}.log:\n{log[:2000]}"
        assert "shutting down" in log
    if "Unable to initialize backend" in logs[0]:  # JAX's start-up, where it has other backends to try
        assert "INFO Unable to initialize backend 'tpu'" in logs[0]


def test_a_worker_warning_is_one_console_line_naming_slice_and_log(quiet_run):
    run_dir, _, err = quiet_run
    log_file = run_dir / "logs" / "worker_1.log"
    lines = [line for line in err.splitlines() if "refused Heartbeat" in line]
    assert len(lines) == 1, err
    assert re.fullmatch(
        rf"worker 1 WARNING refused Heartbeat from \S+: wrong token \(see {re.escape(str(log_file))}\)", lines[0]
    ), lines[0]
    assert "WARNING refused Heartbeat" in log_file.read_text()  # the worker's own account
    assert lines[0] in (run_dir / "logs" / "controller.log").read_text()


def test_controller_log_holds_the_progress_with_times(quiet_run):
    run_dir, out, _ = quiet_run
    log = (run_dir / "logs" / "controller.log").read_text()
    shown = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(shown) == 4, out  # log.every=5 of 20 steps
    for line in shown:
        assert re.search(rf"^\S+ \S+ INFO mpmd.progress: {re.escape(line)}$", log, re.M), log


def test_mpmd_log_debug_brings_it_all_back(tmp_path):
    run_dir = tmp_path / "debug"
    ctl = Controller(
        run_dir,
        [*ARGS, "train.steps=2", "train.sample_tokens=0", "checkpoint.every=0"],
        env={**ENV, "MPMD_LOG": "debug"},
    )
    out = ctl.succeed()
    err = ctl.stderr_path.read_text()
    assert "done: 2 steps" in out
    log_0 = run_dir / "logs" / "worker_0.log"
    assert re.search(rf"^worker 0 INFO serving slice on \S+; .*\(see {re.escape(str(log_0))}\)$", err, re.M), err[
        -3000:
    ]
    assert re.search(r"^worker 1 (INFO|DEBUG) .*(orbax|[Ss]ave checkpoint)", err, re.M), err[-3000:]
    assert "worker 1 INFO shutting down" in err
    assert re.search(r"^(INFO|DEBUG) jax\.", err, re.M), "the controller's own JAX logging"
    assert "DEBUG" in log_0.read_text()  # the workers log at debug too


def test_console_filter_by_level_and_for_jax_start_up_notes():
    # The same filter decides for the worker's relay and for the controller's console.
    record = logging.LogRecord("mpmd.worker", logging.WARNING, __file__, 1, "refused", None, None)
    assert on_console(record, logging.WARNING) and not on_console(record, logging.ERROR)
    # JAX's backend start-up notes (a TPU without libtpu, ...) only at info and below.
    startup = logging.LogRecord(
        "jax._src.xla_bridge", logging.WARNING, __file__, 1, "A Google TPU may be present", None, None
    )
    assert not on_console(startup, logging.WARNING) and on_console(startup, logging.INFO)


def test_mpmd_log_must_name_a_level(monkeypatch):
    monkeypatch.setenv("MPMD_LOG", "loud")
    with pytest.raises(config.ConfigError, match="MPMD_LOG='loud' must be one of debug, info, warning, error"):
        console.level("warning")
    monkeypatch.setenv("MPMD_LOG", "DEBUG")
    assert console.level("warning") == "debug"
    monkeypatch.delenv("MPMD_LOG")
    assert console.level("error") == "error"
