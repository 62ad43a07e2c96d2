"""`mpmd cluster up|status|down`: a persistent cluster that several jobs share;
`mpmd cluster certs DIR`: certificates for workers started by hand.

  mpmd cluster up --workers N [--devices-per-worker D] [--backend local|ray] [--ray-address A]
                  [--listen HOST:PORT]
                  [--dir DIR] [--file F] [--root R] [--lease-s S] [--max-lease-s S]
                  [--compile-cache-mb M] [--rejoin]
  mpmd cluster status [--file F] [--json]
  mpmd cluster down [--file F]
  mpmd cluster certs DIR

`up` writes two secrets into DIR (default .mpmd-cluster), each 0600: the cluster token (the
manager's and workers' own) and the submit token (what users hold); it starts the manager
(runtime/manager/core.py) as a detached process, which starts and owns the N workers and writes
the cluster file F (default ./mpmd-cluster.json, 0600: the manager's address, the submit
token, the workers' addresses and pids, the root); `up` prints the address and returns,
and the cluster lives on. Unless --no-tls, `up` also makes the cluster's own certificate
authority in DIR/tls (runtime/wire/tls.py): the manager, the workers and every job speak
mutual TLS, and the cluster file names the directory. With --rejoin it starts a manager again over the workers of an
existing cluster file (after the manager died): running jobs keep their leases.
Jobs: `mpmd train CONFIG cluster.backend=shared` (cluster.file, or cluster.address).
`down` stops the workers and the manager and waits until every one of their pids is gone,
replacements started meanwhile included, before it removes the cluster file; a job running
on the cluster ends within seconds, saying the cluster was shut down.
Exit status: 0 done, 2 bad arguments (one line "error: ..."), 1 the cluster failed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time

from mpmd.runtime.launchers.workers import process_alive
from mpmd.runtime.launchers.shared import DEFAULT_CLUSTER_FILE, MANAGER_SERVICE, read_cluster_file
from mpmd.runtime.manager.server import POOLS
from mpmd.runtime.worker.compile_cache import DEFAULT_LIMIT_MB
from mpmd.runtime.wire.tls import FILES as TLS_FILES, TLS_DIR, load as load_tls, make as make_tls
from mpmd.recipes.commands.arguments import non_negative, positive

# Where a shared cluster's workers may run: the manager's table of worker pools.
BACKENDS = tuple(POOLS)
UP_TIMEOUT_S = 120.0
LISTEN_DEFAULT = "127.0.0.1:0"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpmd cluster",
        description="A persistent cluster that several jobs share (mpmd cluster VERB --help: its options).",
        epilog="example:\n  mpmd cluster up --workers 2\n  mpmd train configs/gpt_tiny.yaml cluster.backend=shared\n"
        "  mpmd cluster status\n  mpmd cluster down",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="verb", required=True)
    up = sub.add_parser(
        "up",
        help="start the manager and its workers (detached)",
        description="Start the cluster manager and its workers as detached processes; print the manager's\n"
        "address and return. Writes DIR/ (the cluster and submit tokens, 0600; logs; the job table)\n"
        "and the cluster file F (0600): what jobs read to submit.",
        epilog="examples:\n  mpmd cluster up --workers 4\n"
        "  mpmd cluster up --workers 2 --devices-per-worker 2 --listen 0.0.0.0:7000 --root /data/runs\n"
        "  mpmd cluster up --rejoin          # a manager again over the cluster file's workers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("--workers", type=positive(int), help="worker processes (one slice each); not with --rejoin")
    up.add_argument(
        "--devices-per-worker", type=positive(int), default=1, help="devices of each worker's mesh (default 1)"
    )
    up.add_argument("--backend", default="local", help=f"where workers run: {', '.join(BACKENDS)} (default local)")
    up.add_argument(
        "--ray-address",
        default=None,
        help="ray: the Ray cluster to join ('auto', 'HEAD_IP:6379'; default: a new one on this machine)",
    )
    up.add_argument(
        "--listen",
        default=LISTEN_DEFAULT,
        help="the manager's HOST:PORT (default loopback, any port; with --rejoin: the one it had)",
    )
    up.add_argument(
        "--dir",
        default=".mpmd-cluster",
        help="the cluster's directory: tokens, logs, job table (default .mpmd-cluster)",
    )
    up.add_argument("--root", default=None, help="the directory every job's run_dir must lie below (default: cwd)")
    up.add_argument(
        "--lease-s", type=positive(float), default=10.0, help="default lease of a job, seconds (default 10)"
    )
    up.add_argument(
        "--max-lease-s",
        type=positive(float),
        default=60.0,
        help="the longest lease a job may ask, seconds: a silent job holds workers at most this long (default 60)",
    )
    up.add_argument(
        "--compile-cache-mb",
        type=non_negative(int),
        default=None,
        help=f"each worker's compiled-program cache, MB (default {DEFAULT_LIMIT_MB})",
    )
    up.add_argument("--rejoin", action="store_true", help="start a manager again over the cluster file's workers")
    up.add_argument(
        "--no-tls",
        action="store_true",
        help="serve the manager and workers in the clear (default: mutual TLS with an authority made "
        "for this cluster, its certificates in DIR/tls; jobs find them through the cluster file)",
    )
    certs = sub.add_parser(
        "certs",
        help="make a cluster's certificate authority and member certificate (for static workers)",
        description="Make a new certificate authority and one member certificate signed by it in DIR\n"
        "(ca.pem, cert.pem, key.pem 0600; the authority's key is not kept). Give DIR to every worker\n"
        "(`mpmd worker --tls DIR`) and to the controller (cluster.tls=DIR): every control channel is\n"
        "then mutual TLS, and a peer without a certificate of this authority is refused.",
        epilog="example:\n  mpmd cluster certs ~/.mpmd-tls\n  mpmd worker --listen 10.0.0.2:7000 --token-file T --tls ~/.mpmd-tls\n"
        "  mpmd train configs/gpt_tiny.yaml cluster.backend=static cluster.tls=~/.mpmd-tls ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    certs.add_argument("dir", help="an empty or new directory (made 0700); existing certificates are never replaced")
    for s in [up] + [
        sub.add_parser(v, help=h)
        for v, h in (("status", "workers, jobs, leases, memory, cache"), ("down", "stop the workers and the manager"))
    ]:
        s.add_argument(
            "--file", default=DEFAULT_CLUSTER_FILE, help=f"the cluster file (default {DEFAULT_CLUSTER_FILE})"
        )
    sub.choices["status"].add_argument("--json", action="store_true", help="the manager's Status reply as JSON")
    return p


def check_up(args) -> None:
    """ValueError naming the argument that is wrong and what is allowed."""
    if args.backend not in BACKENDS:
        raise ValueError(f"--backend {args.backend!r} is not available; allowed: {', '.join(BACKENDS)}")
    for option in sorted({o for pool in POOLS.values() for o in pool.options} - set(POOLS[args.backend].options)):
        if getattr(args, option) is not None:
            users = " or ".join(name for name, pool in POOLS.items() if option in pool.options)
            raise ValueError(
                f"--{option.replace('_', '-')} is only used by --backend {users}, got --backend {args.backend}"
            )
    if args.rejoin:
        if args.workers is not None:
            raise ValueError("--rejoin takes the workers of the cluster file; do not give --workers")
    elif args.workers is None:  # its range is checked as it is parsed (commands/arguments.py)
        raise ValueError("--workers N is needed: worker processes, one slice each")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen must be HOST:PORT with port 0..65535 (0: any free one), got {args.listen!r}")
    if not 2.0 < args.max_lease_s <= 3600.0:
        raise ValueError(f"--max-lease-s must be in (2, 3600] seconds, got {args.max_lease_s:g}")
    if not 2.0 < args.lease_s <= args.max_lease_s:
        raise ValueError(
            f"--lease-s must be in (2, --max-lease-s={args.max_lease_s:g}] seconds (jobs renew every "
            f"second), got {args.lease_s:g}"
        )
    if args.compile_cache_mb is not None and args.compile_cache_mb < 0:
        raise ValueError(f"--compile-cache-mb must be >= 0, got {args.compile_cache_mb}")
    if args.root is not None and not os.path.isdir(args.root):
        raise ValueError(f"--root {args.root!r} is not a directory")


def up(args) -> int:
    cluster_file = os.path.abspath(args.file)
    directory = os.path.abspath(args.dir)
    if args.rejoin:
        saved = read_cluster_file(cluster_file)
        if process_alive(int(saved.get("manager_pid", 0)) or -1):
            raise ValueError(
                f"the manager of {cluster_file} (pid {saved['manager_pid']}) is running: nothing to rejoin"
            )
        directory = saved["dir"]
        backend = saved.get("backend", "local")
        if backend in POOLS and not POOLS[backend].rejoins:
            raise ValueError(
                f"{cluster_file} is a {backend}-backed cluster: its workers ended with their manager; "
                f"`mpmd cluster down --file {args.file}` and make it again"
            )
        if args.listen == LISTEN_DEFAULT:  # where the jobs look for it
            args.listen = saved["manager"]
    elif os.path.exists(cluster_file):
        saved = read_cluster_file(cluster_file)
        alive = [
            p
            for p in [saved.get("manager_pid")] + [w.get("pid") for w in saved.get("workers", [])]
            if isinstance(p, int) and process_alive(p)
        ]
        if alive:
            raise ValueError(
                f"{cluster_file} describes a cluster that still runs (pids {alive}): "
                f"`mpmd cluster down --file {args.file}` first, or use another --file"
            )
    if not args.rejoin:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for name in ("cluster.token", "submit.token"):
            _write_secret(os.path.join(directory, name), secrets.token_hex(16))
        # A new cluster, a new authority: the last one's certificates (if any) go with its tokens.
        tls_dir = os.path.join(directory, TLS_DIR)
        shutil.rmtree(tls_dir, ignore_errors=True)
        if not args.no_tls:
            make_tls(tls_dir)
    started_at = os.path.getmtime(cluster_file) if os.path.exists(cluster_file) else None
    cmd = [
        sys.executable,
        "-m",
        "mpmd.runtime.manager.server",
        "--dir",
        directory,
        "--file",
        cluster_file,
        "--listen",
        args.listen,
        "--lease-s",
        str(args.lease_s),
        "--max-lease-s",
        str(args.max_lease_s),
    ]
    if args.rejoin:
        cmd.append("--rejoin")
    else:
        cmd += [
            "--workers",
            str(args.workers),
            "--devices-per-worker",
            str(args.devices_per_worker),
            "--root",
            os.path.realpath(args.root or os.getcwd()),
            "--backend",
            args.backend,
        ]
        if args.ray_address is not None:
            cmd += ["--ray-address", args.ray_address]
    if args.compile_cache_mb is not None:
        cmd += ["--compile-cache-mb", str(args.compile_cache_mb)]
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    log_path = os.path.join(directory, "manager.log")
    with open(log_path, "a") as log:
        # A session of its own: the manager (and the workers it starts) outlive this command
        # and its terminal.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"error: the manager exited with status {proc.returncode}; see {log_path}", file=sys.stderr)
            return 1
        if os.path.exists(cluster_file) and os.path.getmtime(cluster_file) != started_at:
            saved = read_cluster_file(cluster_file)
            if saved.get("manager_pid") == proc.pid:
                print(
                    f"cluster up: manager {saved['manager']} (pid {proc.pid}), {len(saved['workers'])} worker(s), "
                    f"root {saved['root']}"
                )
                print(f"cluster file: {cluster_file}")
                print(f"jobs: mpmd train CONFIG cluster.backend=shared cluster.file={args.file}")
                return 0
        time.sleep(0.1)
    proc.kill()
    print(f"error: the manager did not come up within {UP_TIMEOUT_S:g} s; see {log_path}", file=sys.stderr)
    return 1


def _write_secret(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)


def _manager(saved: dict, token: str):
    from mpmd.runtime.control.rpc import WorkerClient
    import collections

    tls = load_tls(saved["tls"], "the cluster file's tls") if saved.get("tls") else None
    return WorkerClient(saved["manager"], token, collections.Counter(), MANAGER_SERVICE, tls)


def status(args) -> int:
    import dataclasses

    from mpmd.runtime.control.rpc import WorkerError, call
    from mpmd.runtime.wire import verbs

    saved = read_cluster_file(args.file)
    client = _manager(saved, saved["submit_token"])
    try:
        reply = dataclasses.asdict(call(client, verbs.Empty(), timeout_s=10.0, verb="Status")[0])
    except WorkerError as e:
        print(f"error: the manager at {saved['manager']} did not answer: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(reply, indent=1) if args.json else describe(reply))
    return 0


def describe(reply: dict) -> str:
    """`mpmd cluster status` as text: one line per worker, job and lease."""
    lines = ["workers:"]
    for w in reply["workers"]:
        cache = w.get("cache") or {}
        mib = (w.get("live_bytes") or 0) / 2**20
        lines.append(
            f"  {w['slot']}  {w['address']:21s} pid {w['pid']:<7d} {w['health']:11s} "
            f"{mib:8.1f} MiB live  {len(w.get('sessions') or [])} session(s)  cache "
            f"{cache.get('programs', 0)} program(s) {cache.get('bytes', 0) / 2**20:.1f} MiB "
            f"hits {cache.get('hits', 0)} misses {cache.get('misses', 0)}"
        )
    lines.append("jobs:")
    for j in reply["jobs"]:
        where = (
            f"workers {j['workers']}"
            if j["state"] == "leased"
            else (f"position {j['position']}" if j["state"] == "queued" else "")
        )
        lines.append(
            f"  {j['job']:30s} {j['state']:9s} {j['slices']} slice(s) "
            f"{'shared' if j['share'] else 'exclusive':9s} {where}"
        )
    return "\n".join(lines)


def down(args) -> int:
    from mpmd.runtime.control.rpc import WorkerError, call
    from mpmd.runtime.wire import verbs
    from mpmd.runtime.worker.main import read_token_file
    from mpmd.runtime.manager.worker_pool import kill_process

    saved = read_cluster_file(args.file)
    token = read_token_file(os.path.join(saved["dir"], "cluster.token"), False, "cluster token file", "(none)")
    pids = [saved["manager_pid"]] + [w["pid"] for w in saved["workers"]]
    client = _manager(saved, token)
    try:
        call(client, verbs.Empty(), timeout_s=10.0, verb="Down")
    except WorkerError as e:
        print(f"warning: the manager did not answer ({e}); stopping the processes by pid", file=sys.stderr)
    finally:
        client.close()
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and any(process_alive(p) for p in pids):
        time.sleep(0.1)
    # A worker the manager restarted before it went down is in the file it rewrote then.
    pids += [w["pid"] for w in read_cluster_file(args.file)["workers"] if w["pid"] not in pids]
    for p in pids:  # by pid only: these are the cluster file's processes
        kill_process(p)
    left = [p for p in pids if process_alive(p)]
    if left:
        print(f"error: processes {left} are still running", file=sys.stderr)
        return 1
    os.remove(args.file)
    print(f"cluster down: stopped pids {pids}")
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.verb == "up":
            check_up(args)
            return up(args)
        if args.verb == "certs":
            made = make_tls(args.dir)
            print(f"wrote {', '.join(os.path.join(made.directory, n) for n in TLS_FILES)}")
            return 0
        return status(args) if args.verb == "status" else down(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
