"""What every launcher that starts its own workers shares: the checks of its arguments, the
root its workers are confined to, the GPUs and ports it hands out, and the one command line
and environment a worker process is started with (LocalLauncher, the shared cluster's
WorkerPool; RayLauncher's actors run the same worker in-process and share the checks).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys

START_TIMEOUT_S = 60.0  # how long a worker started here may take to report ready


def check_worker_args(num_workers, devices_per_worker, threads_per_worker) -> None:
    """What every launcher that starts its own workers accepts (LocalCluster, RayCluster)."""
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
        raise ValueError(f"num_workers must be a positive integer or None (one per slice), got {num_workers!r}")
    if not isinstance(devices_per_worker, int) or isinstance(devices_per_worker, bool) or devices_per_worker < 1:
        raise ValueError(
            f"devices_per_worker must be a positive integer (the devices of one slice's mesh), "
            f"got {devices_per_worker!r}"
        )
    if not isinstance(threads_per_worker, int) or threads_per_worker < 1:
        raise ValueError(f"threads_per_worker must be a positive integer, got {threads_per_worker!r}")


def check_max_workers(max_workers):
    """max_workers: None (no limit) or a positive integer."""
    if max_workers is not None and (
        not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1
    ):
        raise ValueError(
            f"max_workers must be a positive integer (the most worker processes started over "
            f"the cluster's life, replacements included) or None (no limit), got {max_workers!r}"
        )
    return max_workers


def num_workers_for(num_workers: int | None, num_slices: int, backend: str) -> int:
    """How many workers a launcher that starts its own starts for `num_slices` slices."""
    n = num_workers if num_workers is not None else num_slices
    if n < num_slices:
        raise ValueError(f"{num_slices} slices need at least {num_slices} workers, {backend} has num_workers={n}")
    return n


def worker_root(configured: str | None, asked: str | None, running: str | None, backend: str) -> str:
    """The root a launcher's workers are confined to (`mpmd worker --root`): the root they
    already run with, else the cluster's `root=`, else the run directory a start `asked` for,
    else this process's cwd (what relative run_dirs mean). A root is fixed when the workers
    start, so a start that asks for a directory outside it is refused (ValueError), never
    widened."""
    root = os.path.realpath(running or configured or asked or os.getcwd())
    if asked is not None:
        real = os.path.realpath(asked)
        if os.path.commonpath([real, root]) != root:
            raise ValueError(
                f"{backend}'s workers are confined to {root}, which does not hold {asked}: "
                f"make a new cluster for that run_dir, or give {backend}(root=...) a "
                f"directory that holds every run_dir it will serve"
            )
    return root


def visible_gpus() -> list[str]:
    """The ids of the GPUs this machine's workers may use, found without importing JAX (in
    the controller it would take GPU memory): $CUDA_VISIBLE_DEVICES when set, else one per
    /dev/nvidia<N>. None at all when $JAX_PLATFORMS leaves CUDA out or JAX's CUDA plugin
    (`pip install -e '.[cuda12]'` or `'.[cuda13]'`) is not installed: the workers would run on CPU anyway."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.split(",")):
        return []
    if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return []
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    return sorted((n[len("nvidia") :] for n in names if re.fullmatch(r"nvidia\d+", n)), key=int)


def check_gpus(gpus) -> list[str]:
    """An explicit `gpus=` (a list of GPU ids; [] = CPU) as the strings CUDA_VISIBLE_DEVICES takes."""
    if not isinstance(gpus, (list, tuple)) or not all(
        (isinstance(g, int) and not isinstance(g, bool) and g >= 0) or (isinstance(g, str) and g.strip()) for g in gpus
    ):
        raise ValueError(
            f"gpus must be None (find them), a list of GPU ids (ints >= 0 or CUDA ids), or [] (CPU), got {gpus!r}"
        )
    ids = [str(g).strip() for g in gpus]
    if len(set(ids)) != len(ids):
        raise ValueError(f"gpus lists a GPU twice ({gpus!r}): two workers never share a GPU")
    return ids


def check_processes_per_slice(k) -> int:
    """processes_per_slice: a positive integer (1: a slice is one process)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(
            f"processes_per_slice must be a positive integer (the processes, one per host, that "
            f"together own a slice's mesh; 1: one process per slice), got {k!r}"
        )
    return k


def free_port(host: str) -> int:
    """A port free on `host` now, for a gang's coordinator (the OS picks it; the gang binds it
    moments later)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    """Whether `pid` is a live process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def worker_env(compilation_cache_dir: str) -> dict:
    """The environment of a worker process started here: this one's, with this checkout first
    on PYTHONPATH (`python -m mpmd.runtime.worker.main` must import the same code) and JAX's persistent
    compilation cache at `compilation_cache_dir` ("" leaves it off)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if compilation_cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return env


def worker_command(
    listen: str,
    root: str,
    devices: int,
    *,
    token_stdin: bool = False,
    token_file: str | None = None,
    shared: bool = False,
    cpus=None,
    log_level: str | None = None,
    relay_level: str | None = None,
    compile_cache_mb: float | None = None,
    tls: str | None = None,
) -> list[str]:
    """The command line of one worker process (`python -m mpmd.runtime.worker.main`, the
    same code as this checkout: see worker_env): serving on `listen`, confined to `root`,
    owning `devices` devices. Its token comes on stdin (`token_stdin`) or from `token_file`
    (exactly one). cpus: the cores to pin it to (None: not pinned); log_level,
    relay_level, compile_cache_mb, tls: the worker's flags of those names (None: its default;
    tls "-": the certificates follow the token on stdin)."""
    assert token_stdin != (token_file is not None), "a worker reads its token from stdin or from a file"
    cmd = [
        sys.executable,
        "-m",
        "mpmd.runtime.worker.main",
        "--listen",
        listen,
        "--root",
        root,
        "--devices",
        str(devices),
    ]
    cmd += ["--token-stdin"] if token_stdin else ["--token-file", token_file]
    if shared:
        cmd += ["--shared"]
    if cpus is not None:
        cmd += ["--cpus", ",".join(map(str, cpus))]
    if log_level is not None:
        cmd += ["--log-level", log_level]
    if relay_level is not None:
        cmd += ["--relay-level", relay_level]
    if compile_cache_mb is not None:
        cmd += ["--compile-cache-mb", str(compile_cache_mb)]
    if tls is not None:
        cmd += ["--tls", tls]
    return cmd


def worker_log_file(log_dir: str, slot: int, process: int, processes_per_slice: int) -> str:
    """Where slot `slot`'s worker logs (process `process` of its gang: a file each)."""
    name = f"worker_{slot}.log" if processes_per_slice == 1 else f"worker_{slot}.{process}.log"
    return os.path.join(log_dir, name)


def log_relayed(slot: int, levelno: int, text: str, log_file: str) -> None:
    """A worker's record at the console's level, as its one line on the controller's console
    (logger mpmd.workers): "worker 1 WARNING <message> (see <log file>)"."""
    logging.getLogger("mpmd.workers").log(
        levelno, "worker %d %s %s (see %s)", slot, logging.getLevelName(levelno), text, log_file
    )


def default_compilation_cache() -> str:
    """$JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/mpmd/jax (~/.cache/mpmd/jax)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpmd", "jax")
