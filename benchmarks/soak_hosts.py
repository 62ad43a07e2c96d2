"""The soak's bed across hosts (`benchmarks/soak.py --hosts`): network namespaces on this
machine (tests/support/netns.py), the controller on host 0, a static worker on each of hosts
1 to 4, mutual TLS on every control channel, and the faults only hosts have.

Workers are started as an operator would: `mpmd worker --listen <host>:7000 --persist
--tls DIR`, one per host, each on a fixed address, so a worker started again on its host is
the same address to the controller. Hosts 1 and 2 serve the two slices, 3 and 4 are spares
(`cluster.spares`); with no spare left a lost worker is taken back once it answers again
(StaticLauncher.readmits). `--persist` makes a worker whose controller went away (a
finished, killed or superseded one) drop its state and wait for the next, so one set of
workers serves the uninterrupted run, the faulted run and every controller restart.

Faults (a worker is picked among those using CPU, i.e. serving a slice):
  worker-kill           SIGKILL it; the operator starts it again on its host 3 s later
  worker-term           SIGTERM it (a preempted host); started again 3 s later
  worker-stop           SIGSTOP it, SIGCONT once it has been replaced (a zombie after a long
                        pause: fenced, it resets once its lease lapses)
  partition-worker      cut its host's link; restore it once it has been replaced (a
                        zombie across a healed partition)
  partition-controller  cut the controller's host off from every worker for
                        failure_timeout_s + 2 s, then restore it
  controller-kill, controller-term, corrupt   as in soak.py
A new fault waits until the last one's repair (restart, SIGCONT, restored link) is done.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.soak import Disk, controller_fault, start
from mpmd.runtime.wire import tls
from tests.support import netns

PORT = 7000
FAILURE_TIMEOUT_S = 2.0
LEASE_S = 6.0  # a worker whose controller is gone resets after this long (--persist)
REPAIR_S = FAILURE_TIMEOUT_S + 4.0  # a fault's repair comes after the loss was declared and acted on
SLICES, SPARES = 2, 2


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


class HostBed:
    kinds = (
        "worker-kill",
        "worker-term",
        "worker-stop",
        "partition-worker",
        "partition-controller",
        "controller-kill",
        "controller-term",
        "corrupt",
    )

    def __init__(self, work: Path, disk: Disk):
        self.work, self.disk = work, disk
        self.hosts = netns.Hosts(1 + SLICES + SPARES)
        try:
            self.token_file = work / "token"
            self.token_file.write_text(f"{random.SystemRandom().getrandbits(128):032x}\n")
            self.token_file.chmod(0o600)
            self.tls = tls.make(work / "tls").directory
            self.root = work
            self.logs = work / "worker_logs"
            self.logs.mkdir(exist_ok=True)
            self.procs: dict[int, subprocess.Popen] = {}
            for h in range(1, 1 + SLICES + SPARES):
                self._start_worker(h)
            self.repairs: list[tuple[float, str, object]] = []  # (when, what, how)
        except BaseException:
            self.close()
            raise

    def address(self, h: int) -> str:
        return f"{self.hosts.addresses[h]}:{PORT}"

    def _start_worker(self, h: int) -> None:
        with open(self.logs / f"host_{h}.log", "a") as log:
            p = self.hosts.popen(
                h,
                [
                    sys.executable,
                    "-m",
                    "mpmd.recipes.cli",
                    "worker",
                    "--listen",
                    self.address(h),
                    "--token-file",
                    str(self.token_file),
                    "--tls",
                    self.tls,
                    "--root",
                    str(self.root),
                    "--persist",
                    "--lease-s",
                    str(LEASE_S),
                ],
                cwd=Path(__file__).resolve().parents[1],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        line = p.stdout.readline()
        if not line.startswith("MPMD_WORKER_READY"):
            raise RuntimeError(f"the worker on host {h} did not start: {line!r}; see {self.logs}")
        self.procs[h] = p

    def start(self, steps: int, run_dir: Path, log: Path) -> subprocess.Popen:
        quote = lambda hs: "[" + ",".join(f'"{self.address(h)}"' for h in hs) + "]"
        extra = [
            "cluster.backend=static",
            f"cluster.addresses={quote(range(1, 1 + SLICES))}",
            f"cluster.spares={quote(range(1 + SLICES, 1 + SLICES + SPARES))}",
            f"cluster.token_file={self.token_file}",
            f"cluster.tls={self.tls}",
            f"cluster.failure_timeout_s={FAILURE_TIMEOUT_S}",
            "cluster.replace_timeout_s=120",
            "cluster.max_restarts=1000",
        ]
        return start(steps, run_dir, log, extra, prefix=["ip", "netns", "exec", self.hosts.names[0]])

    def busy(self) -> bool:
        return bool(self.repairs)

    def tick(self) -> None:
        now = time.monotonic()
        for due in [r for r in self.repairs if r[0] <= now]:
            self.repairs.remove(due)
            _, what, arg = due
            if what == "restart":
                self.procs[arg].wait()
                self._start_worker(arg)
            elif what == "cont":
                self.procs[arg].send_signal(signal.SIGCONT)
            elif what == "restore":
                self.hosts.restore(arg)
            print(f"    repaired: {what} host {arg}", flush=True)

    def _serving(self, rng) -> int:
        """A host whose worker is computing (a slice's), else any."""
        before = {h: cpu_ticks(p.pid) for h, p in self.procs.items()}
        time.sleep(0.5)
        busy = [h for h, p in self.procs.items() if cpu_ticks(p.pid) - before[h] >= 2]
        return rng.choice(busy or list(self.procs))

    def inject(self, kind: str, proc: subprocess.Popen, run_dir: Path, rng, problems: list) -> tuple[bool, str | None]:
        now = time.monotonic()
        if kind in ("worker-kill", "worker-term"):
            h = self._serving(rng)
            self.procs[h].send_signal(signal.SIGKILL if kind == "worker-kill" else signal.SIGTERM)
            self.repairs.append((now + 3.0, "restart", h))
        elif kind == "worker-stop":
            h = self._serving(rng)
            self.procs[h].send_signal(signal.SIGSTOP)
            self.repairs.append((now + REPAIR_S, "cont", h))
        elif kind == "partition-worker":
            h = self._serving(rng)
            self.hosts.cut(h)
            self.repairs.append((now + REPAIR_S, "restore", h))
        elif kind == "partition-controller":
            self.hosts.cut(0)
            self.repairs.append((now + FAILURE_TIMEOUT_S + 2.0, "restore", 0))
        else:
            # Its workers are not its children: they outlive it by design (--persist).
            return controller_fault(kind, proc, run_dir, [], problems)
        return True, None

    def close(self) -> None:
        for h in range(len(self.hosts.names)):
            self.hosts.restore(h)
        for p in getattr(self, "procs", {}).values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        self.hosts.close()  # stops every worker by pid
        self.disk.close()
