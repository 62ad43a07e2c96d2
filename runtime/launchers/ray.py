"""RayCluster: one worker per slice, each a Ray actor on a Ray cluster.

For users who outgrow one machine. Each actor hosts exactly what `mpmd worker` hosts (the
WorkerService behind a gRPC server, served by mpmd.runtime.worker.main.serve) in the actor's own
process and reports its `host:port`; from then on the controller talks to it as to any other
worker, through the one control plane (mpmd.runtime.control.client.ControlPlane). RayLauncher only
places, starts and kills the workers: no step, no activation and no parameter goes through
Ray.

Ray is an optional extra (`pip install -e '.[ray]'`): it is imported inside the methods
here, never when `mpmd` is imported.

Lifetime. The actors are owned by the controller's Ray driver, so Ray kills them when the
controller process dies (Ray's fate sharing plays the part of LocalCluster's stdin pipe).
`close()` shuts the workers down, kills the actors, and disconnects from Ray only if this
cluster called `ray.init` itself.

Addresses. A worker listens on loopback when the Ray cluster is this one machine, and on its
node's IP otherwise (the controller and the other workers must reach it). The cluster token
travels to the actors as a constructor argument, inside Ray: whoever can submit work to the
Ray cluster can run code on it anyway.

Placement. Every slot is a placement group of its own, asked of Ray once and then only
looked at (runtime/launchers/ray_placement.py): a replacement waits at most what the caller
allows for Ray to place it, and one Ray cannot place now stays asked, so a narrow run's
checkpoint boundaries find it placed or started without waiting for it.

Logs. With a log_dir, an actor's stdout and stderr go to <log_dir>/worker_<slot>.log, so
Ray (its driver's log_to_driver is off when this launcher calls ray.init) forwards nothing
of them; its records at log_level and up are kept in the actor and fetched every
RELAY_POLL_S, each logged here as the one line a local worker's gives.

Threads. XLA's flags must be set before JAX is imported in the actor process, and the
actor's module imports JAX (mpmd.runtime.worker.service) as Ray loads the class, so they are set
through the actor's runtime_env rather than from inside it.

The actor's own body (what runs in the actor's process) is runtime/launchers/ray_actor.py.
"""

from __future__ import annotations

import os
import threading
import time

from mpmd.runtime.control.spares import check_count
from mpmd.runtime.control.client import ControlPlane
from mpmd.runtime.control.rpc import new_token
from mpmd.runtime.wire.tls import Tls, cluster_tls
from mpmd.runtime.control.cluster import ClusterUnavailable, ReplaceUnsupported
from mpmd.runtime.launchers import ray_placement as placement
from mpmd.runtime.launchers.ray_actor import NODE_IP, SliceActor
from mpmd.runtime.launchers.workers import (
    check_processes_per_slice,
    check_worker_args,
    log_relayed,
    num_workers_for,
    worker_log_file,
    worker_root,
)
from mpmd.runtime.worker.main import LOG_LEVELS

RELAY_POLL_S = 1.0  # how often the launcher fetches the actors' records for the console
START_TIMEOUT_S = 120.0  # default start_timeout_s: Ray may have to start a Python process per actor
CONNECT_TIMEOUT_S = 30.0  # default connect_timeout_s
INSTALL_HINT = "pip install -e '.[ray]'"


class RayMissingError(ImportError):
    """Ray is not installed; the message says how to install it."""


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise RayMissingError(
            f"RayCluster needs Ray, which is not installed ({e}); install the extra with: {INSTALL_HINT}"
        ) from e
    return ray


class RayLauncher:
    """Starts worker actors on a Ray cluster (joining or starting Ray as RayCluster describes),
    one per slot (or a gang of processes_per_slice), each slot in a placement group of its own
    (runtime/launchers/ray_placement.py), each actor given `token` as a constructor argument.
    See RayCluster for the arguments; `shared` ({lease_s, compile_cache_mb}) makes them a
    shared cluster's workers, as `mpmd worker --shared` (runtime/manager/worker_pool.py
    RayWorkerPool)."""

    readmits = False  # a lost worker is stopped (or its lease given back), never taken back

    def __init__(
        self,
        token: str,
        *,
        num_workers: int | None = None,
        resources_per_worker: dict | None = None,
        address: str | None = None,
        devices_per_worker: int = 1,
        threads_per_worker: int = 1,
        host: str | None = None,
        runtime_env: dict | None = None,
        root: str | None = None,
        gpus: bool = False,
        shared: dict | None = None,
        processes_per_slice: int = 1,
        start_timeout_s: float = START_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        log_dir: str | None = None,
        log_level: str = "warning",
        tls: Tls | None = None,
    ):
        _import_ray()
        check_worker_args(num_workers, devices_per_worker, threads_per_worker)
        self.processes_per_slice = check_processes_per_slice(processes_per_slice)
        for name, value in (("start_timeout_s", start_timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.start_timeout_s, self.connect_timeout_s = float(start_timeout_s), float(connect_timeout_s)
        self.log_dir = log_dir  # worker_<slot>.log there: each actor's stdout and stderr
        if log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
        self.log_level = log_level  # an actor's records at this level and up reach the console
        self._relay_stop = threading.Event()
        self._relay_thread: threading.Thread | None = None
        self.placement_groups: list = []  # per slot: its placement group
        resources = dict(resources_per_worker or {})
        for k, v in resources.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"resources_per_worker must map resource names to amounts >= 0, got {k!r}: {v!r}")
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise ValueError(f"runtime_env must be a dict (Ray's runtime_env), got {type(runtime_env).__name__}")
        if not isinstance(gpus, bool):
            raise ValueError(f"gpus must be True (each actor reserves devices_per_worker GPUs) or False, got {gpus!r}")
        if gpus and resources.get("GPU", devices_per_worker) != devices_per_worker:
            raise ValueError(
                f"gpus=True reserves devices_per_worker={devices_per_worker} GPU(s) per actor, but "
                f"resources_per_worker asks for GPU={resources['GPU']}: drop one of the two"
            )
        self._token = token
        self.tls = tls  # each actor's certificates: a constructor argument, as the token
        self.shared = shared  # {lease_s, compile_cache_mb}: a shared cluster's workers
        self.num_workers = num_workers
        self.resources_per_worker = resources
        self.ray_address = address
        self.devices_per_worker = devices_per_worker
        self.threads_per_worker = threads_per_worker
        self.gpus = gpus
        self.host = host
        self.runtime_env = dict(runtime_env or {})
        self.root = root  # the cluster's root=; the actors' is fixed when they start
        self._running_root: str | None = None
        self.addresses: list = []  # per slot: "host:port", or one per process of its gang
        self.actors: list = []  # Ray actor handles, slot by slot (a gang's k in a row)
        self.pids: list[int] = []
        self.pending: dict[int, placement.SlotRequest] = {}  # slot -> a replacement asked of Ray, not ready
        self._listen_host: str | None = None
        self._started_ray = False

    def start(self, num_slices: int, root: str | None = None) -> list[str]:
        n = num_workers_for(self.num_workers, num_slices, "RayCluster")
        root = worker_root(self.root, root, self._running_root if self.actors else None, "RayCluster")
        if self.actors:  # already running: the control plane reuses them from a clean state
            return list(self.addresses)
        self._running_root = root
        ray = _import_ray()
        try:
            self._connect(ray, n)
            self._listen_host = self._pick_host(ray)
            requests = self._start_slots(ray, n)
            k = self.processes_per_slice
            self.placement_groups = [r.group for r in requests]
            self.actors = [a for r in requests for a in r.actors]
            self.pids = [p for r in requests for _, p in r.ready]
            self.addresses = [r.ready[0][0] if k == 1 else tuple(a for a, _ in r.ready) for r in requests]
            if self.log_dir is not None:
                self._relay_stop = threading.Event()
                self._relay_thread = threading.Thread(
                    target=self._relay, args=(ray, self._relay_stop), daemon=True, name="mpmd-ray-relay"
                )
                self._relay_thread.start()
        except BaseException:
            self.stop()
            raise
        return list(self.addresses)

    def _connect(self, ray, n: int) -> None:
        """ray.init, unless this process is connected already: to `address` (or $RAY_ADDRESS)
        once it answers within connect_timeout_s, else a private instance on this machine.
        Ray's forwarding of actor output to this console is off: each actor's output goes to
        its worker_<slot>.log (log_dir) or Ray's own log files."""
        if ray.is_initialized():
            return
        address, kwargs = self.ray_address or os.environ.get("RAY_ADDRESS"), {}
        if address is None:
            # A fresh local instance ("local": never another session's instance that ray.init
            # would otherwise find on this machine), with enough CPUs for every worker even on
            # a small machine (XLA runs one thread per worker; oversubscribing is what
            # LocalCluster does too), no dashboard.
            address = "local"
            kwargs = {
                "num_cpus": max(os.cpu_count() or 1, n * self.processes_per_slice * self._actor_options()["num_cpus"]),
                "include_dashboard": False,
            }
        else:
            placement.check_reachable(address, self.connect_timeout_s)
        ray.init(address=address, log_to_driver=False, **kwargs)
        self._started_ray = True

    def _start_slots(self, ray, n: int) -> list[placement.SlotRequest]:
        """Every slot's group placed and its actors started within start_timeout_s, the
        actors of all slots starting at once; else RuntimeError naming what was asked and
        what each node offers (nothing is left asked of Ray)."""
        bundle, k, offers = self._bundle(), self.processes_per_slice, placement.node_offers(ray)
        if placement.strategy(bundle, n * k, offers) is None:  # the nodes do not hold n * k bundles
            raise placement.Unplaceable(
                f"Ray cannot place {n} slice(s) of {k} worker(s) each asking {bundle}: missing "
                f"{placement.missing(bundle, n * k, offers)}; {placement.describe_offers(offers, bundle)}"
            )
        requests = [self._request(ray, slot, offers) for slot in range(n)]
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for r in requests:  # placed, and its actors asked for, slot after slot
                if not r.advance(deadline - time.monotonic(), 0.0) and r.placed_at is None:
                    raise placement.Unplaceable(
                        f"Ray placed {sum(q.placed_at is not None for q in requests)} of {n} slice(s) within "
                        f"start_timeout_s={self.start_timeout_s:g} s: {r.waiting_for()}; the cluster has "
                        f"{ray.available_resources()} available; {placement.describe_offers(offers, bundle)}"
                    )
            for r in requests:  # then every slot's actors, started in parallel
                if not r.advance(0.0, deadline - time.monotonic()):
                    raise ClusterUnavailable(
                        f"slice {r.slot}'s worker(s) did not start within start_timeout_s="
                        f"{self.start_timeout_s:g} s: {r.waiting_for()}"
                    )
        except placement.StartFailed as e:
            for r in requests:
                r.cancel()
            raise ClusterUnavailable(f"a Ray worker actor failed to start: {e}") from None
        except BaseException:
            for r in requests:
                r.cancel()
            raise
        return requests

    def replace(self, slot: int, wait_s: float | None = None) -> str | tuple[str, ...]:
        """Kill the slot's actors (dead, hung or cut off: they must not come back and act on
        stale state) and ask Ray for new ones, once: a request not ready is kept and looked at
        again by the next call, never asked twice. Waits at most `wait_s` for Ray to place it
        (0: only looks; None: start_timeout_s) and, once placed with wait_s > 0, for its actors
        to start; ReplaceUnsupported(retry=True) while it is not ready."""
        ray = _import_ray()
        request = self.pending.get(slot)
        if request is None:
            self._kill_slot(ray, slot)
            request = self.pending[slot] = self._request(ray, slot, placement.node_offers(ray))
        place_wait = self.start_timeout_s if wait_s is None else wait_s
        try:
            ready = request.advance(place_wait, self.start_timeout_s if place_wait > 0 else 0.0)
        except placement.StartFailed as e:
            request.cancel()
            del self.pending[slot]
            raise ReplaceUnsupported(f"no replacement for slot {slot}: {e}", retry=True) from None
        if not ready:
            raise ReplaceUnsupported(f"no replacement for slot {slot} yet: {request.waiting_for()}", retry=True)
        del self.pending[slot]
        k = self.processes_per_slice
        self.placement_groups[slot] = request.group
        self.actors[slot * k : (slot + 1) * k] = request.actors
        self.pids[slot * k : (slot + 1) * k] = [p for _, p in request.ready]
        self.addresses[slot] = request.ready[0][0] if k == 1 else tuple(a for a, _ in request.ready)
        return self.addresses[slot]

    def serves(self, slot: int, slice_index: int) -> None:
        pass  # nothing placed by slice here (Launcher.serves)

    def stop(self) -> None:
        """Kill the actors (and any asked for that are not ready); disconnect from Ray only if
        start() called ray.init."""
        self._relay_stop.set()
        if self._relay_thread is not None:
            self._relay_thread.join()
            self._relay_thread = None
        actors, self.actors, self.pids = self.actors, [], []
        groups, self.placement_groups = self.placement_groups, []
        pending, self.pending = list(self.pending.values()), {}
        if not actors and not pending and not self._started_ray:
            return
        ray = _import_ray()
        for r in pending:
            r.cancel()
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone, or Ray itself is shutting down
                pass
        for g in groups:
            try:
                ray.util.remove_placement_group(g)
            except Exception:  # Ray itself is shutting down
                pass
        if self._started_ray:
            self._started_ray = False
            ray.shutdown()

    # -- plumbing --------------------------------------------------------------------------
    def _actor_options(self) -> dict:
        # Ray takes CPU, GPU and memory as keywords, not in `resources`. An actor given GPUs
        # sees only its own (Ray sets its CUDA_VISIBLE_DEVICES).
        res = dict(self.resources_per_worker)
        opts = {
            "num_cpus": res.pop("CPU", self.threads_per_worker),
            "num_gpus": res.pop("GPU", self.devices_per_worker if self.gpus else 0),
        }
        if "memory" in res:
            opts["memory"] = res.pop("memory")
        opts["resources"] = res
        return opts

    def _bundle(self) -> dict:
        """What one actor reserves, as a placement group bundle."""
        opts = self._actor_options()
        return {
            "CPU": opts["num_cpus"],
            **({"GPU": opts["num_gpus"]} if opts["num_gpus"] else {}),
            **({"memory": opts["memory"]} if "memory" in opts else {}),
            **opts["resources"],
        }

    def _request(self, ray, slot: int, offers) -> placement.SlotRequest:
        """Ask Ray for slot `slot`'s group: k bundles spread one per node where at least k
        nodes hold one, else packed (ray_placement.strategy; a replacement is asked even when
        the nodes there are cannot hold it now: one may join)."""
        k, bundle = self.processes_per_slice, self._bundle()
        strategy = (placement.strategy(bundle, k, offers) or "PACK") if k > 1 else "PACK"
        return placement.SlotRequest(
            ray,
            slot,
            bundle,
            k,
            strategy,
            self.start_timeout_s,
            lambda group, j: self._new_actor(ray, slot * k + j, gang=(group, j)),
        )

    def _kill_slot(self, ray, slot: int) -> None:
        """Kill every actor of the slot and remove its placement group."""
        k = self.processes_per_slice
        for a in self.actors[slot * k : (slot + 1) * k]:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        try:
            ray.util.remove_placement_group(self.placement_groups[slot])
        except Exception:  # already gone
            pass

    def _new_actor(self, ray, slot: int, gang):
        """An actor for process `slot` (its index among all) in bundle gang[1] of group gang[0]."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from mpmd.runtime.worker.main import xla_flags

        env = dict(self.runtime_env)
        env_vars = dict(env.get("env_vars") or {})
        env_vars["XLA_FLAGS"] = xla_flags(
            self.devices_per_worker, env_vars.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        )
        env["env_vars"] = env_vars
        options = dict(self._actor_options(), max_restarts=0, runtime_env=env)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=gang[0], placement_group_bundle_index=gang[1]
        )
        cls = ray.remote(**options)(SliceActor)
        k = self.processes_per_slice
        log_path = (
            os.path.abspath(worker_log_file(self.log_dir, slot // k, slot % k, k)) if self.log_dir is not None else None
        )
        return cls.remote(
            self._token,
            self._listen_host,
            os.getcwd(),
            slot,
            self.threads_per_worker,
            self._running_root,
            self.shared,
            k > 1,
            log_path,
            self.log_level,
            self.tls,
        )

    def _relay(self, ray, stop: threading.Event) -> None:
        """Until `stop`: every RELAY_POLL_S, each actor's records for the console logged here
        as one line each (workers.log_relayed), as LocalLauncher does with its workers'."""
        k = self.processes_per_slice
        while not stop.wait(RELAY_POLL_S):
            asked = [(j, a.relayed.remote()) for j, a in enumerate(list(self.actors))]
            for j, ref in asked:
                try:
                    records = ray.get(ref, timeout=RELAY_POLL_S * 5)
                except Exception:  # a lost actor (the Trainer replaces it), or Ray shutting down
                    continue
                slot, process = divmod(j, k)
                for levelno, text in records:
                    log_relayed(slot, levelno, text, worker_log_file(self.log_dir, slot, process, k))

    def _pick_host(self, ray) -> str:
        if self.host is not None:
            return self.host
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) == 1 and nodes[0]["NodeManagerAddress"] == ray.util.get_node_ip_address():
            return "127.0.0.1"
        return NODE_IP


class RayCluster(ControlPlane):
    """Workers as Ray actors (a ControlPlane over a RayLauncher).

    num_workers: actors to start (None: one per slice); more than num_slices leaves spares.
    resources_per_worker: Ray resources each actor reserves, e.g. {"GPU": 2} or
        {"CPU": 4, "slice_host": 1}; CPU defaults to threads_per_worker.
    devices_per_worker: JAX devices per actor (the size of its slice's mesh): host devices on
        CPU, GPUs with `gpus`.
    gpus: each actor reserves devices_per_worker GPUs (Ray's num_gpus), its slice's devices.
    address: the Ray cluster to join ("auto", "HEAD_IP:6379", "ray://head:10001", ...);
        None joins $RAY_ADDRESS if set, else starts a new Ray instance on this machine (shut
        down again by close()). Ignored when Ray is already initialised in this process.
    host: where workers listen; None picks loopback for a one-machine Ray cluster and the
        node's IP otherwise, "node" forces the node's IP, anything else is used as is.
    runtime_env: extra Ray runtime_env for the actors (e.g. py_modules, pip); its env_vars
        are kept, with XLA_FLAGS extended as a worker needs.
    failure_timeout_s: a slice silent this long is declared lost (see ControlPlane).
    root: the only directory tree the actors may save checkpoints to and restore from, as
        for LocalCluster (a path on the nodes' shared filesystem).
    step_timeout_s: a step without progress this long is aborted (see ControlPlane).

    processes_per_slice: k > 1 makes each slice a gang of k actors (runtime/worker/gang.py);
        its placement group's k bundles go STRICT_SPREAD, one per node, when k nodes each
        hold a bundle, else PACK (runtime/launchers/ray_placement.py); a lost actor loses its
        slice, whose group is removed (its actors killed) and asked for again.
    connect_timeout_s: how long connecting to `address` may take (it fails with one line,
        ClusterUnavailable, naming it), and a new worker its first answer.
    start_timeout_s: how long the first start may take to place and start every worker.
    tls: mutual TLS on every control channel, as for LocalCluster (True: an authority made
        for this cluster, its certificates an actor's constructor argument, as the token is:
        they cross Ray's own channels, which Ray's TLS settings cover or not).
    log_dir: each actor's stdout and stderr go to <log_dir>/worker_<slot>.log (None: Ray's
        own log files); Ray never forwards them to this console, and each of its records at
        `log_level` and up comes back as one line "worker <slot> WARNING ... (see <log>)"
        (logger mpmd.workers), as from a LocalCluster's workers.
    hot_spares: actors started beyond the slices' and kept warm, as for LocalCluster
        (runtime/control/spares.py): a lost slice is taken over by one at once, and a new
        actor starts in the background.
    A lost slice is replaced by a new actor in the same slot (`replace(slice_index)`, which
    the Trainer calls when it recovers); spare workers are not needed. A replacement Ray
    cannot place now stays asked for (no capacity is asked twice) and is looked at again
    without waiting, so a narrow run grows back once a node joins.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        resources_per_worker: dict | None = None,
        address: str | None = None,
        devices_per_worker: int = 1,
        threads_per_worker: int = 1,
        host: str | None = None,
        runtime_env: dict | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        failure_timeout_s: float = 5.0,
        step_timeout_s: float | None = None,
        root: str | None = None,
        gpus: bool = False,
        processes_per_slice: int = 1,
        start_timeout_s: float = START_TIMEOUT_S,
        log_dir: str | None = None,
        log_level: str = "warning",
        transport: str = "auto",
        tls: bool | str = True,
        hot_spares: int = 0,
    ):
        token = new_token()
        tls = cluster_tls(tls)
        check_worker_args(num_workers, devices_per_worker, threads_per_worker)
        launcher = RayLauncher(
            token,
            num_workers=num_workers + check_count(hot_spares) if num_workers is not None else None,
            resources_per_worker=resources_per_worker,
            address=address,
            devices_per_worker=devices_per_worker,
            threads_per_worker=threads_per_worker,
            host=host,
            runtime_env=runtime_env,
            root=root,
            gpus=gpus,
            processes_per_slice=processes_per_slice,
            start_timeout_s=start_timeout_s,
            connect_timeout_s=connect_timeout_s,
            log_dir=log_dir,
            log_level=log_level,
            tls=tls,
        )
        super().__init__(
            launcher,
            token,
            connect_timeout_s=connect_timeout_s,
            failure_timeout_s=failure_timeout_s,
            step_timeout_s=step_timeout_s,
            transport=transport,
            tls=tls,
            hot_spares=hot_spares,
        )

    @property
    def actors(self) -> list:
        return self.launcher.actors

    @property
    def pids(self) -> list[int]:
        return self.launcher.pids

    @property
    def devices_per_worker(self) -> int:
        return self.launcher.devices_per_worker

    @property
    def devices_per_slice(self) -> int:
        return self.launcher.devices_per_worker * self.launcher.processes_per_slice

    @property
    def placement_groups(self) -> list:
        """Per slot, its Ray placement group (replaced with the slot's worker or gang)."""
        return self.launcher.placement_groups

    def gang_pids(self, slot: int) -> list[int]:
        k = self.launcher.processes_per_slice
        return self.launcher.pids[slot * k : (slot + 1) * k]
