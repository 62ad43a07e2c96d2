"""Helpers for tests that start real processes: worker liveness, the `mpmd train` command
(run to the end, or in the background as a Controller), and `mpmd worker` processes started
by hand (shared ones driven as a cluster manager would)."""

from __future__ import annotations

import functools
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mpmd.runtime.launchers.workers import process_alive as alive
from tests.support import xla

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is tests/support/processes.py)
# Small enough that a run is mostly process start-up; data.max_bytes keeps corpus reading short.
TINY_GPT = [
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_layers=2",
    "model.seq_len=16",
    "train.batch_size=8",
    "train.eval_batches=2",
    "data.max_bytes=300000",
    "log.progress=lines",
    "log.every=1",
]


def children(pid: int) -> list[int]:
    """The child processes of `pid` (none once it is gone)."""
    pids = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return pids
    for task in tasks:
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended since the listing
            continue
    return pids


def wait_gone(pids, timeout_s=10.0) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to `timeout_s` for all to exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def logged_at(line: str) -> float:
    """The time a worker's log line was written ("2026-12-06 22:21:16,298 worker[..] ..."), or 0."""
    import datetime

    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return 0.0


def processes_tagged(name: str, value: str) -> list[int]:
    """Live processes whose environment holds name=value (inherited by everything a test's
    process starts, whoever their parent is now)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"{name}={value}".encode() in (d / "environ").read_bytes().split(b"\0") and alive(int(d.name)):
                    found.append(int(d.name))
            except (OSError, ProcessLookupError):
                pass  # gone, or not ours
    return found


def mpmd_train(*args, timeout=120):
    """`python -m mpmd.recipes.cli train ARGS` on the CPU with 4 host devices; the CompletedProcess."""
    return mpmd_command("train", *args, timeout=timeout)


def mpmd_command(command: str, *args, timeout=120):
    """`python -m mpmd.recipes.cli COMMAND ARGS` on the CPU with 4 host devices; the CompletedProcess."""
    env = dict(os.environ)  # carries conftest's JAX compilation cache settings
    env["XLA_FLAGS"] = xla.flags(4, eigen_threads=True)
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "mpmd.recipes.cli", command, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def raw_call(address, method, body: bytes, token=None, timeout=30.0, generation=0, tls=None):
    """One call to a worker as a bare gRPC client makes it, no mpmd client in between: the
    token (if any) and `generation` in its metadata (a call of an older generation than the
    worker's is refused before its body is read: runtime/worker/service.py), over mutual TLS
    with `tls` (the cluster's certificates, runtime/wire/tls.py), else in the clear. The reply's
    bytes; grpc.RpcError as the worker answered."""
    import grpc
    from mpmd.runtime.wire.tls import CHANNEL_OPTIONS

    opts = [("grpc.max_send_message_length", 2**31 - 1)]
    with (
        grpc.secure_channel(address, tls.channel_credentials(), options=[*opts, *CHANNEL_OPTIONS])
        if tls
        else grpc.insecure_channel(address, options=opts)
    ) as ch:
        md = (("mpmd-token", token), ("mpmd-generation", str(generation))) if token is not None else ()
        return ch.unary_unary(f"/mpmd.Worker/{method}")(body, metadata=md, timeout=timeout)


def tiny_gpt_run(steps: int, every: int) -> list[str]:
    """The overrides of configs/gpt_tiny.yaml that the recipe-level fault tests train with: a
    two-layer model of width 32 on 300 KB of text, `steps` steps, a checkpoint every `every`,
    one progress line per step, no eval, sample, trace or TensorBoard."""
    return [
        "model.d_model=32",
        "model.num_layers=2",
        "model.seq_len=32",
        "train.batch_size=8",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.sample_tokens=0",
        f"checkpoint.every={every}",
        "log.progress=lines",
        "log.every=1",
        "log.trace_steps=[]",
        "log.tensorboard=false",
        "data.max_bytes=300000",
    ]


class Controller:
    """`python -m mpmd.recipes.cli train ARGS run_dir=RUN_DIR` in the background (on the CPU, with
        `env` added to this process's environment; `prefix`: argv it runs under, e.g. `ip netns
    exec HOST` from tests/support/netns.py); its stdout lines arrive on a queue. stderr
        goes to RUN_DIR.stderr beside the run directory: a pipe nobody drains would block the
        controller (and workers inheriting it) once full."""

    def __init__(self, run_dir: Path, args, env: dict | None = None, prefix=()):
        full_env = dict(os.environ)  # carries conftest's XLA_FLAGS and JAX compilation cache settings
        full_env["JAX_PLATFORMS"] = "cpu"
        full_env.update(env or {})
        self.run_dir = run_dir
        self.stderr_path = run_dir.parent / f"{run_dir.name}.stderr"
        with open(self.stderr_path, "a") as stderr:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "mpmd.recipes.cli", "train", *args, f"run_dir={run_dir}"],
                cwd=ROOT,
                env=full_env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.lines: queue.Queue = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_step(self, step: int, timeout_s: float = 90.0) -> None:
        """Until the progress line of `step` (or a later one) is printed."""
        self.wait_for(
            lambda line: (m := re.match(r"step (\d+)/", line)) and int(m.group(1)) >= step, f"step {step}", timeout_s
        )

    def wait_for(self, wanted, what: str, timeout_s: float = 90.0) -> str:
        """The first stdout line from now on for which `wanted(line)` holds (`what` names it
        in the failure)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout_s} s:\n{''.join(self.stdout)[-3000:]}") from None
            assert line is not None, f"the run ended before {what}:\n{''.join(self.stdout)[-3000:]}"
            self.stdout.append(line)
            if wanted(line):
                return line

    def wait_for_commit(self, timeout_s: float = 60.0, step: int | None = None) -> int:
        """Until a checkpoint (of `step`, if given) is committed in the run directory (saves
        are written in the background: a step's progress line comes before its commit); the
        newest step."""
        from mpmd.runtime.worker.slice_store import CheckpointStore

        deadline = time.monotonic() + timeout_s
        while not (committed := CheckpointStore(self.run_dir).committed()) or step not in (None, *committed):
            assert time.monotonic() < deadline, (
                f"no checkpoint{'' if step is None else f' of step {step}'} committed in {self.run_dir} within {timeout_s} s"
            )
            time.sleep(0.05)
        return committed[-1]

    def finish(self, timeout_s: float = 120.0) -> tuple[int, str]:
        """(exit status, whole stdout); the controller is killed if it outlives `timeout_s`."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        while (line := self.lines.get(timeout=10)) is not None:
            self.stdout.append(line)
        return rc, "".join(self.stdout)

    def succeed(self, timeout_s: float = 120.0) -> str:
        """The whole stdout, once the controller exited 0 (else fail with its stderr's tail)."""
        rc, out = self.finish(timeout_s)
        assert rc == 0, f"exit {rc}:\n{out}\n{self.stderr_path.read_text()[-3000:]}"
        return out

    def workers(self) -> list[int]:
        """The controller's child processes (LocalCluster starts them in sessions of their own,
        so not its process group: its children)."""
        return children(self.proc.pid)


class StandaloneWorkers:
    """`num` `mpmd worker --shared` processes (plain `mpmd worker` ones if not `shared`) under
    `base` (token file, root, worker_<i>.log), reached as the cluster manager reaches them
    (the cluster token) or as a job does (its credential). disk_cache=False starts them
    without JAX's compilation cache on disk, so a miss of their own compile cache really
    compiles; `cpus[i]` pins worker i; `python` runs them on another venv's Python; `hosts` (a
    tests/support/netns.Hosts) starts worker i inside host `on[i]`, listening on its address;
    `tls`: a directory of certificates (runtime/wire/tls.py) they serve mutual TLS with.
    `env_of[i]` is added to worker i's environment (e.g. runtime/worker/failpoints.py's
    MPMD_FAILPOINTS); with `processes_per_slice` k > 1, workers k*j .. k*j+k-1 are gang j's
    processes (`--coordinator` on process 0's address, `--num-processes k --process-id`).
    A context manager: on exit a Shutdown with the cluster token stops them (killed if they
    linger; inside hosts, which this process cannot reach, killed at once, by pid)."""

    def __init__(
        self,
        base: Path,
        num: int,
        shared: bool = True,
        disk_cache: bool = True,
        cpus=None,
        lease_s: float = 30.0,
        python: str | None = None,
        hosts=None,
        on=None,
        tls: str | None = None,
        env_of=None,
        processes_per_slice: int = 1,
    ):
        import secrets

        from mpmd.runtime.launchers.workers import free_port
        from mpmd.runtime.wire.tls import load

        self.token = secrets.token_hex(16)
        self.root = base / "root"
        self.root.mkdir()
        token_file = base / "token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
        if not disk_cache:
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
        if python:  # another venv's: its XLA may not know this process's XLA_FLAGS
            env.pop("XLA_FLAGS", None)
        self.tls = load(tls) if tls else None  # the certificates they serve with (--tls DIR)
        self.logs = [base / f"worker_{i}.log" for i in range(num)]
        self.procs = []
        self.hosts = hosts
        host_of = lambda i: hosts.addresses[on[i]] if hosts is not None else "127.0.0.1"
        gang = []
        for i, log in enumerate(self.logs):
            pin = ["--cpus", str(cpus[i])] if cpus else []
            listen = f"{host_of(i)}:0"
            start = functools.partial(hosts.popen, on[i]) if hosts is not None else subprocess.Popen
            if processes_per_slice > 1:
                j = i % processes_per_slice
                if j == 0:  # a free port here is free in a namespace of its own too
                    coordinator = f"{host_of(i)}:{free_port('127.0.0.1')}"
                gang = [
                    "--coordinator",
                    coordinator,
                    "--num-processes",
                    str(processes_per_slice),
                    "--process-id",
                    str(j),
                ]
            with open(log, "w") as stderr:
                self.procs.append(
                    start(
                        [
                            python or sys.executable,
                            "-m",
                            "mpmd.recipes.cli",
                            "worker",
                            *(["--shared"] if shared else []),
                            "--listen",
                            listen,
                            "--token-file",
                            str(token_file),
                            "--root",
                            str(self.root),
                            "--lease-s",
                            str(lease_s),
                            *pin,
                            *(["--tls", str(tls)] if tls else []),
                            *gang,
                        ],
                        cwd=ROOT,
                        env={**env, **(env_of or {}).get(i, {})},
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        text=True,
                    )
                )
        self.addresses = []
        for p in self.procs:
            line = p.stdout.readline()
            if not line.startswith("MPMD_WORKER_READY"):
                self.close()
                raise RuntimeError(f"a worker did not start: {line!r}; see {self.logs}")
            self.addresses.append(line.split()[1])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def client(self, i: int, credential: str | None = None):
        import collections
        from mpmd.runtime.control.client import WorkerClient

        return WorkerClient(self.addresses[i], credential or self.token, collections.Counter(), tls=self.tls)

    def admin(self, i: int, method: str, header=None) -> dict:
        """The reply header of the admin RPC `method` to worker i."""
        c = self.client(i)
        try:
            return c.call(method, header)[0]
        finally:
            c.close()

    def open(self, job: str, lease_s: float = 30.0) -> None:
        """Open job's session on every worker, its root <root>/<job>."""
        for i in range(len(self.addresses)):
            self.admin(i, "OpenSession", {"job": job, "root": str(self.root / job), "lease_s": lease_s})

    def credential(self, job: str) -> str:
        from mpmd.runtime.wire.credentials import job_credential

        return job_credential(self.token, job)

    def job(self, name: str):
        """Job `name`'s control plane over every worker (its sessions opened as the manager
        would), not started yet."""
        import mpmd

        self.open(name)
        return mpmd.StaticCluster(self.addresses, token=self.credential(name))

    def logged(self, i: int, text: str, timeout_s: float = 5.0) -> bool:
        """Whether worker i's log holds `text` (within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.logs[i].read_text():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        from mpmd.runtime.control.client import WorkerError

        for i, p in enumerate(self.procs):
            if self.hosts is not None:  # out of this process's reach
                if p.poll() is None:
                    p.kill()  # SIGKILL, which a stopped process takes too
            elif p.poll() is None and i < len(self.addresses):
                try:
                    self.admin(i, "Shutdown")
                except WorkerError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def sigkill_at_marker(code: str, args, marker: Path, timeout_s: float = 120.0) -> None:
    """Runs `python -c code *args`, waits until it creates `marker` (the script writes it at
    the point to be killed, then sleeps), and SIGKILLs it there."""
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)])
    try:
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the script never reached its marker"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
