"""TransferTransport latency and bandwidth between two worker processes, by path, beside memcpy.

    .venv/bin/python benchmarks/bench_transport.py [--paths socket,shm] [--platform cpu]

For each path (runtime/wire/transport.py: "socket" = jax.experimental.transfer over loopback
TCP, "shm" = shared memory, runtime/wire/shm.py, its host staging as auto picks it;
"shm+pinned" / "shm+pageable" = shared memory with host staging forced one way: through
pinned host memory, or not) two worker processes (each pinned to its own core, XLA
single-threaded on CPU; on a GPU both use GPU 0, as gpu_suite.py runs it: `--platform cuda`)
play ping-pong with the transport: slice 0 sends a float32
payload, slice 1 receives it and sends it back. The one-way time is half a round trip, so it
includes send, pull, the wire and the receiver seeing the array ready. The numpy memcpy
bandwidth (into a warm destination) is measured in this same run on this machine, and so is
raw loopback TCP between two processes pinned the same way (the socket path's ceiling);
bandwidth = payload bytes / one-way time.
Goals: socket >= 0.3x memcpy at 64 MB, <= 1 ms one-way at 1 MB; shm >= 0.5x memcpy at 64 MB.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SIZES_MB = (1, 16, 64)
NUM_WARMUP = 3
NUM_RUNS = {1: 50, 16: 20, 64: 10}
PATHS = ("socket", "shm", "shm+pinned", "shm+pageable")
DEFAULT_PATHS = ("socket", "shm")


def worker(slice_index: int, path: str, sizes_mb: tuple[int, ...] = SIZES_MB) -> None:
    import jax
    from mpmd.runtime.worker.instructions import Spec
    from mpmd.runtime.worker.mesh import bind
    from mpmd.runtime.wire.transport import TransferTransport

    peer = 1 - slice_index
    device = jax.devices()[0]
    mode, _, staging = path.partition("+")
    transport = TransferTransport(
        slice_index,
        bind((1, 1, 1), [device]),
        secret=b"bench-transfer-secret",
        transport=mode,
        host_staging=staging or "auto",
    )
    print(json.dumps({"address": transport.address}), flush=True)
    transport.connect_peers({peer: json.loads(sys.stdin.readline())["address"]})
    assert transport.path(peer) == mode, (transport.path(peer), mode)
    # A sender picks shared memory for a peer once that peer has connected to it: as the
    # controller does (every Connect returns before any step), both wait until both are.
    print(json.dumps({"connected": True}), flush=True)
    sys.stdin.readline()
    results = {}
    for size_mb in sizes_mb:
        spec = (Spec((size_mb * 2**20 // 4,), "float32"),)
        payload = (jax.device_put(np.arange(spec[0].shape[0], dtype=np.float32), device),)
        one_way_s = []
        for i in range(NUM_WARMUP + NUM_RUNS.get(size_mb, 10)):
            ping, pong = f"{size_mb}MB/{i}/ping", f"{size_mb}MB/{i}/pong"
            if slice_index == 0:
                back = transport.recv(pong, peer, spec)  # posted before the send
                start = time.perf_counter()
                transport.send(ping, payload, peer)
                echoed = back.result()
                one_way_s.append((time.perf_counter() - start) / 2)
            else:
                echoed = transport.recv(ping, peer, spec).result()
                transport.send(pong, echoed, peer)
        if slice_index == 0:
            assert np.array_equal(np.asarray(echoed[0]), np.asarray(payload[0]))
            results[size_mb] = statistics.median(one_way_s[NUM_WARMUP:])
    print(json.dumps(results), flush=True)
    sys.stdin.readline()  # stay up until told to go
    transport.close()


def memcpy_s(size_mb: int, num_runs: int = 20) -> float:
    src = np.ones(size_mb * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(num_runs):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tcp_one_way_s(size_mb: int, num_runs: int = 8) -> float:
    """Raw loopback TCP, one process per core: send the payload, wait for a 1-byte ack."""
    num_bytes = size_mb * 2**20
    listener = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:  # receiver
        os.sched_setaffinity(0, {1 % os.cpu_count()})
        conn = socket.create_connection(listener.getsockname())
        buf = memoryview(bytearray(num_bytes))
        for _ in range(num_runs):
            got = 0
            while got < num_bytes:
                got += conn.recv_into(buf[got:], num_bytes - got)
            conn.sendall(b"k")
        os._exit(0)
    os.sched_setaffinity(0, {0})
    conn, _ = listener.accept()
    data, times = bytes(num_bytes), []
    for _ in range(num_runs):
        start = time.perf_counter()
        conn.sendall(data)
        conn.recv(1)
        times.append(time.perf_counter() - start)
    os.waitpid(pid, 0)
    os.sched_setaffinity(0, range(os.cpu_count()))
    return statistics.median(times)


def one_way_by_size(path: str, platform: str = "cpu", sizes_mb: tuple[int, ...] = SIZES_MB) -> dict[int, float]:
    """{payload MB: median one-way seconds} of a worker pair on `path`, on `platform`'s
    first device (cpu, or cuda: both workers on GPU 0, memory taken on demand)."""
    env = dict(os.environ, JAX_PLATFORMS=platform, PYTHONPATH=str(REPO))
    if platform == "cpu":
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    else:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    procs = []
    try:
        for i in range(2):
            cpu = i % os.cpu_count()
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", str(i), path, ",".join(map(str, sizes_mb)), str(cpu)],
                    env=env,
                    text=True,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
            )
        addresses = [p.stdout.readline() for p in procs]
        for p, peer_line in zip(procs, reversed(addresses)):
            p.stdin.write(peer_line)
            p.stdin.flush()
        for p in procs:  # both connected before either sends
            p.stdout.readline()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        one_way_s = {int(k): v for k, v in json.loads(procs[0].stdout.readline()).items()}
        procs[1].stdout.readline()
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by pid
                p.wait()
    return one_way_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help="comma-separated, of: " + ", ".join(PATHS))
    parser.add_argument("--platform", default="cpu", choices=("cpu", "cuda"), help="the workers' JAX platform")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if not paths or any(p not in PATHS for p in paths):
        parser.error(f"--paths takes {', '.join(PATHS)}, got {','.join(paths)}")
    one_way_s = {path: one_way_by_size(path, args.platform) for path in paths}
    print(
        f"{'payload':>8} {'path':>12} {'one-way ms':>11} {'transfer GB/s':>14} {'memcpy GB/s':>12} "
        f"{'x memcpy':>9} {'raw TCP GB/s':>13} {'x TCP':>6}"
    )
    for size_mb in SIZES_MB:
        num_bytes = size_mb * 2**20
        memcpy_bps = num_bytes / memcpy_s(size_mb)
        tcp_bps = num_bytes / tcp_one_way_s(size_mb)
        for path in paths:
            transfer_bps = num_bytes / one_way_s[path][size_mb]
            print(
                f"{size_mb:>6}MB {path:>12} {one_way_s[path][size_mb] * 1e3:>11.3f} {transfer_bps / 1e9:>14.2f} "
                f"{memcpy_bps / 1e9:>12.2f} {transfer_bps / memcpy_bps:>9.2f} "
                f"{tcp_bps / 1e9:>13.2f} {transfer_bps / tcp_bps:>6.2f}"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where it waits
        # Pinned by itself, before JAX starts: a preexec_fn would run Python in a child forked
        # from a parent with JAX's and gRPC's threads (gpu_suite.py), where it can crash.
        os.sched_setaffinity(0, {int(sys.argv[5])})
        worker(int(sys.argv[2]), sys.argv[3], tuple(int(mb) for mb in sys.argv[4].split(",")))
    else:
        main()
