"""A multi-node Ray cluster on this one machine, for the tests and benchmarks of Ray across
nodes: a head with 0 CPUs (as a real cluster's head often is: it schedules nothing) and
nodes of a few CPUs each, every one a real `ray start --block` in its own process group,
so that losing a node is a SIGKILL of that group (its raylet and every worker on it), by pid.

Ray's session files go to a temp dir of the cluster's own (`--temp-dir`), so nothing here
meets another Ray user of the machine; Ray's token authentication is off
(RAY_AUTH_MODE=disabled: loopback only, see README's Ray section), and the head declares a
node dead after about two seconds of failed health checks (Ray's default is ~15 s).

`RayNodes(0, head_cpus=4)` is the one-machine Ray instance of tests/runtime/test_ray.py and
test_gang_ray.py: started by `ray start` in a process of its own rather than by `ray.init`
in the test's process, whose raylet Ray forks with a Python preexec_fn from a process that
runs JAX's and gRPC's threads (once in a full suite run, 2026-12-07, the fork died with a
segfault and took the pytest worker with it; the module's later starts then timed out).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from mpmd.runtime.launchers.workers import free_port

# Ray's own knobs, for every process of the cluster and for the driver that joins it.
ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}
START_TIMEOUT_S = 120.0


class RayNodes:
    """`RayNodes(num_nodes, cpus_per_node)`: the head (`head_cpus`, 0 by default) and that
    many nodes, each a `ray start --block` process group; `address` to join it. `add(cpus)` starts one more
    node and returns its pid (the group's); `kill(pid)` SIGKILLs a node's group; `close()`
    stops them all, by process group. This process stays connected to it as Ray's driver
    (a RayCluster made here joins that connection)."""

    def __init__(self, num_nodes: int, cpus_per_node: int = 1, head_cpus: int = 0):
        self.temp_dir = tempfile.mkdtemp(prefix="mpmd-ray-")
        self.env = {**os.environ, **ENV}
        self._saved_env = {k: os.environ.get(k) for k in ENV}
        os.environ.update(ENV)  # the driver (this process) joins as the nodes do
        self.port = free_port("127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []  # the head first
        try:
            self._start(
                [
                    "--head",
                    f"--port={self.port}",
                    f"--num-cpus={head_cpus}",
                    "--include-dashboard=false",
                    f"--temp-dir={self.temp_dir}",
                    f"--ray-client-server-port={free_port('127.0.0.1')}",
                ],
                expect=1,
            )
            for _ in range(num_nodes):
                self.add(cpus_per_node)
        except BaseException:
            self.close()
            raise

    def add(self, cpus: int = 1) -> int:
        """Start one more node of `cpus` CPUs; its pid once the head counts it alive."""
        return self._start([f"--address={self.address}", f"--num-cpus={cpus}"], expect=len(self.alive()) + 1).pid

    def kill(self, pid: int) -> None:
        """Lose node `pid` as a machine is lost: SIGKILL to its whole process group."""
        os.killpg(pid, signal.SIGKILL)
        next(p for p in self.nodes if p.pid == pid).wait()

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until the head counts alive exactly the nodes still running (a killed node is
        declared dead a few health checks after its SIGKILL)."""
        deadline = time.monotonic() + timeout_s
        while self._count_alive() != len(self.alive()):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the head still counts {self._count_alive()} node(s) alive, "
                    f"{len(self.alive())} running, after {timeout_s:g} s"
                )
            time.sleep(0.2)

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.nodes if p.poll() is None]

    def node_of(self, pid: int) -> int | None:
        """The node (its pid) a process runs on: the node whose process group holds the
        process's raylet (Ray's workers are in sessions of their own, its raylet is not)."""
        groups = {p.pid for p in self.alive()}
        while pid > 1:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                return None
            if int(fields[2]) in groups:  # pgrp
                return int(fields[2])
            pid = int(fields[1])  # ppid
        return None

    def _start(self, args: list[str], expect: int) -> subprocess.Popen:
        # `ray` beside this interpreter: the venv's, whatever PATH says.
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        proc = subprocess.Popen(
            [ray, "start", "--node-ip-address=127.0.0.1", "--disable-usage-stats", "--block", *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.nodes.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._count_alive() < expect:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"`ray start {' '.join(args)}` did not join within {START_TIMEOUT_S:g} s "
                    f"(exit code {proc.poll()}); Ray's logs: {self.temp_dir}"
                )
            time.sleep(0.5)
        return proc

    def _count_alive(self) -> int:
        """Nodes the head counts alive, asked through this process's own Ray connection (made
        once the head answers: RayCluster then joins it rather than connecting again)."""
        import ray

        if not ray.is_initialized():
            try:
                ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
            except ConnectionError:
                return 0
        return sum(1 for n in ray.nodes() if n["Alive"])

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(self.nodes):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
