"""The shared cluster's manager: its state and its decisions (the process around it, its gRPC
service and main, is runtime/manager/server.py: `python -m mpmd.runtime.manager.server`, started by
`mpmd cluster up`).

It owns a pool of long-lived `mpmd worker --shared` processes (runtime/manager/worker_pool.py) and
leases them to jobs. A slice is one worker; a job asks for `slices` of them.

Service `mpmd.Manager` (unary, bodies in runtime/wire/format.py's frame format, credentials in the
`mpmd-token` metadata checked before the body is read, as on the workers); each verb's request
and reply are typed records of runtime/wire/verbs.py's MANAGER_VERBS, checked as a worker's are:
  Submit  {name, slices, share, root, lease_s?, devices?} -> {job, credential, position, workers}
                                                                                 submit token
  Wait    {job} -> {position, workers: [address] once leased}                    job credential
  Renew   {job} -> {}                                                            job credential
  Release {job} -> {}                                                            job credential
  Replace {job, slot} -> {address}                                               job credential
  Status  -> {workers, jobs, leases, workers_started}                            submit token
  Down    -> {}                                                                  cluster token
The submit token is what users of the cluster hold (it is in the cluster file); the cluster
token stays with the manager and the workers (a 0600 file in the cluster's directory): a
user who can submit cannot make another job's credential (runtime/wire/credentials.py) nor call a
worker's admin RPCs. A job's credential acts only on that job here.

Leases. Placement is gang allocation in strict FIFO order: the job at the head of the queue
gets all its slices at once or waits, and no job behind it starts first (position 1 = next).
A job that does not share gets workers nobody holds; a sharing job (`share`) gets those no
exclusive job holds, least shared first, so two sharing jobs time-share workers (their steps
interleave there; each job's results are its own). Leasing a worker opens the job's session
there (OpenSession); a job that Releases, or stops calling Wait/Renew for its lease_s (its
controller died), has its sessions closed (CloseSession) and its workers freed. The workers
close a silent job's session on their own too.

Failures. A worker found dead (its pid gone, or no answer to a health probe for
UNREACHABLE_S) is killed by pid and restarted in its slot, with a new address; a job that
lost it calls Replace {slot} and gets the restarted worker, with its session opened there.
The job table is written to <dir>/jobs.json on every change; a manager started again with
--rejoin (same cluster file) takes the workers over, reads the table, and keeps every job
whose sessions the workers still hold (their Sessions reply), so running jobs keep their
leases (a job's credential derives from the cluster token, so it stays valid); a job the
workers no longer know is dropped.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field

from mpmd.runtime.wire import credentials
from mpmd.runtime.wire import verbs
from mpmd.runtime.control.rpc import WorkerClient, WorkerError, call
from mpmd.runtime.worker.service import ADMIN
from mpmd.runtime.manager.worker_pool import WorkerPool

SERVICE = verbs.MANAGER_SERVICE
HEALTH_S = 1.0  # workers are probed (Sessions) this often
UNREACHABLE_S = 10.0  # a live pid that does not answer for this long is restarted
RPC_TIMEOUT_S = 5.0
MAX_LEASE_S = 60.0  # default --max-lease-s: a silent job holds workers at most this long
# A manager started again gives each job it rebuilt this long beyond its lease to renew: the
# job's channel to the manager that died backs off its reconnects (gRPC's backoff grows to
# seconds), and a loaded machine may take long to start the new one.
REJOIN_GRACE_S = 30.0
KEEP_ENDED = 100  # ended jobs kept in the table (and Status), the newest
# Who may call what (the table's caller): "submit" (submit or cluster token), "job" (a job
# credential, on that job only), "admin" (the cluster token).
METHODS = {v.name: v.caller for v in verbs.MANAGER_VERBS.values()}
log = logging.getLogger("mpmd.manager")


class _Submitter:
    """The caller holding the submit token (the cluster token's is mpmd.runtime.worker.service.ADMIN): a
    sentinel no job id can equal."""

    def __repr__(self) -> str:
        return "a submitter"


SUBMIT = _Submitter()


class UnknownJob(LookupError):
    """A job id the manager does not hold (its lease ended, or it never existed)."""


@dataclass
class Job:
    id: str
    name: str
    slices: int
    share: bool
    root: str
    lease_s: float
    state: str = "queued"  # queued | leased | released | expired
    workers: list = field(default_factory=list)  # per slot: the pool slot of its worker
    submitted: float = field(default_factory=time.time)  # wall-clock times, for Status
    leased_at: float | None = None
    ended_at: float | None = None
    last_seen: float = field(default_factory=time.monotonic, repr=False)


class ShuttingDown(RuntimeError):
    """The cluster is going down (`mpmd cluster down`): no job is leased or given a worker."""


def _nested(a: str, b: str) -> bool:
    """Whether resolved directory `a` is `b` or lies inside it, or the other way round."""
    return os.path.commonpath([a, b]) in (a, b)


class Manager:
    def __init__(
        self,
        pool: WorkerPool,
        *,
        cluster_token: str,
        submit_token: str,
        journal: str,
        lease_s: float = 10.0,
        max_lease_s: float = MAX_LEASE_S,
    ):
        self.pool = pool
        self.cluster_token, self._submit_token = cluster_token, submit_token
        self._journal = journal
        self.lease_s, self.max_lease_s = lease_s, max_lease_s
        self.jobs: dict[str, Job] = {}
        self.queue: list[str] = []  # job ids, FIFO
        self.health: dict[int, dict] = {}  # per slot: last Sessions reply, health, since
        self._lock = threading.RLock()
        self._clients: dict[int, WorkerClient] = {}
        self._counts: collections.Counter = collections.Counter()
        self.stopping = threading.Event()

    # -- the table ---------------------------------------------------------------------------
    def submit(self, name: str, slices: int, share: bool, root: str, lease_s: float, devices=None) -> Job:
        if not isinstance(slices, int) or isinstance(slices, bool) or not 1 <= slices <= len(self.pool.workers):
            raise ValueError(
                f"'slices' must be an integer 1..{len(self.pool.workers)} (the cluster's workers), got {slices!r}"
            )
        if not isinstance(root, str) or not os.path.isabs(root):
            raise ValueError(
                f"'root' must be an absolute directory below the cluster root {self.pool.root}, got {root!r:.200}"
            )
        real = os.path.realpath(root)
        if os.path.commonpath([real, self.pool.root]) != self.pool.root:
            raise ValueError(
                f"'root' {root} is not below the cluster root {self.pool.root}: the workers save "
                f"and restore only there; put the run_dir below it"
            )
        if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or not 0 < lease_s <= self.max_lease_s:
            raise ValueError(
                f"'lease_s' must be a number of seconds in (0, {self.max_lease_s:g}] (the cluster's "
                f"--max-lease-s: a silent job holds its workers at most that long), got {lease_s!r}"
            )
        d = self.pool.devices_per_worker
        if devices is not None and devices != [d]:
            raise ValueError(
                f"the job's slices have {devices} device(s) each (cluster.devices_per_worker, "
                f"mesh.*), and this cluster's workers have {d} each: give the job "
                f"cluster.devices_per_worker={d}"
            )
        stem = re.sub(r"[^a-z0-9-]+", "-", str(name).lower()).strip("-")[:48] or "job"
        with self._lock:
            if self.stopping.is_set():
                raise ShuttingDown("the shared cluster is shutting down (mpmd cluster down): no job is taken")
            # Checked here against every live job, on whichever workers it runs, and not only by
            # each worker against the sessions it holds: two jobs on different workers must not
            # read or write each other's checkpoints either (the root is resolved: a symlink
            # into another job's run_dir is that run_dir).
            for other in self.jobs.values():
                if other.state in ("queued", "leased") and _nested(real, other.root):
                    raise ValueError(
                        f"'root' {real} overlaps job {other.id}'s root {other.root} ({other.name!r:.60}): "
                        f"give each job a run_dir of its own, neither inside the other"
                    )
            job = Job(
                id=credentials.check_job_id(f"{stem}-{secrets.token_hex(4)}"),
                name=str(name)[:200],
                slices=slices,
                share=bool(share),
                root=real,
                lease_s=float(lease_s),
            )
            self.jobs[job.id] = job
            self.queue.append(job.id)
            self._place()
            self._save()
            return job

    def position(self, job: Job) -> int:
        """0 once leased; else 1 + the jobs ahead of it in the queue."""
        return 0 if job.state == "leased" else self.queue.index(job.id) + 1

    def seen(self, job_id: str) -> Job:
        """The live job `job_id`, marked as heard from now."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or job.state not in ("queued", "leased"):
                why = f"its lease ended ({job.state})" if job is not None else "no such job on this cluster"
                raise UnknownJob(f"job {job_id}: {why}")
            job.last_seen = time.monotonic()
            return job

    def addresses(self, job: Job) -> list[str]:
        return [self.pool.workers[s].address for s in job.workers]

    def end(self, job: Job, state: str) -> None:
        """Release or expire `job`: close its sessions, free its workers, start who waits."""
        with self._lock:
            if job.state == "queued":
                self.queue.remove(job.id)
            for slot in job.workers:
                self._close_session(slot, job.id)
            job.state, job.ended_at = state, time.time()
            log.info("job %s %s (%s)", job.id, state, job.name)
            ended = [j for j in self.jobs.values() if j.state in ("released", "expired")]
            for old in ended[:-KEEP_ENDED]:  # a long-lived cluster's table stays small
                del self.jobs[old.id]
            self._place()
            self._save()

    def replace(self, job: Job, slot: int) -> str:
        """The worker for slot `slot` of `job`, whose worker it lost: the same pool slot's
        worker, restarted first if it is dead or does not answer, with the job's session."""
        if not isinstance(slot, int) or not 0 <= slot < len(job.workers):
            raise ValueError(f"'slot' must be 0..{len(job.workers) - 1} (the job's slices), got {slot!r}")
        with self._lock:
            if self.stopping.is_set():  # down() stops the workers: none may start after that
                raise ShuttingDown(
                    f"the shared cluster was shut down (mpmd cluster down): no worker replaces slot {slot}'s"
                )
            p = job.workers[slot]
            w = self.pool.workers[p]
            if not w.alive() or not self._answers(p):
                self._restart(p, "a job lost it")
            self._open_session(p, job)
            self._save()
            return self.pool.workers[p].address

    def _place(self) -> None:
        """Lease workers to the queue's head while it fits (strict FIFO: no one jumps it)."""
        while self.queue:
            job = self.jobs[self.queue[0]]
            slots = self._fit(job)
            if slots is None:
                return
            self.queue.pop(0)
            job.workers, job.state, job.leased_at = slots, "leased", time.time()
            job.last_seen = time.monotonic()
            for s in slots:
                self._open_session(s, job)
            log.info("job %s leased workers %s (%s)", job.id, slots, job.name)

    def _fit(self, job: Job) -> list[int] | None:
        holders = collections.defaultdict(list)  # slot -> jobs holding it
        for other in self.jobs.values():
            if other.state == "leased":
                for s in other.workers:
                    holders[s].append(other)
        up = [w.slot for w in self.pool.workers if self.health.get(w.slot, {}).get("health", "ok") == "ok"]
        if job.share:
            free = [s for s in up if all(o.share for o in holders[s])]
            free.sort(key=lambda s: (len(holders[s]), s))
        else:
            free = [s for s in up if not holders[s]]
        return free[: job.slices] if len(free) >= job.slices else None

    # -- workers -----------------------------------------------------------------------------
    def _client(self, slot: int) -> WorkerClient:
        address = self.pool.workers[slot].address
        c = self._clients.get(slot)
        if c is None or c.address != address:
            if c is not None:
                c.close()
            c = self._clients[slot] = WorkerClient(address, self.cluster_token, self._counts, tls=self.pool.tls)
        return c

    def _open_session(self, slot: int, job: Job) -> None:
        try:
            call(self._client(slot), verbs.OpenSession(job.id, job.root, job.lease_s), timeout_s=RPC_TIMEOUT_S)
        except WorkerError as e:  # the job finds the worker gone and asks for Replace
            log.warning("cannot open job %s's session on worker %d: %s", job.id, slot, e)

    def _close_session(self, slot: int, job_id: str) -> None:
        try:
            call(self._client(slot), verbs.CloseSession(job_id), timeout_s=RPC_TIMEOUT_S)
        except WorkerError as e:  # a worker that is gone holds no session
            log.warning("cannot close job %s's session on worker %d: %s", job_id, slot, e)

    def _answers(self, slot: int) -> bool:
        try:
            call(self._client(slot), verbs.Empty(), timeout_s=2.0, verb="Hello")
            return True
        except WorkerError:
            return False

    def _restart(self, slot: int, why: str) -> None:
        if self.stopping.is_set():
            return
        old = self.pool.workers[slot]
        log.warning("worker %d (pid %d, %s) %s: restarting it", slot, old.pid, old.address, why)
        w = self.pool.restart(slot)
        self.health[slot] = {"health": "ok", "since": time.monotonic()}
        # Jobs could not renew while this lock was held: that silence is not theirs.
        now = time.monotonic()
        for job in self.jobs.values():
            job.last_seen = max(job.last_seen, now)
        log.warning("worker %d restarted: pid %d at %s", slot, w.pid, w.address)
        self.write_cluster_file()

    def probe(self) -> None:
        """One health round: every worker's Sessions; a dead or long-silent one is restarted."""
        replies = {}
        for w in list(self.pool.workers):
            try:
                replies[w.slot] = verbs.encode(
                    call(self._client(w.slot), verbs.Empty(), timeout_s=2.0, verb="Sessions")[0]
                )
            except WorkerError as e:
                replies[w.slot] = e
        with self._lock:
            now = time.monotonic()
            for w in list(self.pool.workers):
                reply = replies.get(w.slot)
                last = self.health.get(w.slot, {})
                if isinstance(reply, dict):
                    self.health[w.slot] = {"health": "ok", "since": now, "info": reply}
                elif not w.alive():
                    self._restart(w.slot, "died")
                elif now - last.get("since", now) > UNREACHABLE_S:
                    self._restart(w.slot, f"did not answer for {UNREACHABLE_S:g} s")
                else:
                    self.health[w.slot] = {**last, "health": "unreachable", "since": last.get("since", now)}
            self._place()

    def expire(self) -> None:
        """End every job silent for longer than its lease_s."""
        with self._lock:
            now = time.monotonic()
            for job in list(self.jobs.values()):
                if job.state in ("queued", "leased") and now - job.last_seen > job.lease_s:
                    log.warning(
                        "job %s silent for %.1f s (lease_s=%g): its lease ends",
                        job.id,
                        now - job.last_seen,
                        job.lease_s,
                    )
                    self.end(job, "expired")

    def run_background(self) -> None:
        def loop():
            next_probe = 0.0
            while not self.stopping.wait(0.25):
                try:
                    self.expire()
                    if time.monotonic() >= next_probe:
                        self.probe()
                        next_probe = time.monotonic() + HEALTH_S
                except Exception:  # e.g. a worker that would not restart: try again next round
                    log.exception("manager round failed")

        threading.Thread(target=loop, daemon=True, name="mpmd-manager").start()

    # -- status and persistence --------------------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            workers = []
            for w in self.pool.workers:
                h = self.health.get(w.slot, {})
                info = h.get("info") or {}
                workers.append(
                    {
                        "slot": w.slot,
                        "address": w.address,
                        "pid": w.pid,
                        "health": h.get("health", "ok"),
                        "live_bytes": info.get("live_bytes"),
                        "cache": info.get("cache"),
                        "sessions": info.get("sessions", []),
                    }
                )
            jobs = [
                {
                    "job": j.id,
                    "name": j.name,
                    "state": j.state,
                    "slices": j.slices,
                    "share": j.share,
                    "position": self.position(j) if j.state in ("queued", "leased") else None,
                    "workers": j.workers if j.state == "leased" else [],
                    "submitted": j.submitted,
                    "leased_at": j.leased_at,
                    "ended_at": j.ended_at,
                }
                for j in self.jobs.values()
            ]
            leases = {j.id: self.addresses(j) for j in self.jobs.values() if j.state == "leased"}
            return {"workers": workers, "jobs": jobs, "leases": leases, "workers_started": self.pool.started}

    def _save(self) -> None:
        live = [asdict(j) for j in self.jobs.values() if j.state in ("queued", "leased")]
        order = {jid: i for i, jid in enumerate(self.queue)}
        live.sort(key=lambda j: order.get(j["id"], -1))
        for j in live:
            j.pop("last_seen")
        write_private(self._journal, json.dumps({"jobs": live}, indent=1))

    def rebuild(self) -> None:
        """After a restart: the journal's jobs, kept where the workers still hold their sessions."""
        try:
            with open(self._journal) as f:
                saved = json.load(f)["jobs"]
        except (OSError, ValueError, KeyError):
            saved = []
        held = collections.defaultdict(set)  # job id -> slots holding its session
        for w in self.pool.workers:
            try:
                sessions = call(self._client(w.slot), verbs.Empty(), timeout_s=RPC_TIMEOUT_S, verb="Sessions")[
                    0
                ].sessions
                for s in sessions:
                    held[s["job"]].add(w.slot)
            except WorkerError as e:
                log.warning("worker %d did not answer while rebuilding: %s", w.slot, e)
        with self._lock:
            for j in saved:
                job = Job(**j)
                job.last_seen = time.monotonic() + REJOIN_GRACE_S
                if job.state == "leased" and not held.get(job.id):
                    log.warning("job %s: no worker holds its sessions any more; dropped", job.id)
                    continue
                self.jobs[job.id] = job
                if job.state == "queued":
                    self.queue.append(job.id)
            for job_id, slots in held.items():
                if job_id not in self.jobs:  # leased after the last journal write
                    log.warning(
                        "job %s: found on workers %s but not in the journal; kept, as sharing", job_id, sorted(slots)
                    )
                    self.jobs[job_id] = Job(
                        id=job_id,
                        name=job_id,
                        slices=len(slots),
                        share=True,
                        root=self.pool.root,
                        lease_s=self.lease_s,
                        state="leased",
                        workers=sorted(slots),
                    )
                    self.jobs[job_id].last_seen = time.monotonic() + REJOIN_GRACE_S
            log.info(
                "rebuilt: %d job(s) leased, %d queued",
                sum(j.state == "leased" for j in self.jobs.values()),
                len(self.queue),
            )
            self._save()

    def write_cluster_file(self) -> None:
        write_private(
            self.cluster_file,
            json.dumps(
                {
                    "manager": self.address,
                    "manager_pid": os.getpid(),
                    "submit_token": self._submit_token,
                    "root": self.pool.root,
                    "dir": self.pool.directory,
                    "devices_per_worker": self.pool.devices_per_worker,
                    "backend": self.pool.backend,
                    # The certificates every job and `mpmd cluster` command speaks to it with.
                    "tls": self.pool.tls.directory if self.pool.tls else None,
                    "workers": [{"address": w.address, "pid": w.pid} for w in self.pool.workers],
                },
                indent=1,
            ),
        )

    # -- the gRPC service --------------------------------------------------------------------
    def principal(self, kind: str, token) -> str | None:
        """Who `token` is for a method of `kind`: ADMIN (the cluster token), SUBMIT, a job id;
        None: refused. ADMIN and SUBMIT are objects, not strings, so no job id can equal them."""
        if not isinstance(token, str):
            return None
        if hmac.compare_digest(token.encode(), self.cluster_token.encode()):
            return ADMIN
        if kind == "submit" and hmac.compare_digest(token.encode(), self._submit_token.encode()):
            return SUBMIT
        if kind == "job":
            return credentials.job_of(token, self.cluster_token)
        return None

    def handle(self, method: str, who, r):
        """The reply record to request record `r` of `method` (verbs.MANAGER_VERBS), from `who`."""
        if method == "Submit":
            job = self.submit(
                r.name, r.slices, r.share, r.root, self.lease_s if r.lease_s is None else r.lease_s, r.devices
            )
            return verbs.SubmitReply(
                job.id,
                credentials.job_credential(self.cluster_token, job.id),
                self.position(job),
                self.addresses(job) if job.state == "leased" else [],
            )
        if method == "Status":
            return verbs.StatusReply(**self.status())
        if method == "Down":
            threading.Thread(target=self.down, daemon=True).start()
            return verbs.Empty()
        if who is not ADMIN and r.job != who:
            raise PermissionError(f"{method}: this credential is job {who}'s, not {r.job!r}'s")
        job = self.seen(r.job)
        if method == "Wait":
            with self._lock:
                return verbs.WaitReply(self.position(job), self.addresses(job) if job.state == "leased" else [])
        if method == "Renew":
            return verbs.Empty()
        if method == "Release":
            self.end(job, "released")
            return verbs.Empty()
        assert method == "Replace", method
        return verbs.ReplaceReply(self.replace(job, r.slot))

    def down(self) -> None:
        """Stop every worker (by pid), then this process. `stopping` is set first: the
        background round ends, and Submit and Replace are refused (a job's Replace after this
        would start a worker nobody stops); a Replace already under the lock finishes first,
        and pool.stop then stops its worker too."""
        log.warning("cluster going down")
        self.stopping.set()
        with self._lock:
            stopped = self.pool.stop()
        log.warning("stopped workers %s", stopped)
        self.server.stop(grace=0.5)


def write_private(path: str, text: str) -> None:
    """Write `path` (mode 0600) atomically: readers see the old file or the new one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
