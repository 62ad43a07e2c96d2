"""The shared cluster's worker processes (`mpmd worker --shared`), owned by its manager
(runtime/manager/core.py): start N, tell whether one is alive, restart one in its slot, stop all.

Workers outlive the manager: each reads the cluster token from a 0600 file (not from a pipe
to the manager, whose end would stop it, as LocalLauncher's workers do on purpose), runs in a
process session of its own, and writes its READY line and its log to files under the
cluster's directory. So a manager that dies, or is started again from the cluster file
(`rejoin`), finds its workers still serving their jobs. Processes are stopped by their pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

from mpmd.runtime.launchers.workers import START_TIMEOUT_S, process_alive, worker_command, worker_env
from mpmd.runtime.worker.main import READY, cores_for


@dataclass
class PoolWorker:
    slot: int
    address: str
    pid: int
    proc: subprocess.Popen | None = None  # None: started by an earlier manager (rejoined), or a Ray actor
    local: bool = True  # its pid is a process of this machine

    def alive(self) -> bool:
        """False once it is known to be gone; a worker on another machine counts as alive
        (the manager's health probe decides for it)."""
        if self.proc is not None:
            return self.proc.poll() is None
        return process_alive(self.pid) if self.local else True


class WorkerPool:
    """directory: the cluster's directory (token file, logs/). token_file: the cluster
    token's 0600 file. root: the workers' --root (every job's run_dir must lie below it).
    tls: the cluster's certificates (runtime/wire/tls.py; each worker gets --tls with their
    directory), or None: in the clear."""

    backend = "local"

    def __init__(
        self,
        *,
        directory: str,
        token_file: str,
        root: str,
        devices_per_worker: int = 1,
        host: str = "127.0.0.1",
        compile_cache_mb: int | None = None,
        compilation_cache_dir: str = "",
        tls=None,
    ):
        self.directory, self.token_file, self.root = directory, token_file, root
        self.tls = tls  # the cluster's certificates (runtime/wire/tls.py), read from their directory
        self.devices_per_worker, self.host = devices_per_worker, host
        self.compile_cache_mb = compile_cache_mb
        self.compilation_cache_dir = compilation_cache_dir
        self.workers: list[PoolWorker] = []
        self.started = 0  # processes started over the pool's life
        os.makedirs(os.path.join(directory, "logs"), exist_ok=True)

    def start(self, num_workers: int) -> None:
        """Start `num_workers` workers at once and wait for all; on failure stop them, raise."""
        procs = [self._spawn(slot) for slot in range(num_workers)]
        try:
            self.workers = [PoolWorker(slot, self._wait_ready(slot, p), p.pid, p) for slot, p in enumerate(procs)]
        except BaseException:
            for p in procs:
                kill_process(p.pid, p)
            raise

    def rejoin(self, entries: list[dict]) -> None:
        """Take over the workers an earlier manager started ({address, pid} per slot)."""
        self.workers = [PoolWorker(slot, str(e["address"]), int(e["pid"])) for slot, e in enumerate(entries)]

    def restart(self, slot: int) -> PoolWorker:
        """Make sure the slot's process is gone (SIGKILL by pid: it may be hung), start a new one."""
        old = self.workers[slot]
        kill_process(old.pid, old.proc)
        p = self._spawn(slot)
        try:
            self.workers[slot] = PoolWorker(slot, self._wait_ready(slot, p), p.pid, p)
        except BaseException:
            kill_process(p.pid, p)
            raise
        return self.workers[slot]

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        """SIGTERM every worker, SIGKILL those still there after timeout_s; the pids stopped."""
        for w in self.workers:
            if w.alive():
                try:
                    os.kill(w.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        while any(w.alive() for w in self.workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        for w in self.workers:
            kill_process(w.pid, w.proc)
        return [w.pid for w in self.workers]

    def log_file(self, slot: int) -> str:
        return os.path.join(self.directory, "logs", f"worker_{slot}.log")

    def _ready_file(self, slot: int) -> str:
        return os.path.join(self.directory, "logs", f"worker_{slot}.out")

    def _spawn(self, slot: int) -> subprocess.Popen:
        cmd = worker_command(
            f"{self.host}:0",
            self.root,
            self.devices_per_worker,
            token_file=self.token_file,
            shared=True,
            cpus=cores_for(slot, 1),
            log_level="info",
            compile_cache_mb=self.compile_cache_mb,
            tls=self.tls.directory if self.tls else None,
        )
        self.started += 1
        with open(self._ready_file(slot), "w") as out, open(self.log_file(slot), "a") as err:
            return subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=worker_env(self.compilation_cache_dir),
                start_new_session=True,
            )

    def _wait_ready(self, slot: int, proc: subprocess.Popen) -> str:
        """The address the worker prints on its READY line."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with open(self._ready_file(slot)) as f:
                for line in f:
                    if line.startswith(READY):
                        return line.split()[1]
            if proc.poll() is not None:
                raise RuntimeError(
                    f"worker {slot} (pid {proc.pid}) exited with {proc.returncode} before it "
                    f"was ready; see {self.log_file(slot)}"
                )
            time.sleep(0.05)
        raise RuntimeError(
            f"worker {slot} (pid {proc.pid}) did not report ready within {START_TIMEOUT_S:g} s; "
            f"see {self.log_file(slot)}"
        )


def kill_process(pid: int, proc: subprocess.Popen | None = None) -> None:
    """SIGKILL `pid` if it still runs, and reap it when it is our child (else wait, up to 5 s,
    until it is gone)."""
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    elif process_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5.0
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)


class RayWorkerPool:
    """The same pool, its workers Ray actors (`mpmd cluster up --backend ray`), started,
    restarted and stopped by a RayLauncher (runtime/launchers/ray.py) that the manager's process
    drives. The actors belong to the manager's Ray driver: they end with it, so a Ray-backed
    cluster cannot be rejoined after its manager died (make it again)."""

    backend = "ray"

    def __init__(
        self,
        *,
        directory: str,
        token: str,
        root: str,
        devices_per_worker: int = 1,
        ray_address: str | None = None,
        compile_cache_mb: float | None = None,
        lease_s: float = 10.0,
        tls=None,
    ):
        from mpmd.runtime.worker.compile_cache import DEFAULT_LIMIT_MB
        from mpmd.runtime.launchers.ray import RayLauncher

        self.directory, self.root, self.devices_per_worker = directory, root, devices_per_worker
        shared = {
            "lease_s": lease_s,
            "compile_cache_mb": DEFAULT_LIMIT_MB if compile_cache_mb is None else compile_cache_mb,
        }
        self.tls = tls
        self.launcher = RayLauncher(
            token, address=ray_address, devices_per_worker=devices_per_worker, root=root, shared=shared, tls=tls
        )
        self.workers: list[PoolWorker] = []
        self.started = 0

    def start(self, num_workers: int) -> None:
        addresses = self.launcher.start(num_workers, root=self.root)
        self.started += num_workers
        self.workers = [self._worker(slot, a) for slot, a in enumerate(addresses)]

    def restart(self, slot: int) -> PoolWorker:
        address = self.launcher.replace(slot)
        self.started += 1
        self.workers[slot] = self._worker(slot, address)
        return self.workers[slot]

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        pids = [w.pid for w in self.workers]
        self.launcher.stop()
        return pids

    def _worker(self, slot: int, address: str) -> PoolWorker:
        return PoolWorker(
            slot,
            address,
            self.launcher.pids[slot],
            local=address.rpartition(":")[0].strip("[]") in ("127.0.0.1", "::1", "localhost"),
        )
