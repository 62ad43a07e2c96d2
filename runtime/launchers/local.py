"""LocalCluster: the controller starts one worker process per slice on this machine (or a
gang of `processes_per_slice` processes per slice, runtime/worker/gang.py).

LocalLauncher starts and stops the processes; LocalCluster is the control plane over it.

The embedded default of every recipe. Each worker gets the cluster's random token on its
stdin (never on the command line, where `ps` would show it) and keeps that pipe open, so a
worker notices within moments when its controller is gone, however it died. Workers are
pinned round-robin to the machine's cores with XLA's intra-op threads off, so N workers on
N cores do not fight.

Devices. A worker owns `devices_per_worker` devices, its slice's mesh. With GPUs (found by
`visible_gpus`, or given as `gpus=`), worker i gets GPUs i*D .. i*D+D-1 as its
CUDA_VISIBLE_DEVICES, so no two workers share a GPU and a replacement gets its slot's GPUs;
on CPU it gets D host devices (XLA's --xla_force_host_platform_device_count, runtime/worker/main.py).

Logs. With a `log_dir`, a worker's stderr (all its logging, Orbax's and JAX's included, and
anything else it prints there) goes to <log_dir>/worker_<slot>.log, and each of its records at
`log_level` or above comes back as one line on its stdout (`mpmd worker --relay-level`), which
is logged here through the logger `mpmd.workers` as "worker <slot> WARNING <message> (see
<log file>)": with no logging set up, Python prints warnings and errors on stderr.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from mpmd.runtime.control.spares import check_count
from mpmd.runtime.control.client import ControlPlane
from mpmd.runtime.control.rpc import new_token
from mpmd.runtime.wire.tls import Tls, cluster_tls, to_line
from mpmd.runtime.control.cluster import ReplaceUnsupported
from mpmd.runtime.launchers.workers import (
    START_TIMEOUT_S,
    check_gpus,
    check_max_workers,
    check_processes_per_slice,
    check_worker_args,
    default_compilation_cache,
    free_port,
    num_workers_for,
    visible_gpus,
    log_relayed,
    worker_command,
    worker_env,
    worker_log_file,
    worker_root,
)
from mpmd.runtime.worker.main import LOG_LEVELS, READY, RELAY, cores_for

log = logging.getLogger("mpmd.workers")


class LocalLauncher:
    """Starts worker processes on this machine (`python -m mpmd.runtime.worker.main`), one per slot,
    each given `token` on its stdin. See LocalCluster for the arguments."""

    readmits = False  # a lost worker is stopped (or its lease given back), never taken back

    def __init__(
        self,
        token: str,
        *,
        num_workers: int | None = None,
        devices_per_worker: int = 1,
        threads_per_worker: int = 1,
        pin: bool = True,
        host: str = "127.0.0.1",
        compilation_cache_dir: str = "",
        log_dir: str | None = None,
        root: str | None = None,
        gpus: list | None = None,
        log_level: str = "warning",
        max_workers: int | None = None,
        processes_per_slice: int = 1,
        start_timeout_s: float = START_TIMEOUT_S,
        tls: Tls | None = None,
    ):
        check_worker_args(num_workers, devices_per_worker, threads_per_worker)
        self.processes_per_slice = check_processes_per_slice(processes_per_slice)
        if (
            not isinstance(start_timeout_s, (int, float))
            or isinstance(start_timeout_s, bool)
            or not start_timeout_s > 0
        ):
            raise ValueError(f"start_timeout_s must be a positive number of seconds, got {start_timeout_s!r}")
        self.start_timeout_s = float(start_timeout_s)
        self.max_workers = check_max_workers(max_workers)
        self.started = 0  # processes started so far, replacements included
        if log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
        self.log_level = log_level
        self.gpus = visible_gpus() if gpus is None else check_gpus(gpus)
        self.cpu_only = gpus is not None and not self.gpus  # gpus=[]: CPU even where GPUs are
        self.log_dir = log_dir
        self._token = token
        self.tls = tls  # given to each worker: on its stdin, or as its directory
        self.root = root  # the cluster's root=; the workers' is fixed at spawn
        self._running_root: str | None = None
        self.num_workers = num_workers
        self.devices_per_worker = devices_per_worker
        self.threads_per_worker = threads_per_worker
        self.pin = pin
        self.host = host
        self.compilation_cache_dir = compilation_cache_dir
        # Per slot: its address ("host:port"), or one per process of its gang (a tuple).
        self.addresses: list[str | tuple[str, ...]] = []
        self.gangs: list[list[subprocess.Popen]] = []  # per slot: its processes, process 0 first
        self._readers: list[threading.Thread] = []  # one per process started: its stdout
        if num_workers is not None:
            self._check_gpus(num_workers)

    @property
    def procs(self) -> list[subprocess.Popen]:
        """Every process, slot by slot (slot s's process j at s * processes_per_slice + j)."""
        return [p for gang in self.gangs for p in gang]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self, num_slices: int, root: str | None = None) -> list[str]:
        n = num_workers_for(self.num_workers, num_slices, "LocalCluster")
        root = worker_root(self.root, root, self._running_root if self.gangs else None, "LocalCluster")
        if self.gangs:  # already running: the control plane reuses them from a clean state
            return list(self.addresses)
        if self.max_workers is not None and n * self.processes_per_slice > self.max_workers:
            raise ValueError(
                f"{n * self.processes_per_slice} worker process(es) needed for {num_slices} slice(s) "
                f"of {self.processes_per_slice} process(es), but LocalCluster has "
                f"max_workers={self.max_workers}"
            )
        self._check_gpus(n)
        self._running_root = root
        try:
            # Every slot's processes first, then their READY lines: they start side by side.
            launched = [self._launch(i) for i in range(n)]
            self.addresses = [self._ready(i, started) for i, started in enumerate(launched)]
        except BaseException:
            self.stop()
            raise
        return list(self.addresses)

    def replace(self, slot: int, wait_s: float | None = None) -> str | tuple[str, ...]:
        """Make sure every process of the slot's old gang is gone (SIGKILL by its pid: it may
        be hung or stopped, and a gang is lost as a whole), then start a new gang in its
        place; ReplaceUnsupported once max_workers processes were started (raise max_workers
        to let one start again)."""
        for old in self.gangs[slot]:
            if old.poll() is None:
                old.kill()
            old.wait()
        if self.max_workers is not None and self.started + self.processes_per_slice > self.max_workers:
            raise ReplaceUnsupported(
                f"LocalCluster started max_workers={self.max_workers} worker process(es) "
                f"already; none may replace slot {slot}'s"
            )
        self.addresses[slot] = address = self._spawn(slot)
        return address

    def _check_gpus(self, num_workers: int) -> None:
        need = num_workers * self.processes_per_slice * self.devices_per_worker
        if self.gpus and need > len(self.gpus):
            raise ValueError(
                f"{num_workers} worker(s) x devices_per_worker={self.devices_per_worker} need {need} "
                f"GPUs, and {len(self.gpus)} are at hand ({','.join(self.gpus)}): two workers never "
                f"share a GPU; use fewer devices per worker, or gpus=[] to run on CPU"
            )

    def _spawn(self, slot: int) -> str | tuple[str, ...]:
        """Start slot `slot`'s process, or its gang of processes_per_slice processes sharing a
        coordinator on a port picked here; its address once every process reported ready
        (a gang reports ready once all its processes joined). A gang that does not form within
        start_timeout_s is stopped whole and named, with the processes that never got ready."""
        return self._ready(slot, self._launch(slot))

    def _launch(self, slot: int) -> list:
        """Start slot `slot`'s process or gang (see _spawn) without waiting for it: for each
        process (process, its ready event, its READY line once read)."""
        k = self.processes_per_slice
        gang_args = (
            []
            if k == 1
            else [
                "--coordinator",
                f"{self.host}:{free_port(self.host)}",
                "--num-processes",
                str(k),
                "--gang-timeout-s",
                str(self.start_timeout_s),
            ]
        )
        started = [
            self._start_process(slot, j, gang_args + (["--process-id", str(j)] if k > 1 else [])) for j in range(k)
        ]
        procs = [p for p, _, _ in started]
        if slot < len(self.gangs):
            self.gangs[slot] = procs
        else:
            self.gangs.append(procs)
        return started

    def _ready(self, slot: int, started: list) -> str | tuple[str, ...]:
        """The address of slot `slot`'s process or gang launched as `started`, once ready."""
        k = self.processes_per_slice
        procs = [p for p, _, _ in started]
        deadline = time.monotonic() + self.start_timeout_s
        for _, ready, _ in started:
            ready.wait(max(0.0, deadline - time.monotonic()))
        missing = [
            (j, p, "exited before it was ready" if p.poll() is not None else "not ready")
            for j, (p, _, lines) in enumerate(started)
            if not lines
        ]
        if missing:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
            where = f"; see {self._log_file(slot, missing[0][0])}" if self.log_dir is not None else ""
            if k == 1:
                _, p, why = missing[0]
                raise RuntimeError(
                    f"worker {slot} (pid {p.pid}) failed to start within start_timeout_s="
                    f"{self.start_timeout_s:g} s: {why}{where}"
                )
            raise RuntimeError(
                f"slice {slot}'s gang of {k} processes did not form within start_timeout_s="
                f"{self.start_timeout_s:g} s: "
                + ", ".join(f"process {j} (pid {p.pid}) {why}" for j, p, why in missing)
                + f" (processes of a gang wait for each other){where}"
            )
        addresses = tuple(lines[0].split()[1] for _, _, lines in started)
        return addresses[0] if k == 1 else addresses

    def _start_process(self, slot: int, j: int, extra: list[str]):
        """Start process j of slot `slot`; (process, its ready event, its READY line once read)."""
        index = slot * self.processes_per_slice + j  # the process's place among all, for cores and GPUs
        relayed = self.log_dir is not None  # a log file to fill, and the console's share relayed
        cmd = (
            worker_command(
                f"{self.host}:0",
                self._running_root,
                self.devices_per_worker,
                token_stdin=True,
                cpus=cores_for(index, self.threads_per_worker) if self.pin else None,
                log_level=("debug" if self.log_level == "debug" else "info") if relayed else None,
                relay_level=self.log_level if relayed else None,
                tls=(self.tls.directory or "-") if self.tls else None,
            )
            + extra
        )
        env = worker_env(self.compilation_cache_dir)
        if self.gpus:  # the slot's own GPUs: a replacement gets the ones it replaces
            d = self.devices_per_worker
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[index * d : (index + 1) * d])
        elif self.cpu_only:
            env["JAX_PLATFORMS"] = "cpu"
        # A session of its own: a Ctrl-C at the terminal reaches the controller only, which
        # finishes its step, checkpoints and closes the cluster; the workers follow it.
        stderr = None
        if self.log_dir is not None:  # appended to: a replacement continues its slot's log
            os.makedirs(self.log_dir, exist_ok=True)
            stderr = open(self._log_file(slot, j), "a")
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
        finally:
            if stderr is not None:
                stderr.close()  # the child has its own copy
        self.started += 1
        proc.stdin.write(self._token + "\n")
        if self.tls and not self.tls.directory:
            proc.stdin.write(to_line(self.tls) + "\n")
        proc.stdin.flush()
        # Read stdout to its end, so a chatty worker never blocks on a full pipe: first its
        # READY line, then the records it relays.
        ready = threading.Event()
        lines: list[str] = []
        reader = threading.Thread(
            target=self._read_stdout,
            args=(proc, slot, ready, lines),
            daemon=True,
            name=f"mpmd-worker-{slot}.{j}-stdout",
        )
        reader.start()
        self._readers.append(reader)
        return proc, ready, lines

    def _log_file(self, slot: int, process: int = 0) -> str:
        return worker_log_file(self.log_dir, slot, process, self.processes_per_slice)

    def _read_stdout(self, proc: subprocess.Popen, slot: int, ready: threading.Event, lines: list) -> None:
        """Until the worker's stdout ends: its READY line into `lines` (then `ready` is set; also
        at the end without one), every relayed record logged as one line."""
        for line in proc.stdout:
            if not ready.is_set() and line.startswith(READY):
                lines.append(line)
                ready.set()
            elif line.startswith(RELAY + " ") and self.log_dir is not None:
                levelno, _, text = line[len(RELAY) + 1 :].rstrip("\n").partition(" ")
                log_relayed(slot, int(levelno) if levelno.isdigit() else logging.WARNING, text, self._log_file(slot))
        ready.set()

    def serves(self, slot: int, slice_index: int) -> None:
        """Pin slot `slot`'s processes (a hot spare promoted) to the cores of slice
        `slice_index`'s: as many as any worker's, so it computes alike bit for bit, and
        not shared with another slice's (a spare's own cores may be)."""
        if not self.pin:
            return
        for j, proc in enumerate(self.gangs[slot]):
            cores = cores_for(slice_index * self.processes_per_slice + j, self.threads_per_worker)
            try:
                for task in os.listdir(f"/proc/{proc.pid}/task"):  # every thread of it
                    os.sched_setaffinity(int(task), cores)
            except (FileNotFoundError, ProcessLookupError):
                pass  # gone: its loss is found as any other

    def stop(self) -> None:
        procs, self.gangs = self.procs, []
        deadline = time.monotonic() + 5.0
        for p in procs:
            try:
                p.stdin.close()  # the worker also exits on end-of-file
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # by its own pid, never by name
                p.wait()
        # Every exited worker's stdout has ended: report what it relayed before the end.
        readers, self._readers = self._readers, []
        for r in readers:
            r.join(timeout=max(0.1, deadline - time.monotonic()))


class LocalCluster(ControlPlane):
    """One worker process per slice on this machine (a ControlPlane over a LocalLauncher).

    num_workers: processes to start (None: one per slice); more than num_slices leaves idle
        spares, but a lost slice is replaced by a new process in its own slot anyway.
    devices_per_worker, threads_per_worker: JAX devices (the size of a slice's mesh) and XLA
        threads per worker; each worker is pinned to threads_per_worker cores, round-robin,
        when `pin`.
    gpus: None finds the GPUs (visible_gpus; none: the workers run on CPU); a list of GPU
        ids uses those; [] runs on CPU. Each worker gets devices_per_worker GPUs of its own.
    host: where workers listen (loopback by default).
    failure_timeout_s: a slice silent this long is declared lost.
    compilation_cache_dir: JAX's persistent compilation cache for the workers; None picks
        default_compilation_cache(), "" switches it off.
    root: the only directory tree the workers may save checkpoints to and restore from
        (None: the run_dir the Trainer starts the cluster with, else this process's cwd).
        Fixed when the workers start; see worker_root.
    step_timeout_s: a step without progress this long is aborted (see ControlPlane).
    log_dir: workers' stderr (their logs and tracebacks) goes to <log_dir>/worker_<slot>.log;
        None: to this process's stderr.
    log_level: with a log_dir, the workers' records at this level and up ("debug", "info",
        "warning", "error") are also logged here, one line each, by the logger mpmd.workers;
        at "debug" the workers log debug records too.
    processes_per_slice: k > 1 makes each slice a gang of k processes (standing in for k
        hosts), each with devices_per_worker devices, that together own the slice's mesh of
        k x devices_per_worker devices (runtime/worker/gang.py); a lost process is a lost slice, and
        its whole gang is replaced.
    start_timeout_s: how long a worker, or every process of a gang, may take to get ready.
    transport: the data plane between slices, auto | socket | shm (see ControlPlane); auto
        moves every transfer through shared memory here, except a gang's.
    tls: mutual TLS on every control channel (runtime/wire/tls.py). True: an authority made
        for this cluster alone, in memory, its certificates handed to each worker on its
        stdin; a directory: the certificates there (ca.pem, cert.pem, key.pem); False: in
        the clear (loopback only, where nobody but root can read the wire).
    hot_spares: processes started beyond the slices' and kept warm, their programs compiled
        for any slice (runtime/control/spares.py): a lost slice is taken over by one (no
        spawn, no compile in its first step), and a new one starts in the background.
    max_workers: the most worker processes started over the cluster's life, replacements
        and hot spares included (None: no limit). Once spent, a lost worker is not replaced (replace raises
        ReplaceUnsupported): a run then shrinks or stops (Trainer on_loss). Raising
        `max_workers` later is capacity coming back: the next replacement (or a shrunk run's
        grow back) may start a process again.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        devices_per_worker: int = 1,
        threads_per_worker: int = 1,
        pin: bool = True,
        host: str = "127.0.0.1",
        failure_timeout_s: float = 5.0,
        compilation_cache_dir: str | None = None,
        step_timeout_s: float | None = None,
        log_dir: str | None = None,
        root: str | None = None,
        gpus: list | None = None,
        log_level: str = "warning",
        max_workers: int | None = None,
        processes_per_slice: int = 1,
        start_timeout_s: float = START_TIMEOUT_S,
        transport: str = "auto",
        tls: bool | str = True,
        hot_spares: int = 0,
    ):
        token = new_token()
        tls = cluster_tls(tls)
        check_worker_args(num_workers, devices_per_worker, threads_per_worker)
        if num_workers is not None:  # the launcher starts the slices' and the spares'
            num_workers += check_count(hot_spares)
        # Workers keep compiled programs in JAX's persistent cache: a replacement worker, or
        # the next run of the same recipe, loads them instead of compiling again (compiling
        # was ~3 of the ~4 s a recovery took).
        cache = compilation_cache_dir if compilation_cache_dir is not None else default_compilation_cache()
        launcher = LocalLauncher(
            token,
            num_workers=num_workers,
            devices_per_worker=devices_per_worker,
            threads_per_worker=threads_per_worker,
            pin=pin,
            host=host,
            compilation_cache_dir=cache,
            log_dir=log_dir,
            root=root,
            gpus=gpus,
            log_level=log_level,
            max_workers=max_workers,
            processes_per_slice=processes_per_slice,
            start_timeout_s=start_timeout_s,
            tls=tls,
        )
        super().__init__(
            launcher,
            token,
            failure_timeout_s=failure_timeout_s,
            step_timeout_s=step_timeout_s,
            transport=transport,
            tls=tls,
            hot_spares=hot_spares,
        )

    @property
    def pids(self) -> list[int]:
        return self.launcher.pids

    @property
    def procs(self) -> list[subprocess.Popen]:
        return self.launcher.procs

    @property
    def devices_per_worker(self) -> int:
        return self.launcher.devices_per_worker

    @property
    def processes_per_slice(self) -> int:
        return self.launcher.processes_per_slice

    @property
    def devices_per_slice(self) -> int:
        """The devices of one slice's mesh: every process of its gang's."""
        return self.launcher.devices_per_worker * self.launcher.processes_per_slice

    def gang_pids(self, slot: int) -> list[int]:
        """The pids of slot `slot`'s processes (its gang), process 0 first."""
        return [p.pid for p in self.launcher.gangs[slot]]

    def slice_pids(self, slice_index: int) -> list[int]:
        """The pids of the process(es) serving slice `slice_index` now, process 0 first."""
        return self.gang_pids(self.slot_of(slice_index))

    @property
    def max_workers(self) -> int | None:
        return self.launcher.max_workers

    @max_workers.setter
    def max_workers(self, value: int | None) -> None:
        self.launcher.max_workers = check_max_workers(value)
