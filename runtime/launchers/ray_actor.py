"""The body of one RayCluster worker actor (runtime/launchers/ray.py starts it): what `mpmd
worker` hosts (a WorkerService behind mpmd.runtime.worker.main.serve), in the actor's own
process, with its output in the run's log file and its console records kept for the
launcher to fetch. Nothing here runs in the controller's process."""

from __future__ import annotations

import collections
import atexit
import os
import threading
import time

RELAY_KEPT = 1000  # records an actor keeps for the console between fetches, the newest
NODE_IP = "node"  # host= value: listen on the IP of the node the actor lands on


def _log_to(path: str, relay_level: str, relayed: collections.deque) -> None:
    """This actor's stdout and stderr (its logging, Orbax's, JAX's, tracebacks) appended to
    `path`, the run's logs/worker_<slot>.log as a local worker's: Ray then has nothing of it
    to forward to the controller's console. Its records at `relay_level` and up are also kept
    in `relayed`, one line each, for the launcher to fetch (SliceActor.relayed)."""
    import logging
    from mpmd.runtime.worker.main import configure_logging

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    logging.getLogger().handlers.clear()  # Ray's own handlers write to its files
    configure_logging("info", relay_level, sink=lambda levelno, text: relayed.append((levelno, text)))


class SliceActor:
    """The body of one worker actor (wrapped with ray.remote at start time). A process of a
    gang (`gang`: its slot's index among all processes, for pinning) serves only once the
    launcher has given it its gang's coordinator (`join`): JAX's distributed group must be
    formed before anything makes JAX's backend."""

    def __init__(
        self,
        token: str,
        host: str,
        workdir: str,
        slot: int,
        threads: int,
        root: str,
        shared: dict | None = None,
        gang: bool = False,
        log_path: str | None = None,
        relay_level: str = "warning",
        tls=None,
    ):
        import ray
        from mpmd.runtime.worker.main import cores_for

        self._relayed: collections.deque = collections.deque(maxlen=RELAY_KEPT)
        if log_path is not None:
            _log_to(log_path, relay_level, self._relayed)

        # Pinned like a local worker, so both compute the same bits (see cores_for).
        os.sched_setaffinity(0, cores_for(slot, threads))
        # Relative paths the controller sends (checkpoint directories under a relative run_dir)
        # must mean what they mean to it, as for a LocalCluster worker, which inherits its cwd.
        if os.path.isdir(workdir):
            os.chdir(workdir)
        if host == NODE_IP:
            host = ray.util.get_node_ip_address()
        self._token, self._host, self._root, self._tls = token, host, root, tls
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
            self.server, self.address = serve(self.service.handler(), listen, RPC_THREADS, self._tls)
            self._stop_at_exit()
            return
        # A shared cluster's worker (runtime/manager/core.py), as `mpmd worker --shared`: several
        # jobs' sessions, compiled programs kept across them, a silent job's session closed.
        from mpmd.runtime.worker.compile_cache import CompileCache

        shared = self._shared
        self.service = WorkerService(
            self._token,
            self._stop,
            root=self._root,
            shared=True,
            lease_s=shared["lease_s"],
            cache=CompileCache(int(shared["compile_cache_mb"] * 2**20)),
        )
        self.server, self.address = serve(self.service.handler(), listen, SHARED_RPC_THREADS, self._tls)
        self._stop_at_exit()
        threading.Thread(target=self._lapse, daemon=True, name="mpmd-lapse").start()

    def _stop_at_exit(self) -> None:
        """Stop serving, at once, when the actor's process exits (a SIGTERM: Ray raises
        SystemExit): left to the interpreter's last collection, the server's teardown could
        wait as long as the controller's heartbeats and probes kept arriving (10 a second),
        and the process with it."""
        atexit.register(self.server.stop, None)

    def _lapse(self) -> None:
        while True:
            time.sleep(0.5)
            self.service.lapse()

    def ready(self) -> tuple[str, int]:
        """(gRPC address, pid), once the server is up."""
        return self.address, os.getpid()

    def relayed(self) -> list[tuple[int, str]]:
        """The records kept for the console since the last call: (levelno, one line)."""
        out = []
        while self._relayed:
            out.append(self._relayed.popleft())
        return out

    def _stop(self, why: str) -> None:
        # Shutdown RPC: stop serving; the controller kills the actor right after.
        self.server.stop(grace=1.0)
        if self.shared:
            self.service.close()
        elif self.service.transport is not None:
            self.service.transport.close()
