"""A worker process: `mpmd worker --listen HOST:PORT --token-file F [--root DIR]` (or started
by LocalCluster).

It hosts one slice: a gRPC control-plane server (runtime/worker/service.py) and a transfer server
for the data plane. It needs none of the user's model code: programs arrive serialized.
It saves and restores checkpoints only below `--root` (default: the directory it was
started in), fixed for its lifetime: no RPC can move it.

Lifetime. It exits cleanly when the controller asks (Shutdown), on SIGINT/SIGTERM, and when
its controller is gone:
- started by LocalCluster (`--token-stdin`): the token arrives on stdin and stdin stays open;
  end-of-file means the controller process is gone (even after SIGKILL, the kernel closes
  the pipe), and the worker exits at once;
- started by hand: once a controller has attached (Setup), a silence longer than `--lease-s`
  (the controller heartbeats every second or so) means it is gone; the worker exits, or with
  `--persist` drops its state and waits for the next controller.
- shared (`--shared`, started by a cluster manager, runtime/manager/core.py): it serves several
  jobs at once, one session each (runtime/worker/sessions.py), and never exits because a job went
  away: a job silent for its session's lease (`--lease-s` unless OpenSession names one)
  loses that session only. It exits on the manager's Shutdown or a signal.

Compiled programs are kept across sessions and Setups, up to `--compile-cache-mb` of
serialized programs (runtime/worker/compile_cache.py).

Logs. Everything the worker logs (its own records, Orbax's, JAX's, Python warnings) goes to
stderr at `--log-level` (LocalCluster points stderr at <run_dir>/logs/worker_<slot>.log). With
`--relay-level`, each record at or above that level is also printed on stdout as one line
`MPMD_LOG <levelno> <text>`, which the launcher that reads stdout reports on the controller's
console (runtime/launchers/local.py).

Threads. XLA's CPU runtime would otherwise use every core in each process, and two such
processes on two cores thrash. Eigen's intra-op pool is switched off and the process can be
pinned to chosen cores (`--cpus 0,1`).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import stat
import sys
import threading
import time

from mpmd.runtime.worker.compile_cache import DEFAULT_LIMIT_MB

READY = "MPMD_WORKER_READY"
RELAY = "MPMD_LOG"  # a log record relayed on stdout: "MPMD_LOG <levelno> <text>"
LOG_LEVELS = ("debug", "info", "warning", "error")
# Loggers whose warnings are JAX's backend start-up notes (a GPU or TPU it could use but has no
# plugin for): about the machine, not the run, and printed by every process that starts JAX.
# They reach the console only at level info or below; the log files always hold them.
STARTUP_LOGGERS = ("jax._src.xla_bridge",)


def parser() -> argparse.ArgumentParser:
    """`mpmd worker`'s arguments (docs/reference/cli.md is made from it)."""
    p = argparse.ArgumentParser(prog="mpmd worker", description="Serve one mpmd slice.")
    p.add_argument(
        "--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (default 127.0.0.1:0: loopback, any free port)"
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--token-file", help="file whose first line is the cluster token")
    p.add_argument(
        "--allow-insecure-token-file",
        action="store_true",
        help="accept a --token-file that its group or others may read",
    )
    g.add_argument(
        "--token-stdin", action="store_true", help="read the token from stdin's first line; exit when stdin closes"
    )
    p.add_argument(
        "--tls",
        default=None,
        metavar="DIR",
        help="serve over mutual TLS with the cluster's certificates in DIR (ca.pem, cert.pem, "
        "key.pem; `mpmd cluster certs DIR` makes them; '-': one line on stdin after the token, "
        "as a launcher gives them): only a caller holding a certificate of the same authority "
        "gets past the handshake (default: in the clear)",
    )
    p.add_argument(
        "--root",
        default=None,
        help="the only directory tree checkpoint saves and restores may touch; the "
        "controller's run_dir must lie below it (default: the current directory)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="devices of this slice's mesh: on CPU, this many host devices; on GPU, the "
        "GPUs in CUDA_VISIBLE_DEVICES (LocalCluster gives each worker its own)",
    )
    p.add_argument("--cpus", default="", help="comma-separated cores to pin to (default: no pinning)")
    p.add_argument(
        "--lease-s",
        type=float,
        default=15.0,
        help="exit after this long without a word from an attached controller (with "
        "--shared: close a job's session after this long without a word from the job, "
        "unless its OpenSession names another lease)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="the least level logged to stderr, from every logger (default info)",
    )
    p.add_argument(
        "--relay-level",
        default=None,
        choices=LOG_LEVELS,
        help="also print each record at or above this level on stdout as one line "
        f"'{RELAY} <levelno> <text>', for the controller that started this worker",
    )
    p.add_argument(
        "--persist",
        action="store_true",
        help="when the controller's lease lapses, reset and wait for another instead of exiting",
    )
    p.add_argument(
        "--shared",
        action="store_true",
        help="serve several jobs of a shared cluster, one session each (opened by the cluster "
        "manager with the cluster token; each job calls with its own credential); a job's "
        "silence closes its session only",
    )
    p.add_argument(
        "--compile-cache-mb",
        type=float,
        default=DEFAULT_LIMIT_MB,
        help=f"keep loaded programs, across sessions, up to this many MB of serialized programs "
        f"(least recently used out first; default {DEFAULT_LIMIT_MB})",
    )
    gang = p.add_argument_group(
        "gang",
        "one process of a slice that spans several processes (hosts): the "
        "slice's processes form one JAX distributed group before serving",
    )
    gang.add_argument(
        "--coordinator", default="", help="HOST:PORT of the slice's JAX coordinator (process 0 of the gang serves it)"
    )
    gang.add_argument("--num-processes", type=int, default=1, help="processes in this slice's gang (default 1)")
    gang.add_argument("--process-id", type=int, default=0, help="this process's index in its gang, 0-based")
    gang.add_argument(
        "--gang-timeout-s", type=float, default=60.0, help="how long to wait for every process of the gang to join"
    )
    return p


def parse_args(argv):
    p = parser()
    args = p.parse_args(argv)
    if args.devices < 1:
        p.error(f"--devices must be a positive integer, got {args.devices}")
    if not 0 < args.lease_s < float("inf"):
        p.error(f"--lease-s must be a positive number of seconds, got {args.lease_s}")
    if not 0 <= args.compile_cache_mb < float("inf"):
        p.error(f"--compile-cache-mb must be a number of MB >= 0 (0: keep none), got {args.compile_cache_mb}")
    if args.shared and args.persist:
        p.error("--persist is for a worker serving one controller; a --shared worker always outlives its jobs")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        p.error(
            f"--process-id must be in 0..--num-processes-1 and --num-processes >= 1, got "
            f"{args.process_id} of {args.num_processes}"
        )
    if args.num_processes > 1 and not args.coordinator:
        p.error("a gang (--num-processes > 1) needs --coordinator HOST:PORT")
    if args.tls == "-" and not args.token_stdin:
        p.error("--tls - reads the certificates from stdin after the token: it needs --token-stdin")
    if args.num_processes > 1 and args.shared:
        p.error("a --shared worker serves a slice of one process; gangs (--num-processes > 1) are not shared")
    return args


def xla_flags(devices: int, flags: str = "") -> str:
    """flags with this slice's host device count and Eigen's intra-op pool switched off. (On GPU
    the host count is harmless and unused: the slice's devices are its GPUs.)"""
    flags = " ".join(
        f
        for f in flags.split()
        if not f.startswith(("--xla_force_host_platform_device_count", "--xla_cpu_multi_thread_eigen"))
    )
    return (f"{flags} --xla_force_host_platform_device_count={devices} --xla_cpu_multi_thread_eigen=false").strip()


def cores_for(slot: int, threads: int, available=None) -> list[int]:
    """The cores worker `slot` pins to: `threads` of them, round-robin over the available ones.

    How many cores a worker sees also sets how XLA's CPU runtime splits an op across threads,
    hence its float rounding: workers pinned alike compute alike, bit for bit, wherever they run.
    """
    ordered = sorted(available if available is not None else os.sched_getaffinity(0))
    return sorted({ordered[(slot * threads + t) % len(ordered)] for t in range(threads)})


def configure_process(devices: int, cpus: str) -> None:
    """Must run before JAX is imported in this process."""
    os.environ["XLA_FLAGS"] = xla_flags(devices, os.environ.get("XLA_FLAGS", ""))
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def read_token(args) -> str:
    if args.token_stdin:
        token = sys.stdin.readline().strip()
    else:
        try:
            token = read_token_file(
                args.token_file, args.allow_insecure_token_file, "--token-file", "--allow-insecure-token-file"
            )
        except ValueError as e:
            raise SystemExit(f"error: {e}")
    if len(token) < 16:
        raise SystemExit("error: the token must be at least 16 characters")
    return token


def read_tls(directory: str | None):
    """The Tls of --tls DIR (runtime/wire/tls.py), None without it; exits with one error line
    naming what is missing or wrong."""
    if directory is None:
        return None
    from mpmd.runtime.wire.tls import from_line, load

    try:
        return from_line(sys.stdin.readline()) if directory == "-" else load(directory, "--tls")
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def read_token_file(path: str, allow_insecure: bool, what: str, escape: str) -> str:
    """The first line of a token file. ValueError if it cannot be read, or if its group or
    others may read or write it (anyone who can read the token can drive the workers) and
    not `allow_insecure`. `what` names the argument, `escape` the way to allow it anyway."""
    try:
        with open(path) as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.readline().strip()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and not allow_insecure:
        raise ValueError(
            f"{what} {path!r} has mode {stat.S_IMODE(mode):04o}: its group or others may read "
            f"it, and the token is the key to the workers; `chmod 600 {path}` "
            f"(or pass {escape} to accept it)"
        )
    return token


def on_console(record: logging.LogRecord, level: int) -> bool:
    """Whether a record belongs on a console showing `level` and up (JAX's backend start-up
    notes only at info and below)."""
    if record.levelno < level:
        return False
    return level <= logging.INFO or record.levelno >= logging.ERROR or not record.name.startswith(STARTUP_LOGGERS)


def one_line(text: str) -> str:
    """A message as one line: its first line, and its last when there are more (a traceback's
    last line names the exception)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        return f"{lines[0]} ... {lines[-1]}"
    return lines[0] if lines else ""


class Relay(logging.Handler):
    """Hands each record it is shown, as one line, to `sink(levelno, text)`: a local worker
    prints it on stdout for its launcher (print_relayed, see --relay-level); a Ray actor keeps
    it until its launcher asks (runtime/launchers/ray.py)."""

    def __init__(self, level, sink):
        super().__init__(level)
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if not on_console(record, self.level):
            return
        try:
            self._sink(record.levelno, one_line(self.format(record)))
        except OSError:
            pass  # the reader is gone (the controller died): the log file has the record
        except Exception:
            self.handleError(record)


def print_relayed(levelno: int, text: str) -> None:
    """A relayed record as the line LocalLauncher reads on this worker's stdout."""
    sys.stdout.write(f"{RELAY} {levelno} {text}\n")
    sys.stdout.flush()


def configure_logging(level: str, relay_level: str | None, sink=print_relayed) -> None:
    """Every logger to stderr at `level`; Python warnings as log records; the relay to
    `sink`, if asked."""
    stderr = logging.StreamHandler()
    stderr.setLevel(level.upper())
    stderr.setFormatter(logging.Formatter("%(asctime)s worker[%(process)d] %(levelname)s %(message)s"))
    handlers = [stderr]
    if relay_level is not None:
        handlers.append(Relay(relay_level.upper(), sink))
        handlers[-1].setFormatter(logging.Formatter("%(message)s"))
    logging.basicConfig(level=min(h.level for h in handlers), handlers=handlers)
    logging.captureWarnings(True)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level, args.relay_level)
    token = read_token(args)
    tls = read_tls(args.tls)
    configure_process(args.devices, args.cpus)
    if args.num_processes > 1:
        from mpmd.runtime.worker.gang import announce_leaving, follow_peers, join, leave

        join(args.coordinator, args.num_processes, args.process_id, args.gang_timeout_s)

    from mpmd.runtime.worker.compile_cache import CompileCache
    from mpmd.runtime.worker.service import WorkerService

    done = threading.Event()
    reason = []

    def stop(why: str):
        if args.persist and why == "controller asked":
            logging.info("controller detached: resetting, waiting for the next")
            service.reset()
            return
        if not done.is_set():
            reason.append(why)
            done.set()

    service = WorkerService(
        token,
        stop,
        root=args.root,
        shared=args.shared,
        lease_s=args.lease_s,
        cache=CompileCache(int(args.compile_cache_mb * 2**20)),
    )
    try:
        server, address = serve(service.handler(), args.listen, SHARED_RPC_THREADS if args.shared else RPC_THREADS, tls)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # A handler only notes the signal: it runs on the main thread between two bytecodes, maybe
    # while that thread holds `done`'s lock inside done.wait(), so done.set() there could wait
    # for itself forever (a worker sent SIGINT once hung so). The loop below polls the note.
    signalled = []
    signal.signal(signal.SIGTERM, lambda *_: signalled.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: signalled.append("SIGINT"))
    # `kill -USR1 <pid>` prints every thread's stack on stderr (the worker's log) and goes on:
    # how to see where a worker that seems hung is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.token_stdin:
        threading.Thread(target=lambda: (sys.stdin.read(), stop("controller gone (stdin closed)")), daemon=True).start()
    if args.num_processes > 1:
        follow_peers(stop)  # a gang leaves as one: a peer that leaves stops this process too
    print(f"{READY} {address}", flush=True)
    logging.info(
        "serving %s on %s; %s; checkpoints confined to %s",
        "a shared cluster's jobs" if args.shared else "slice",
        address,
        "mutual TLS" if tls else "in the clear",
        service.root,
    )
    while not done.wait(SIGNAL_POLL_S):
        if signalled:
            stop(signalled[0])
        elif args.shared:
            service.lapse()
        elif service.attached and time.monotonic() - service.last_contact > args.lease_s:
            if args.persist:
                logging.warning("controller silent for %.0f s: resetting, waiting for the next", args.lease_s)
                service.reset()
            else:
                stop(f"controller silent for {args.lease_s:.0f} s")
    logging.info("shutting down: %s", reason[0] if reason else "")
    if args.num_processes > 1:
        announce_leaving(args.process_id, reason[0] if reason else "")
    server.stop(grace=1.0).wait(2.0)
    service.close()
    if args.num_processes > 1:
        leave(GANG_LEAVE_WAIT_S)
    # Daemon threads may still hold XLA resources; leave without running their teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# How often the main loop looks for a signal noted by its handler (the latency it adds to
# a SIGTERM or Ctrl-C), and for a lapsed lease.
SIGNAL_POLL_S = 0.1

# How long a gang process waits at exit for the others to leave the distributed group with it
# (gang.leave); under LocalLauncher.stop's 5 s before it kills.
GANG_LEAVE_WAIT_S = 3.0

# RPC threads. Several: Heartbeat and Abort must be served while a Run is executing (and a
# run-ahead Run waits in its thread behind it). A shared worker serves several jobs, each
# with its own Runs in flight, plus the manager.
RPC_THREADS, SHARED_RPC_THREADS = 8, 32


def serve(handler, listen: str, threads: int = RPC_THREADS, tls=None):
    """Serve `handler` (a grpc.GenericRpcHandler: a WorkerService's .handler(), or the cluster
    manager's) over gRPC on listen (HOST:PORT, port 0 = any free one) with `threads` RPC
    threads, over mutual TLS with `tls` (runtime/wire/tls.py: only a client holding a
    certificate of the cluster's authority gets past the handshake), else in the clear;
    returns (started server, "host:port"). Raises OSError if it cannot bind. Shared by this
    process's main, the Ray actor of runtime/launchers/ray.py and runtime/manager/core.py."""
    import grpc
    from concurrent import futures
    from mpmd.runtime.worker.service import SERVER_OPTIONS

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mpmd-rpc"), options=SERVER_OPTIONS
    )
    server.add_generic_rpc_handlers((handler,))
    host = listen.rpartition(":")[0]
    try:
        bound = server.add_secure_port(listen, tls.server_credentials()) if tls else server.add_insecure_port(listen)
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(
            f"cannot listen on {listen!r}: the address is in use (another worker there?) or not this machine's"
        )
    server.start()
    return server, f"{host or '127.0.0.1'}:{bound}"


if __name__ == "__main__":
    sys.exit(main())
