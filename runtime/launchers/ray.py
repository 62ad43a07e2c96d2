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

Threads. XLA's flags must be set before JAX is imported in the actor process, and the
actor's module imports JAX (mpmd.runtime.worker.service) as Ray loads the class, so they are set
through the actor's runtime_env rather than from inside it.
"""
from __future__ import annotations

import os
import threading
import time

from mpmd.runtime.control.client import ControlPlane
from mpmd.runtime.control.rpc import new_token
from mpmd.runtime.control.cluster import ReplaceUnsupported
from mpmd.runtime.launchers.workers import check_processes_per_slice, check_worker_args, num_workers_for, worker_root

START_TIMEOUT_S = 120.0
INSTALL_HINT = "pip install -e '.[ray]'"
NODE_IP = "node"    # host= value: listen on the IP of the node the actor lands on


class RayMissingError(ImportError):
    """Ray is not installed; the message says how to install it."""


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise RayMissingError(f"RayCluster needs Ray, which is not installed ({e}); "
                              f"install the extra with: {INSTALL_HINT}") from e
    return ray


class _SliceActor:
    """The body of one worker actor (wrapped with ray.remote at start time). A process of a
    gang (`gang`: its slot's index among all processes, for pinning) serves only once the
    launcher has given it its gang's coordinator (`join`): JAX's distributed group must be
    formed before anything makes JAX's backend."""

    def __init__(self, token: str, host: str, workdir: str, slot: int, threads: int, root: str,
                 shared: dict | None = None, gang: bool = False):
        import ray
        from mpmd.runtime.worker.main import cores_for

        # Pinned like a local worker, so both compute the same bits (see cores_for).
        os.sched_setaffinity(0, cores_for(slot, threads))
        # Relative paths the controller sends (checkpoint directories under a relative run_dir)
        # must mean what they mean to it, as for a LocalCluster worker, which inherits its cwd.
        if os.path.isdir(workdir):
            os.chdir(workdir)
        if host == NODE_IP:
            host = ray.util.get_node_ip_address()
        self._token, self._host, self._root = token, host, root
        self.shared = shared is not None
        self._shared = shared
        if not gang:
            self._serve()

    def coordinator(self) -> str:
        """HOST:PORT for the gang's coordinator on this actor's node (its process 0's)."""
        from mpmd.runtime.launchers.workers import free_port
        return f"{self._host}:{free_port(self._host)}"

    def join(self, coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> tuple[str, int]:
        """Join the gang's JAX distributed group (returns once all have joined), then serve."""
        from mpmd.runtime.worker.gang import join
        join(coordinator, num_processes, process_id, timeout_s)
        self._serve()
        return self.ready()

    def _serve(self) -> None:
        from mpmd.runtime.worker.service import WorkerService
        from mpmd.runtime.worker.main import RPC_THREADS, SHARED_RPC_THREADS, serve
        host = self._host
        listen = f"[{host}]:0" if ":" in host else f"{host}:0"
        if not self.shared:
            self.service = WorkerService(self._token, self._stop, root=self._root)
            self.server, self.address = serve(self.service.handler(), listen, RPC_THREADS)
            return
        # A shared cluster's worker (runtime/manager/core.py), as `mpmd worker --shared`: several
        # jobs' sessions, compiled programs kept across them, a silent job's session closed.
        from mpmd.runtime.worker.compile_cache import CompileCache
        shared = self._shared
        self.service = WorkerService(self._token, self._stop, root=self._root, shared=True, lease_s=shared["lease_s"],
                                     cache=CompileCache(int(shared["compile_cache_mb"] * 2**20)))
        self.server, self.address = serve(self.service.handler(), listen, SHARED_RPC_THREADS)
        threading.Thread(target=self._lapse, daemon=True, name="mpmd-lapse").start()

    def _lapse(self) -> None:
        while True:
            time.sleep(0.5)
            self.service.lapse()

    def ready(self) -> tuple[str, int]:
        """(gRPC address, pid), once the server is up."""
        return self.address, os.getpid()

    def _stop(self, why: str) -> None:
        # Shutdown RPC: stop serving; the controller kills the actor right after.
        self.server.stop(grace=1.0)
        if self.shared:
            self.service.close()
        elif self.service.transport is not None:
            self.service.transport.close()


class RayLauncher:
    """Starts worker actors on a Ray cluster (joining or starting Ray as RayCluster describes),
    one per slot, each given `token` as a constructor argument. See RayCluster for the
    arguments; `shared` ({lease_s, compile_cache_mb}) makes them a shared cluster's workers,
    as `mpmd worker --shared` (runtime/manager/worker_pool.py RayWorkerPool)."""

    def __init__(self, token: str, *, num_workers: int | None = None, resources_per_worker: dict | None = None,
                 address: str | None = None, devices_per_worker: int = 1, threads_per_worker: int = 1,
                 host: str | None = None, runtime_env: dict | None = None, root: str | None = None,
                 gpus: bool = False, shared: dict | None = None, processes_per_slice: int = 1):
        _import_ray()
        check_worker_args(num_workers, devices_per_worker, threads_per_worker)
        self.processes_per_slice = check_processes_per_slice(processes_per_slice)
        self.placement_groups: list = []    # per slot of a gang: its placement group
        resources = dict(resources_per_worker or {})
        for k, v in resources.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"resources_per_worker must map resource names to amounts >= 0, "
                                 f"got {k!r}: {v!r}")
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise ValueError(f"runtime_env must be a dict (Ray's runtime_env), got {type(runtime_env).__name__}")
        if not isinstance(gpus, bool):
            raise ValueError(f"gpus must be True (each actor reserves devices_per_worker GPUs) or False, got {gpus!r}")
        if gpus and resources.get("GPU", devices_per_worker) != devices_per_worker:
            raise ValueError(f"gpus=True reserves devices_per_worker={devices_per_worker} GPU(s) per actor, but "
                             f"resources_per_worker asks for GPU={resources['GPU']}: drop one of the two")
        self._token = token
        self.shared = shared          # {lease_s, compile_cache_mb}: a shared cluster's workers
        self.num_workers = num_workers
        self.resources_per_worker = resources
        self.ray_address = address
        self.devices_per_worker = devices_per_worker
        self.threads_per_worker = threads_per_worker
        self.gpus = gpus
        self.host = host
        self.runtime_env = dict(runtime_env or {})
        self.root = root              # the cluster's root=; the actors' is fixed when they start
        self._running_root: str | None = None
        self.addresses: list = []       # per slot: "host:port", or one per process of its gang
        self.actors: list = []          # Ray actor handles, slot by slot (a gang's k in a row)
        self.pids: list[int] = []
        self._listen_host: str | None = None
        self._started_ray = False

    def start(self, num_slices: int, root: str | None = None) -> list[str]:
        n = num_workers_for(self.num_workers, num_slices, "RayCluster")
        root = worker_root(self.root, root, self._running_root if self.actors else None, "RayCluster")
        if self.actors:      # already running: the control plane reuses them from a clean state
            return list(self.addresses)
        self._running_root = root
        ray = _import_ray()
        try:
            if not ray.is_initialized():
                address, kwargs = self.ray_address, {}
                if address is None and not os.environ.get("RAY_ADDRESS"):
                    # A fresh local instance ("local": never another session's instance
                    # that ray.init would otherwise find on this machine), with enough CPUs
                    # for every worker even on a small machine (XLA runs one thread per
                    # worker; oversubscribing is what LocalCluster does too), no dashboard.
                    address = "local"
                    kwargs = {"num_cpus": max(os.cpu_count() or 1, n * self._actor_options()["num_cpus"]),
                              "include_dashboard": False}
                ray.init(address=address, **kwargs)
                self._started_ray = True
            self._listen_host = self._pick_host(ray)
            if self.processes_per_slice > 1:
                for slot in range(n):
                    self._start_gang(ray, slot)
                return list(self.addresses)
            self.actors = [self._new_actor(ray, i) for i in range(n)]
            ready = self._wait_ready(ray, self.actors)
            self.addresses = [a for a, _ in ready]
            self.pids = [p for _, p in ready]
        except BaseException:
            self.stop()
            raise
        return list(self.addresses)

    def replace(self, slot: int) -> str:
        """Kill the slot's actor (dead, hung or cut off: it must not come back and act on stale
        state) and start a fresh one in its place."""
        ray = _import_ray()
        if self.processes_per_slice > 1:
            return self._replace_gang(ray, slot)
        ray.kill(self.actors[slot], no_restart=True)
        actor = self._new_actor(ray, slot)
        try:
            ((address, pid),) = self._wait_ready(ray, [actor])
        except RuntimeError as e:
            # Ray cannot place (or start) one now: no capacity, which the Trainer answers by
            # going on without the slice (cluster.on_loss) rather than by stopping. The actor
            # asked for must not start later and serve nobody.
            ray.kill(actor, no_restart=True)
            raise ReplaceUnsupported(f"no replacement for slot {slot}: {e}", retry=True) from None
        self.actors[slot], self.addresses[slot], self.pids[slot] = actor, address, pid
        return address

    def stop(self) -> None:
        """Kill the actors; disconnect from Ray only if start() called ray.init."""
        actors, self.actors, self.pids = self.actors, [], []
        groups, self.placement_groups = self.placement_groups, []
        if not actors and not self._started_ray:
            return
        ray = _import_ray()
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:       # already gone, or Ray itself is shutting down
                pass
        for g in groups:
            try:
                ray.util.remove_placement_group(g)
            except Exception:       # Ray itself is shutting down
                pass
        if self._started_ray:
            self._started_ray = False
            ray.shutdown()

    # -- plumbing --------------------------------------------------------------------------
    def _actor_options(self) -> dict:
        # Ray takes CPU, GPU and memory as keywords, not in `resources`. An actor given GPUs
        # sees only its own (Ray sets its CUDA_VISIBLE_DEVICES).
        res = dict(self.resources_per_worker)
        opts = {"num_cpus": res.pop("CPU", self.threads_per_worker),
                "num_gpus": res.pop("GPU", self.devices_per_worker if self.gpus else 0)}
        if "memory" in res:
            opts["memory"] = res.pop("memory")
        opts["resources"] = res
        return opts

    # -- gangs: one placement group per slice -------------------------------------------------
    def _start_gang(self, ray, slot: int) -> None:
        """Reserve slot `slot`'s k bundles at once (a placement group: the gang starts whole or
        not at all), start an actor in each, and have them form their JAX group around a
        coordinator port that process 0 picks on its own node."""
        k = self.processes_per_slice
        opts = self._actor_options()
        bundle = {"CPU": opts["num_cpus"], **({"GPU": opts["num_gpus"]} if opts["num_gpus"] else {}),
                  **({"memory": opts["memory"]} if "memory" in opts else {}), **opts["resources"]}
        # One host per process where the cluster has enough nodes (a slice spans hosts), else
        # packed onto the nodes there are (one machine standing in for k hosts).
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        group = ray.util.placement_group([bundle] * k, strategy="STRICT_SPREAD" if len(nodes) >= k else "PACK")
        try:
            ray.get(group.ready(), timeout=START_TIMEOUT_S)
        except Exception:
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"Ray could not reserve slice {slot}'s gang of {k} bundles {bundle} within "
                               f"{START_TIMEOUT_S:g} s; the cluster has {ray.available_resources()} available") from None
        actors = [self._new_actor(ray, slot * k + j, gang=(group, j)) for j in range(k)]
        try:
            coordinator = ray.get(actors[0].coordinator.remote(), timeout=START_TIMEOUT_S)
            ready = ray.get([a.join.remote(coordinator, k, j, START_TIMEOUT_S) for j, a in enumerate(actors)],
                            timeout=START_TIMEOUT_S + 10)
        except Exception as e:
            for a in actors:
                ray.kill(a, no_restart=True)
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"slice {slot}'s gang of {k} Ray actors did not form: {e}") from None
        if slot < len(self.placement_groups):
            self.placement_groups[slot] = group
            self.actors[slot * k:(slot + 1) * k] = actors
            self.pids[slot * k:(slot + 1) * k] = [p for _, p in ready]
            self.addresses[slot] = tuple(a for a, _ in ready)
        else:
            self.placement_groups.append(group)
            self.actors += actors
            self.pids += [p for _, p in ready]
            self.addresses.append(tuple(a for a, _ in ready))

    def _replace_gang(self, ray, slot: int) -> tuple[str, ...]:
        """Kill every actor of the slot's gang and remove its placement group, then reserve and
        start a new gang; ReplaceUnsupported if Ray cannot place one now."""
        k = self.processes_per_slice
        for a in self.actors[slot * k:(slot + 1) * k]:
            try:
                ray.kill(a, no_restart=True)
            except Exception:       # already gone
                pass
        ray.util.remove_placement_group(self.placement_groups[slot])
        try:
            self._start_gang(ray, slot)
        except RuntimeError as e:
            raise ReplaceUnsupported(f"no replacement for slot {slot}: {e}", retry=True) from None
        return self.addresses[slot]

    def _new_actor(self, ray, slot: int, gang=None):
        """An actor for process `slot` (its index among all); `gang`: (placement group, bundle)."""
        from mpmd.runtime.worker.main import xla_flags
        env = dict(self.runtime_env)
        env_vars = dict(env.get("env_vars") or {})
        env_vars["XLA_FLAGS"] = xla_flags(self.devices_per_worker,
                                          env_vars.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")))
        env["env_vars"] = env_vars
        options = dict(self._actor_options(), max_restarts=0, runtime_env=env)
        if gang is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=gang[0], placement_group_bundle_index=gang[1])
        cls = ray.remote(**options)(_SliceActor)
        return cls.remote(self._token, self._listen_host, os.getcwd(), slot, self.threads_per_worker,
                          self._running_root, self.shared, gang is not None)

    def _wait_ready(self, ray, actors) -> list[tuple[str, int]]:
        from ray.exceptions import GetTimeoutError, RayActorError
        try:
            return ray.get([a.ready.remote() for a in actors], timeout=START_TIMEOUT_S)
        except GetTimeoutError:
            raise RuntimeError(f"Ray did not start {len(actors)} worker actor(s) within {START_TIMEOUT_S:g} s; "
                               f"each asks for {self._actor_options()} and the cluster has "
                               f"{ray.available_resources()} available") from None
        except RayActorError as e:
            raise RuntimeError(f"a Ray worker actor failed to start: {e}") from None

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

    processes_per_slice: k > 1 makes each slice a gang of k actors (runtime/worker/gang.py) in a
        placement group of its own: k bundles, STRICT_SPREAD over nodes when the cluster has
        k or more (one host per process), else PACK; a lost actor loses its slice, whose
        group is removed (its actors killed) and reserved again for a new gang.
    A lost slice is replaced by a new actor in the same slot (`replace(slice_index)`, which
    the Trainer calls when it recovers); spare workers are not needed.
    """

    def __init__(self, num_workers: int | None = None, *, resources_per_worker: dict | None = None,
                 address: str | None = None, devices_per_worker: int = 1, threads_per_worker: int = 1,
                 host: str | None = None, runtime_env: dict | None = None, connect_timeout_s: float = 30.0,
                 failure_timeout_s: float = 5.0, step_timeout_s: float | None = None,
                 root: str | None = None, gpus: bool = False, processes_per_slice: int = 1):
        token = new_token()
        launcher = RayLauncher(token, num_workers=num_workers, resources_per_worker=resources_per_worker,
                               address=address, devices_per_worker=devices_per_worker,
                               threads_per_worker=threads_per_worker, host=host, runtime_env=runtime_env, root=root,
                               gpus=gpus, processes_per_slice=processes_per_slice)
        super().__init__(launcher, token, connect_timeout_s=connect_timeout_s, failure_timeout_s=failure_timeout_s,
                         step_timeout_s=step_timeout_s)

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
        """Per slot of a gang, its Ray placement group (replaced with the gang)."""
        return self.launcher.placement_groups

    def gang_pids(self, slot: int) -> list[int]:
        k = self.launcher.processes_per_slice
        return self.launcher.pids[slot * k:(slot + 1) * k]
