"""A worker's sessions: what one job holds on it, and the table of them.

A plain worker serves one controller: one session, made by its Setup, dropped when the
controller goes. A shared worker (`mpmd worker --shared`) serves several jobs at once, each
in its own session, opened by the cluster manager (OpenSession) for a job id and reached
only with that job's credential (runtime/wire/credentials.py). Everything a job can name lives
in its session, so no name of one job can reach another's state:
- its executor: buffers, programs (looked up in the worker's shared compile cache), plans,
  staged restores, run ids and the abort mark (an Abort stops only this job's runs);
- its transfer server and shared-memory endpoint, keyed by the job's own transfer secret
  (Setup): transfer ids and endpoints of two jobs never meet, an Abort resets only this
  job's transfers, and closing the session unmaps every segment it lent;
- its root: Save and Restore directories must lie below it.
A session not called by its job for `lease_s` is closed by the worker (the job heartbeats
every ~0.5 s); closing aborts its runs and lets go of everything it holds.
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time

import jax

from mpmd.runtime.wire.credentials import check_job_id


class Session:
    """One job's state on this worker. `job` is None for a plain worker's only session."""

    def __init__(self, job: str | None, root: str, lease_s: float):
        self.job, self.root, self.lease_s = job, root, lease_s
        self.executor = None  # mpmd.runtime.worker.executor.Executor, from Setup
        self.transport = None  # its TransferTransport
        self.last_contact = time.monotonic()
        self.closed = False
        self.lock = threading.Lock()  # Setup and close replace the executor and transport
        self.generation = 0  # the newest generation a Setup or Connect admitted it in

    @property
    def name(self) -> str:
        return f"job {self.job}" if self.job is not None else "the controller"

    def touch(self) -> None:
        self.last_contact = time.monotonic()

    def idle_s(self) -> float:
        return time.monotonic() - self.last_contact

    def admit(self, verb: str, generation: int) -> str | None:
        """Why a call of `verb` made in `generation` is refused (one older than this session's:
        its controller was superseded), or None; Setup and Connect move the session to a newer
        generation (runtime/worker/service.py, "Generations")."""
        with self.lock:
            if generation < self.generation:
                return (
                    f"stale generation {generation}: {self.name} admitted this worker in generation "
                    f"{self.generation} (a newer controller or a replacement took over)"
                )
            if verb in ("Setup", "Connect"):
                self.generation = generation
        return None

    def attach(self, executor, transport) -> None:
        """Setup: the new executor and transport replace the old ones (closed)."""
        with self.lock:
            if self.closed:
                transport.close()
                raise ValueError(f"the session of {self.name} was closed")
            old = self.executor, self.transport
            self.executor, self.transport = executor, transport
        _drop(*old)

    def close(self) -> bool:
        """Abort its runs, close its transfer server, let go of its buffers, plans and
        programs. True if it held an executor."""
        with self.lock:
            self.closed = True
            old = self.executor, self.transport
            self.executor = self.transport = None
        _drop(*old)
        return old[0] is not None

    def describe(self) -> dict:
        """{job, root, buffers, bytes, plans, idle_s, lease_s} (an entry of the Sessions RPC)."""
        ex = self.executor
        buffers = dict(ex.buffers) if ex is not None else {}
        return {
            "job": self.job,
            "root": self.root,
            "buffers": len(buffers),
            "bytes": sum(a.nbytes for bundle in buffers.values() for a in bundle),
            "plans": len(ex.plans) if ex is not None else 0,
            "idle_s": round(self.idle_s(), 3),
            "lease_s": self.lease_s,
        }


def _drop(executor, transport) -> None:
    if executor is not None:
        executor.close()
    if transport is not None:
        transport.close()
    if executor is not None:
        # Arrays caught in reference cycles (a traceback's frames) would otherwise hold device
        # memory until some later collection.
        gc.collect()


class SessionTable:
    """The sessions of a shared worker, by job id; `root` is the worker's --root, below which
    every session's root must lie; `default_lease_s` serves an OpenSession that names none."""

    def __init__(self, root: str, default_lease_s: float):
        self.root = os.path.realpath(root)
        self.default_lease_s = default_lease_s
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def get(self, job: str) -> Session | None:
        with self._lock:
            return self._sessions.get(job)

    def open(self, job, root, lease_s=None) -> Session:
        """The session of `job` below `root`, made now or (same root) the one it has, its lease
        set to `lease_s` and renewed. ValueError naming what is wrong: a bad id, a root that
        is not an absolute directory strictly below the worker's root or that overlaps
        another job's, a lease that is not a positive number of seconds."""
        check_job_id(job)
        if not isinstance(root, str) or not os.path.isabs(root):
            raise ValueError(
                f"OpenSession 'root' must be an absolute directory below the worker's root "
                f"{self.root}, got {root!r:.200}"
            )
        real = os.path.realpath(root)
        if real == self.root or os.path.commonpath([real, self.root]) != self.root:
            raise ValueError(
                f"OpenSession 'root' {root!r} (really {real}) is not below the worker's root "
                f"{self.root}: a job's directories must lie inside the worker's"
            )
        lease_s = self.default_lease_s if lease_s is None else lease_s
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s < math.inf:
            raise ValueError(f"OpenSession 'lease_s' must be a positive number of seconds, got {lease_s!r:.50}")
        with self._lock:
            session = self._sessions.get(job)
            if session is not None:
                if session.root != real:
                    raise ValueError(
                        f"job {job} already has a session here with root {session.root}, not "
                        f"{real}: CloseSession it first"
                    )
            else:
                for other in self._sessions.values():
                    if os.path.commonpath([real, other.root]) in (real, other.root):
                        raise ValueError(
                            f"OpenSession 'root' {real} overlaps job {other.job}'s root "
                            f"{other.root}: each job's directories must be its own"
                        )
                session = self._sessions[job] = Session(job, real, float(lease_s))
            session.lease_s = float(lease_s)
            session.touch()
            return session

    def close(self, job: str) -> bool:
        """Close and forget the session of `job`; False if it had none."""
        with self._lock:
            session = self._sessions.pop(job, None)
        if session is None:
            return False
        session.close()
        return True

    def lapsed(self) -> list[tuple[str, float]]:
        """Close every session silent for longer than its lease; [(job, silent s)] closed."""
        with self._lock:
            gone = [(job, s) for job, s in self._sessions.items() if s.idle_s() > s.lease_s]
            for job, _ in gone:
                del self._sessions[job]
        for _, s in gone:
            s.close()
        return [(job, s.idle_s()) for job, s in gone]

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())


def live_bytes(collect: bool = True) -> int:
    """Bytes of every live JAX array in this process (all sessions, the cache's constants).

    collect: garbage-collect first. An aborted run can leave its arrays in a reference cycle
    (an exception's traceback holding its frames), which an idle worker, allocating nothing,
    would otherwise count for as long as it stays idle. A full collection holds the GIL for
    75-130 ms in a worker (benchmarks/bench_live_bytes.py, docs/benchmarks.md), against
    0.1-13 ms for the sum, so the service collects only when no session holds an executor:
    when the figure is read as what an idle worker leaks, not while a job's steps run beside
    the manager's probe (every second)."""
    if collect:
        gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())
