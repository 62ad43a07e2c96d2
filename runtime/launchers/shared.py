"""A job on a shared cluster (`mpmd cluster up`, runtime/manager/core.py): SharedCluster is the
one control plane (runtime/control/client.py) over SharedLauncher, which leases the workers.

SharedLauncher.start submits the job (submit token), waits in the manager's FIFO queue
(`on_wait(position)` is called each time the position changes), and returns the leased
workers' addresses; the control plane then talks to them with the job's credential, which
the manager issued: the workers let it act only on this job's session. A background thread
renews the lease every RENEW_S; a manager that does not answer for a while is only logged
(the workers keep the job's sessions while the job heartbeats them, and a restarted manager
keeps the lease). `replace(slot)` asks the manager for a worker in place of a lost one;
`stop` releases the lease. A job that dies without releasing loses its lease after lease_s.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import threading
import time

import grpc

from mpmd.runtime.worker import mesh
from mpmd.runtime.wire import verbs
from mpmd.runtime.control.client import ControlPlane
from mpmd.runtime.control.rpc import WorkerClient, WorkerError, call
from mpmd.runtime.control.cluster import ClusterGone, ReplaceUnsupported
from mpmd.runtime.wire.tls import Tls, cluster_tls

MANAGER_SERVICE = verbs.MANAGER_SERVICE  # the manager's (runtime/manager/core.py); its verbs: verbs.MANAGER_VERBS
DEFAULT_CLUSTER_FILE = "mpmd-cluster.json"
RENEW_S = 1.0
MANAGER_AWAY_S = 60.0  # a queued job waits this long for a manager that does not answer
_MANAGER_AWAY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
WAIT_POLL_S = 0.25
log = logging.getLogger("mpmd.shared")


class JobRefused(ValueError):
    """The manager refused the job (too many slices, a run_dir outside the cluster's root, a
    wrong submit token, no manager there); the message says why."""


def read_cluster_file(path: str) -> dict:
    """The cluster file `mpmd cluster up` wrote; ValueError saying what is wrong with it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"cluster file {path!r} not found: start a cluster with `mpmd cluster up` (it writes "
            f"{DEFAULT_CLUSTER_FILE}), or give cluster.file / cluster.address"
        ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read cluster file {path!r}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("manager"), str) or not data.get("submit_token"):
        raise ValueError(f"cluster file {path!r} lacks 'manager' and 'submit_token': not written by `mpmd cluster up`?")
    return data


class SharedLauncher:
    """address: the manager's host:port; submit_token: the cluster's submit token; name: the
    job's name (shown in `mpmd cluster status`); share: time-share workers with other sharing
    jobs; lease_s: silence after which the manager ends the lease (None: the cluster's
    default); on_wait(position): called while queued, whenever the position changes."""

    readmits = False  # a lost worker is stopped (or its lease given back), never taken back

    def __init__(
        self,
        address: str,
        submit_token: str,
        *,
        name: str = "job",
        share: bool = False,
        lease_s: float | None = None,
        on_wait=None,
        wait_timeout_s: float | None = None,
        cluster_file: str | None = None,
        tls: Tls | None = None,
    ):
        if not isinstance(address, str) or not address.rpartition(":")[2].isdigit():
            raise ValueError(f"address must be the manager's 'host:port', got {address!r}")
        if lease_s is not None and (
            not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or not lease_s > 2 * RENEW_S
        ):
            raise ValueError(
                f"lease_s must be a number of seconds > {2 * RENEW_S:g} (the job renews every "
                f"{RENEW_S:g} s), or None (the cluster's), got {lease_s!r}"
            )
        self.address_of_manager = address
        self._submit_token = submit_token
        self.tls = tls  # the cluster's certificates: the manager's channel is mutual TLS too
        self.name, self.share, self.lease_s = name, bool(share), lease_s
        self.on_wait = on_wait or (
            lambda position: log.info("waiting for the shared cluster: position %d in its queue", position)
        )
        self.wait_timeout_s = wait_timeout_s
        self.cluster_file = cluster_file  # its removal means the cluster is down for good
        self.addresses: list[str] = []
        self.devices: list[int] | None = None  # devices of each slice's mesh (None: all of a worker's)
        self.job: str | None = None
        self.credential: str | None = None
        self.wait_s = 0.0  # time spent in the queue
        self._counts: collections.Counter = collections.Counter()
        self._manager: WorkerClient | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def submit(self, num_slices: int, root: str | None = None) -> None:
        """Submits the job (its run directory `root` claimed: the manager refuses one that
        overlaps another live job's) without waiting for its lease; `start` waits. A job
        already submitted: nothing."""
        if self.job is not None:
            return
        root = os.path.realpath(root or os.getcwd())
        submit = WorkerClient(self.address_of_manager, self._submit_token, self._counts, MANAGER_SERVICE, self.tls)
        try:
            h = call(
                submit,
                verbs.Submit(num_slices, root, self.name, self.share, self.lease_s, self.devices),
                timeout_s=30.0,
            )[0]
        except WorkerError as e:
            raise JobRefused(
                f"the shared cluster's manager at {self.address_of_manager} refused the job: {e}"
            ) from None
        finally:
            submit.close()
        self.job, self.credential = h.job, h.credential
        self._manager = WorkerClient(self.address_of_manager, self.credential, self._counts, MANAGER_SERVICE, self.tls)
        self._submitted = (num_slices, h.position, h.workers)

    def start(self, num_slices: int, root: str | None = None) -> list[str]:
        if self.job is not None and self.addresses:
            if len(self.addresses) != num_slices:
                raise JobRefused(
                    f"this job leased {len(self.addresses)} slice(s), not {num_slices}: a shared "
                    f"cluster's job keeps the slices it was given"
                )
            return list(self.addresses)
        self.submit(num_slices, root)
        submitted, position, workers = self._submitted
        if submitted != num_slices:
            why = f"job {self.job} was submitted for {submitted} slice(s), not {num_slices}"
            self.stop()
            raise JobRefused(why)
        t0 = time.monotonic()
        shown = None
        while position:
            if position != shown:
                self.on_wait(position)
                shown = position
            if self.wait_timeout_s is not None and time.monotonic() - t0 > self.wait_timeout_s:
                self.stop()
                raise JobRefused(f"job {self.job} still at position {position} after {self.wait_timeout_s:g} s")
            time.sleep(WAIT_POLL_S)
            try:
                reply = call(self._manager, verbs.JobRequest(self.job), timeout_s=10.0, verb="Wait")[0]
            except WorkerError as e:
                if e.code in _MANAGER_AWAY and time.monotonic() - self._manager.last_ok < MANAGER_AWAY_S:
                    continue  # a manager restarting keeps the queue (runtime/manager/core.py)
                self.stop()
                raise JobRefused(f"job {self.job} lost its place in the queue: {e}") from None
            position, workers = reply.position, reply.workers
        self.wait_s = time.monotonic() - t0
        self.addresses = list(workers)
        log.info(
            "job %s leased %d worker(s) after %.1f s in the queue: %s",
            self.job,
            len(workers),
            self.wait_s,
            ", ".join(workers),
        )
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="mpmd-lease")
        self._renewer.start()
        return list(self.addresses)

    def _renew(self) -> None:
        failing_since = None  # one warning per outage, not one a second
        while not self._stop.wait(RENEW_S):
            try:
                call(self._manager, verbs.JobRequest(self.job), timeout_s=RENEW_S * 2, verb="Renew")
            except WorkerError as e:
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("job %s: renewing the lease failed (%s); trying again every %g s", self.job, e, RENEW_S)
                continue
            if failing_since is not None:
                log.warning("job %s: lease renewed again after %.1f s", self.job, time.monotonic() - failing_since)
                failing_since = None

    def replace(self, slot: int, wait_s: float | None = None) -> str:
        """ClusterGone once the manager says it is going down, or once it does not answer and
        the cluster file is gone (`mpmd cluster down` removes it last); ReplaceUnsupported,
        worth asking again, for a manager away for another reason (it may be restarted)."""
        try:
            address = call(self._manager, verbs.Replace(self.job, slot), timeout_s=120.0)[0].address
        except WorkerError as e:
            if e.code == grpc.StatusCode.FAILED_PRECONDITION or (
                self.cluster_file is not None and not os.path.exists(self.cluster_file)
            ):
                raise ClusterGone("the shared cluster was shut down") from None
            raise ReplaceUnsupported(f"the shared cluster gave no worker for slot {slot}: {e}", retry=True) from None
        self.addresses[slot] = address
        return address

    def serves(self, slot: int, slice_index: int) -> None:
        pass  # nothing placed by slice here (Launcher.serves)

    def stop(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self._manager is not None:
            try:
                call(self._manager, verbs.JobRequest(self.job), timeout_s=10.0, verb="Release")
            except WorkerError as e:  # it expires after lease_s anyway
                log.warning("job %s: releasing the lease failed: %s", self.job, e)
            self._manager.close()
            self._manager = None
        self.job, self.credential, self.addresses = None, None, []


class SharedCluster(ControlPlane):
    """A job's cluster on a shared cluster's leased workers (see SharedLauncher for the
    arguments; `cluster_file` instead of `address` + `submit_token` reads both from it, and
    the directory of the cluster's certificates too). `tls`: that directory (with `address`),
    or False: in the clear whatever the cluster file says. `hot_spares`: workers leased beyond
    the slices' and kept warm (runtime/control/spares.py); the job is submitted for the slices
    and them together, and a spare promoted is replaced by a new lease in the background."""

    def __init__(
        self,
        address: str | None = None,
        submit_token: str | None = None,
        *,
        cluster_file: str | None = None,
        name: str = "job",
        share: bool = False,
        lease_s: float | None = None,
        on_wait=None,
        failure_timeout_s: float = 5.0,
        step_timeout_s: float | None = None,
        transport: str = "auto",
        tls: str | bool | None = None,
        hot_spares: int = 0,
    ):
        if cluster_file is not None:
            if address is not None or submit_token is not None:
                raise ValueError("give cluster_file, or address and submit_token, not both")
            data = read_cluster_file(cluster_file)
            address, submit_token = data["manager"], data["submit_token"]
            if tls is None:
                tls = data.get("tls")
        tls = cluster_tls(
            tls,
            "the shared cluster's tls",
            given_only="a shared cluster's certificates are made by `mpmd cluster up`: give tls= their directory",
        )
        if address is None or not submit_token:
            raise ValueError("SharedCluster needs the manager's address and the submit token (or cluster_file)")
        launcher = SharedLauncher(
            address,
            submit_token,
            name=name,
            share=share,
            lease_s=lease_s,
            on_wait=on_wait,
            cluster_file=cluster_file and os.path.abspath(cluster_file),
            tls=tls,
        )
        # The token is the job's credential, known once the manager accepted the job.
        super().__init__(
            launcher,
            "",
            failure_timeout_s=failure_timeout_s,
            step_timeout_s=step_timeout_s,
            transport=transport,
            tls=tls,
            hot_spares=hot_spares,
        )

    def claim(self, num_slices: int, root: str, meshes=None) -> None:
        """Submits the job for `root` (the run directory) before anything under it is read or
        written: the manager refuses a root that overlaps another live job's (JobRefused),
        and a refused job has touched nothing of the other's. `start` then waits for the
        lease. Other clusters have nothing to claim."""
        if meshes is not None:  # the manager refuses slices its workers' devices cannot hold
            self.launcher.devices = sorted({math.prod(mesh.shape_of(m)) for m in meshes})
        try:
            self.launcher.submit(num_slices + self.hot_spares, root)
        except BaseException:
            self.launcher.stop()
            raise

    def start(self, num_slices: int, root: str | None = None, meshes=None) -> None:
        if meshes is not None:  # the manager refuses slices its workers' devices cannot hold
            self.launcher.devices = sorted({math.prod(mesh.shape_of(m)) for m in meshes})
        try:
            self.launcher.start(num_slices + self.hot_spares, root=root)
            self._token = self.launcher.credential
            super().start(num_slices, root, meshes)
        except BaseException:
            self.launcher.stop()
            raise

    @property
    def job(self) -> str | None:
        return self.launcher.job
