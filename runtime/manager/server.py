"""The shared cluster's manager process: `python -m mpmd.runtime.manager.server` (started by
`mpmd cluster up`). Its gRPC service routes each verb of runtime/wire/verbs.py's MANAGER_VERBS
to the Manager (runtime/manager/core.py, which holds the state and decides) once the caller's
credential fits the verb; POOLS are where the workers can run; main starts the pool (or takes
over a running one, --rejoin), the Manager and the server.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Callable, NamedTuple

import grpc

from mpmd.runtime.wire import credentials
from mpmd.runtime.wire import format as wire
from mpmd.runtime.wire import verbs
from mpmd.runtime.worker.service import TOKEN_KEY
from mpmd.runtime.manager.core import MAX_LEASE_S, METHODS, SERVICE, Manager, ShuttingDown, UnknownJob
from mpmd.runtime.manager.worker_pool import RayWorkerPool, WorkerPool
from mpmd.runtime.wire.tls import TLS_DIR, load as load_tls

log = logging.getLogger("mpmd.manager")


class Handler(grpc.GenericRpcHandler):
    """Routes by method and metadata before the body is read: a call without an acceptable
    credential gets a handler that never reads its request stream."""

    def __init__(self, manager: Manager):
        self._m = manager

    def service(self, details: grpc.HandlerCallDetails):
        name = details.method.rpartition("/")[2]
        if details.method != f"/{SERVICE}/{name}" or name not in METHODS:
            return None
        token = dict(details.invocation_metadata or ()).get(TOKEN_KEY)
        who = self._m.principal(METHODS[name], token)
        if who is None:
            job = credentials.job_of(token, self._m.cluster_token) if isinstance(token, str) else None

            def refuse(_unread, context):
                if job is not None:  # a real job credential, on a verb that is not a job's
                    log.warning("refused %s from %s: job %s's credential may not call it", name, context.peer(), job)
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{name}: a job's credential may not call it")
                log.warning("refused %s from %s: %s credential", name, context.peer(), "wrong" if token else "no")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{name}: missing or wrong {TOKEN_KEY} for {name}")

            return grpc.stream_unary_rpc_method_handler(refuse)

        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                r = verbs.decode_request(name, wire.decode(request)[0], verbs.MANAGER_VERBS)
                return wire.encode(verbs.encode(self._m.handle(name, who, r)), [])
            except UnknownJob as e:
                context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            except ShuttingDown as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except PermissionError as e:
                log.warning("refused %s from %s: %s", name, context.peer(), e)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            except (ValueError, TypeError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {e}")
            except Exception as e:
                log.exception("%s failed", name)
                context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(e).__name__}: {e}")

        return grpc.unary_unary_rpc_method_handler(call)


class PoolBackend(NamedTuple):
    """Where a shared cluster's workers run (`mpmd cluster up --backend NAME`): start(args,
    token_file, cluster_token, tls) -> the started pool (tls: the cluster's certificates,
    runtime/wire/tls.py, or None); rejoins: a manager started again
    (--rejoin) takes over its workers; options: the `mpmd cluster up` options only it reads."""

    start: Callable[[argparse.Namespace, str, str, object], object]
    rejoins: bool
    options: tuple[str, ...] = ()


def _local_pool(args, token_file: str, cluster_token: str, tls) -> WorkerPool:
    from mpmd.runtime.launchers.local import default_compilation_cache

    pool = WorkerPool(
        directory=args.dir,
        token_file=token_file,
        root=os.path.realpath(args.root or os.getcwd()),
        devices_per_worker=args.devices_per_worker,
        compile_cache_mb=args.compile_cache_mb,
        compilation_cache_dir=default_compilation_cache(),
        tls=tls,
    )
    pool.start(args.workers)
    return pool


def _ray_pool(args, token_file: str, cluster_token: str, tls) -> RayWorkerPool:
    # Its actors belong to the manager's Ray driver and end with it: nothing to rejoin.
    pool = RayWorkerPool(
        directory=args.dir,
        token=cluster_token,
        root=os.path.realpath(args.root or os.getcwd()),
        devices_per_worker=args.devices_per_worker,
        ray_address=args.ray_address,
        compile_cache_mb=args.compile_cache_mb,
        lease_s=args.lease_s,
        tls=tls,
    )
    pool.start(args.workers)
    return pool


POOLS = {
    "local": PoolBackend(_local_pool, rejoins=True),
    "ray": PoolBackend(_ray_pool, rejoins=False, options=("ray_address",)),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mpmd.runtime.manager.server",
        description="A shared cluster's manager (started by `mpmd cluster up`).",
    )
    p.add_argument("--dir", required=True, help="the cluster's directory (tokens, logs, job table)")
    p.add_argument("--file", required=True, help="the cluster file to write")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--devices-per-worker", type=int, default=1)
    p.add_argument("--root", default=None)
    p.add_argument("--lease-s", type=float, default=10.0)
    p.add_argument("--max-lease-s", type=float, default=MAX_LEASE_S)
    p.add_argument("--compile-cache-mb", type=int, default=None)
    p.add_argument("--rejoin", action="store_true", help="take over the workers of the cluster file")
    p.add_argument("--backend", default="local", choices=tuple(POOLS), help="where the workers run")
    p.add_argument("--ray-address", default=None, help="ray: the Ray cluster to join (default: a new local one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s manager[%(process)d] %(levelname)s %(message)s")
    from mpmd.runtime.launchers.workers import default_compilation_cache
    from mpmd.runtime.worker.main import read_token_file, serve

    token_file = os.path.join(args.dir, "cluster.token")
    cluster_token = read_token_file(token_file, False, "cluster token file", "(none)")
    submit_token = read_token_file(os.path.join(args.dir, "submit.token"), False, "submit token file", "(none)")
    # `mpmd cluster up` made the cluster's certificates there unless --no-tls (runtime/wire/tls.py).
    tls_dir = os.path.join(args.dir, TLS_DIR)
    tls = load_tls(tls_dir, "the cluster's certificates") if os.path.isdir(tls_dir) else None
    if args.rejoin:
        with open(args.file) as f:
            saved = json.load(f)
        pool = WorkerPool(
            directory=args.dir,
            token_file=token_file,
            root=saved["root"],
            devices_per_worker=saved.get("devices_per_worker", 1),
            compile_cache_mb=args.compile_cache_mb,
            compilation_cache_dir=default_compilation_cache(),
            tls=tls,
        )
        pool.rejoin(saved["workers"])
    else:
        pool = POOLS[args.backend].start(args, token_file, cluster_token, tls)
    manager = Manager(
        pool,
        cluster_token=cluster_token,
        submit_token=submit_token,
        journal=os.path.join(args.dir, "jobs.json"),
        lease_s=args.lease_s,
        max_lease_s=args.max_lease_s,
    )
    manager.cluster_file = args.file
    if args.rejoin:
        manager.rebuild()
    try:
        manager.server, manager.address = serve(Handler(manager), args.listen, tls=tls)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        pool.stop()
        return 2
    manager.write_cluster_file()
    manager.run_background()
    log.info("serving on %s with %d worker(s); root %s", manager.address, len(pool.workers), pool.root)
    manager.server.wait_for_termination()
    log.info("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
