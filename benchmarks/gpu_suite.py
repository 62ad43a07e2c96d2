"""mpmd on one GPU, in one command: equivalence, Llama throughput against plain JAX, transfers,
per-instruction overhead, the in-memory snapshot's host copy. Prints a table, writes JSON.

    python benchmarks/gpu_suite.py [--out gpu_suite.json]       # one H200, that machine's JAX
    python benchmarks/gpu_suite.py --cpu --tiny                  # here: every section, tiny sizes

Made for a machine with one GPU, Python 3.12 and jax 0.11.2 preinstalled, no registry: bring
this checkout and the small wheels of benchmarks/gpu_requirements.txt, then
`pip install --no-deps -r benchmarks/gpu_requirements.txt && pip install --no-deps -e .`.
Budget: at most 8 minutes on an H200 (most of it compiling the Llama three ways).

Sections (each is one row group; one that fails records its error and the rest still run):
a. equivalence: a GPT on 2 slices = 2 worker processes sharing the GPU (each worker gets
   XLA_PYTHON_CLIENT_MEM_FRACTION = GPU_SHARE / 2), 1f1b and zb-h1, against unpipelined
   training of the same model in this process. Float32 model: losses within 1e-4 relative,
   parameters within 1e-3 (the GPU's reduction orders differ from one program to two);
   bfloat16 (the Llama) is not compared bitwise anywhere here.
b. Llama (configs/llama_1b.yaml, bf16, remat block; --tiny: 2 small blocks): tokens/s and
   MFU (6 x parameters + 12 x layers x d_model x seq_len FLOPs per token, over PEAK_TFLOPS)
   of one slice under mpmd (1 microbatch) against a plain jitted train step in one process
   (ratio, goal <= 1.05), and of 2 slices sharing the GPU (1f1b, 8 microbatches: the
   pipeline's cost when the GPU is shared, not a speedup).
c. transfer GB/s slice 0 -> slice 1 between the two workers (same host: shared memory,
   staged through pinned host memory, runtime/wire/shm.py) for 16 and 256 MB, against a
   device-to-device copy in one process; then benchmarks/bench_transport.py's ping-pong at
   1/16/64 MB by path, side by side: shared memory staged through pinned host memory (what
   auto picks on a GPU) against pageable staging, and the socket path.
d. per-instruction overhead: zero-duration programs, 1f1b, m = 32, on the 2 workers; and the
   in-memory snapshot's copy of 256 MB to pinned host memory (runtime/worker/slice_store.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import threading
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_SHARE = 0.85  # of the GPU's memory for the workers, split evenly; the controller allocates on demand
PEAK_TFLOPS = 989.0  # H200 dense bf16
MB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on CPU (no GPU needed; figures mean nothing)")
    p.add_argument(
        "--tiny",
        "--quick",
        dest="tiny",
        action="store_true",
        help="tiny models and sizes: checks every section end to end in about a minute of compute",
    )
    p.add_argument("--out", default="gpu_suite.json", help="where the JSON goes")
    p.add_argument(
        "--section-limit-s",
        type=float,
        default=None,
        help="a section running longer prints every thread's stack and ends the suite, exit 3 "
        "(default 240 with --tiny, else 900)",
    )
    p.add_argument("--plain-llama", action="store_true", help=argparse.SUPPRESS)  # section b's baseline process
    return p.parse_args(argv)


def set_platform(cpu: bool) -> None:
    """Before JAX is imported: the platform, and the controller's GPU memory taken on demand
    (the workers started below hold fixed fractions)."""
    if "jax" in sys.modules:
        raise RuntimeError("set_platform must run before jax is imported")
    if cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cuda")
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


# -- a stalled section -----------------------------------------------------------------------
WORKER_PIDS: set[int] = set()  # the workers started here and still running


class Watchdog:
    """A section that runs past `limit_s` prints where everything waits and ends the suite:
    every worker's threads (SIGUSR1: runtime/worker/main.py), then this process's, exit 3. A
    hang then leaves its stacks in the output instead of a silent timeout."""

    def __init__(self, limit_s: float):
        self.limit_s, self.timer = limit_s, None

    def arm(self, section: str) -> None:
        self.disarm()
        self.timer = threading.Timer(self.limit_s, self._fire, (section,))
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _fire(self, section: str) -> None:
        print(
            f"gpu_suite: section {section!r} ran past {self.limit_s:.0f} s; every thread's stack follows",
            file=sys.stderr,
            flush=True,
        )
        for pid in sorted(WORKER_PIDS):
            print(f"gpu_suite: worker pid {pid}'s stacks:", file=sys.stderr, flush=True)
            os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
        print("gpu_suite: this process's stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        for pid in WORKER_PIDS:
            os.kill(pid, signal.SIGKILL)
        os._exit(3)


# -- workers sharing the one device ----------------------------------------------------------
class SharedWorkers:
    """n worker processes on this machine, all on GPU 0 (or the CPU), each with a fixed share
    of its memory, behind one StaticCluster. LocalCluster gives each worker GPUs of its own;
    here two must share the one GPU, so they are started by hand with the same command."""

    def __init__(self, n: int, root: str):
        self.procs = []
        import secrets
        from mpmd.runtime.launchers.workers import worker_command, worker_env
        from mpmd.runtime.worker.main import READY

        token = secrets.token_hex(16)
        addresses = []
        for _ in range(n):
            env = worker_env("")
            env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{GPU_SHARE / n:.3f}"
            if env.get("JAX_PLATFORMS") != "cpu":
                env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            proc = subprocess.Popen(
                worker_command("127.0.0.1:0", root, 1, token_stdin=True),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            proc.stdin.write(token + "\n")  # stdin stays open: a worker whose stdin closes stops
            proc.stdin.flush()
            self.procs.append(proc)
            WORKER_PIDS.add(proc.pid)
        for proc in self.procs:
            line = proc.stdout.readline().split()
            if not line or line[0] != READY:
                self.close()
                raise RuntimeError(f"worker pid {proc.pid} did not start (printed {line!r})")
            addresses.append(line[1])
        import mpmd

        self.cluster = mpmd.StaticCluster(addresses, token=token, failure_timeout_s=60.0)

    def close(self) -> None:
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.close()
        for proc in self.procs:  # closing its stdin stops each worker (only those started here)
            proc.stdin.close()
        for proc in self.procs:
            proc.wait(timeout=30)
            WORKER_PIDS.discard(proc.pid)


# -- models and the unpipelined reference ----------------------------------------------------
def gpt_sizes(tiny: bool) -> dict:
    return (
        dict(vocab_size=256, d_model=32, num_heads=2, num_layers=4, seq_len=16)
        if tiny
        else dict(vocab_size=256, d_model=512, num_heads=8, num_layers=8, seq_len=256)
    )


def llama_sizes(tiny: bool) -> tuple[dict, int]:
    """(models.Llama's arguments, global batch) from configs/llama_1b.yaml (--tiny: shrunk)."""
    from mpmd.recipes import config

    m = config.load(REPO / "configs/llama_1b.yaml").model
    sizes = dict(
        vocab_size=m.vocab_size,
        d_model=m.d_model,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        num_layers=m.num_layers,
        mlp_dim=m.mlp_dim,
        seq_len=m.seq_len,
        dtype=m.dtype,
        remat=m.remat,
    )
    if tiny:
        sizes.update(d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=128, seq_len=32)
    return sizes, (4 if tiny else 8)


def batches(sizes: dict, batch: int, num: int) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, sizes["vocab_size"], (batch, sizes["seq_len"] + 1)).astype(np.int32) for _ in range(num)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def reference(make_model, data, optimizer):
    """(losses, final parameter leaves in layer order, seconds per step after the first) of a
    plain jitted train step of the whole model in this process."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from mpmd import models

    model = make_model()
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of(p, x, y):
        return models.lm_loss(nnx.merge(graph, p, rest)(x), y)

    @jax.jit
    def step(p, state, x, y):
        loss, grads = jax.value_and_grad(loss_of)(p, x, y)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    state, losses, times = optimizer.init(params), [], []
    for x, y in data:
        t0 = time.perf_counter()
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
    model = nnx.merge(graph, params, rest)
    leaves = [np.asarray(l) for layer in model.layers() for l in jax.tree.leaves(nnx.state(layer, nnx.Param))]
    return losses, leaves, median(times[1:])


def pipelined(make_model, data, optimizer, cluster, num_stages: int, schedule: str, num_microbatches: int):
    """(losses, final parameter leaves in stage order, seconds per step after the first)."""
    import jax
    import numpy as np
    import mpmd
    from mpmd import models

    stages = mpmd.split(make_model(), num_stages=num_stages)
    trainer = mpmd.Trainer(
        mpmd.Pipeline(stages, models.lm_loss),
        optimizer=optimizer,
        schedule=schedule,
        num_microbatches=num_microbatches,
        cluster=cluster,
    )
    try:
        losses, times = [], []
        for x, y in data:
            t0 = time.perf_counter()
            losses.append(float(trainer.step(x, y)["loss"]))
            times.append(time.perf_counter() - t0)
        leaves = [np.asarray(l) for s in trainer.params() for l in jax.tree.leaves(s)]
    finally:
        trainer.close(close_cluster=False)  # the workers serve the next case
    return losses, leaves, median(times[1:])


def median(xs):
    import statistics

    return statistics.median(xs) if xs else float("nan")


# -- sections --------------------------------------------------------------------------------
def equivalence(workers, tiny: bool) -> list[dict]:
    import numpy as np
    import optax
    from flax import nnx
    from mpmd import models

    sizes = gpt_sizes(tiny)
    make = lambda: models.GPT(**sizes, rngs=nnx.Rngs(0))
    data = batches(sizes, 8, 3)
    want_losses, want, _ = reference(make, data, optax.adamw(1e-3))
    rows = []
    for schedule in ("1f1b", "zb-h1"):
        losses, got, _ = pipelined(make, data, optax.adamw(1e-3), workers.cluster, 2, schedule, 4)
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
        param = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
        rows.append(
            {
                "section": "a. equivalence",
                "case": f"GPT {schedule}, 2 slices on 1 device",
                "loss_max_rel_err": loss_rel,
                "param_max_abs_err": param,
                "ok": loss_rel <= 1e-4 and param <= 1e-3,
            }
        )
    return rows


def model_flops_per_token(sizes: dict, num_params: int) -> float:
    return 6.0 * num_params + 12.0 * sizes["num_layers"] * sizes["d_model"] * sizes["seq_len"]


def llama_case(tiny: bool):
    """(sizes, a builder, the batches) of section b."""
    from flax import nnx
    from mpmd import models

    sizes, batch = llama_sizes(tiny)
    return sizes, lambda: models.Llama(**sizes, rngs=nnx.Rngs(0)), batches(sizes, batch, 3 if tiny else 6)


def plain_llama(tiny: bool) -> None:
    import optax

    _, make, data = llama_case(tiny)
    print(json.dumps({"step_s": reference(make, data, optax.adamw(3e-4))[2]}))


def llama(root: str, tiny: bool, cpu: bool) -> list[dict]:
    import jax
    import optax
    from flax import nnx

    sizes, make, data = llama_case(tiny)
    batch = len(data[0][0])
    num_params = sum(l.size for l in jax.tree.leaves(nnx.state(nnx.eval_shape(make), nnx.Param)))
    tokens = batch * sizes["seq_len"]
    flops = model_flops_per_token(sizes, num_params) * tokens
    rows = []

    def row(case, step_s, ratio=None):
        r = {
            "section": "b. llama",
            "case": case,
            "params": num_params,
            "tokens_per_s": tokens / step_s,
            "step_s": step_s,
            "mfu": None if cpu else flops / step_s / (PEAK_TFLOPS * 1e12),
        }
        if ratio is not None:
            r.update(overhead_ratio=ratio, ok=ratio <= 1.05)
        rows.append(r)

    # In a process of its own: JAX keeps the GPU memory it grew into until the process ends.
    plain = subprocess.run(
        [sys.executable, __file__, "--plain-llama", *(["--cpu"] if cpu else []), *(["--tiny"] if tiny else [])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if plain.returncode:
        raise RuntimeError(f"the plain jit baseline failed: {plain.stderr.strip().splitlines()[-1:]}")
    plain_s = json.loads(plain.stdout.strip().splitlines()[-1])["step_s"]
    row("plain jit, one process", plain_s)
    for num_slices in (1, 2):  # one worker at a time holds the GPU's memory: never three at once
        workers = SharedWorkers(num_slices, root)
        try:
            m = 1 if num_slices == 1 else 4 if tiny else 8
            _, _, step_s = pipelined(make, data, optax.adamw(3e-4), workers.cluster, num_slices, "1f1b", m)
        finally:
            workers.close()
        if num_slices == 1:
            row("mpmd, 1 slice, m=1", step_s, step_s / plain_s)
        else:
            row(f"mpmd, 2 slices sharing the device, 1f1b m={m}", step_s)
    return rows


def transfers(workers, tiny: bool, cpu: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_runtime import transfer_s  # the runtime's ping-pong, one way
    import bench_transport

    rows = []
    for size_mb in (1, 4) if tiny else (16, 256):
        one_way = transfer_s(workers.cluster, size_mb * MB, 3 if tiny else 10)
        x = jnp.ones((size_mb * MB // 4,), jnp.float32)
        copy = jax.jit(lambda a: a + 0)
        copy(x).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(10):
            y = copy(x)
        y.block_until_ready()
        copy_s = (time.perf_counter() - t0) / 10
        rows.append(
            {
                "section": "c. transfer",
                "case": f"{size_mb} MB slice 0 -> 1",
                "transfer_gb_per_s": size_mb * MB / one_way / 1e9,
                "d2d_copy_gb_per_s": size_mb * MB / copy_s / 1e9,
                "ratio": copy_s / one_way,
            }
        )
    sizes_mb = (1, 4) if tiny else bench_transport.SIZES_MB
    by_path = {
        path: bench_transport.one_way_by_size(path, "cpu" if cpu else "cuda", sizes_mb)
        for path in ("shm+pinned", "shm+pageable", "socket")
    }
    for size_mb in sizes_mb:
        pinned_s = by_path["shm+pinned"][size_mb]
        rows.append(
            {
                "section": "c. transfer",
                "case": f"{size_mb} MB ping-pong, by path",
                **{f"{path}_gb_per_s": size_mb * MB / s[size_mb] / 1e9 for path, s in by_path.items()},
                "pageable_over_pinned_time": by_path["shm+pageable"][size_mb] / pinned_s,
            }
        )
    return rows


def overhead(workers, tiny: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from mpmd.lowering.dryrun import dry_run
    from mpmd.schedules import core as schedules

    m = 8 if tiny else 32
    result = dry_run(
        schedules.make("1f1b", 2, m), {"F": 0.0, "B": 0.0, "W": 0.0}, 4 * 2**10, workers.cluster, steps=3, trace=True
    )
    per_instr = []
    for step_walls, step_events in zip(result.slice_wall_s, result.events):
        for r, wall in enumerate(step_walls):
            wait = sum(e.end_ns - e.start_ns for e in step_events[r] if e.kind == "recv") / 1e9
            per_instr.append((wall - wait) / len(result.streams[r]))
    rows = [
        {
            "section": "d. overhead",
            "case": f"per instruction, 1f1b, 2 slices, m={m}",
            "us_per_instruction": median(per_instr) * 1e6,
            "ok": median(per_instr) <= 100e-6,
        }
    ]
    size = (4 if tiny else 256) * MB
    x = jnp.ones((size // 4,), jnp.float32)
    try:
        host = x.sharding.with_memory_kind("pinned_host")
        jax.device_put(x, host).block_until_ready()
        t0 = time.perf_counter()
        jax.device_put(x, host).block_until_ready()
        snapshot_s = time.perf_counter() - t0
        rows.append(
            {
                "section": "d. overhead",
                "case": f"snapshot {size // MB} MB to pinned host",
                "snapshot_s": snapshot_s,
                "gb_per_s": size / snapshot_s / 1e9,
            }
        )
    except Exception as e:  # a platform without pinned host memory
        rows.append(
            {
                "section": "d. overhead",
                "case": f"snapshot {size // MB} MB to pinned host",
                "error": f"{type(e).__name__}: {e}"[:200],
            }
        )
    return rows


def run_section(name: str, fn, rows: list, watchdog: Watchdog) -> None:
    t0 = time.perf_counter()
    watchdog.arm(name)
    try:
        got = fn()
    except Exception as e:  # one broken section must not cost the GPU run the others
        traceback.print_exc()  # the whole of it on stderr; the row keeps the gist
        got = [{"section": name, "case": "(failed)", "error": f"{type(e).__name__}: {e}"[:400]}]
    finally:
        watchdog.disarm()
    for r in got:
        r["section_s"] = round(time.perf_counter() - t0, 1)
    rows.extend(got)
    print_rows(got)


def print_rows(rows: list) -> None:
    for r in rows:
        figures = ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if k not in ("section", "case")
        )
        print(f"{r['section']:<16} {r['case']:<44} {figures}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    set_platform(args.cpu)
    if args.plain_llama:
        plain_llama(args.tiny)
        return 0
    import jax
    from mpmd.runtime import compat

    started = time.time()
    header = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "platform": jax.devices()[0].platform,
        "device": jax.devices()[0].device_kind,
        "python": sys.version.split()[0],
        **compat.versions(),
        "tiny": args.tiny,
    }
    print(" ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    rows: list = []
    # A tiny section takes under a minute here; the GPU's whole suite is budgeted at 8.
    watchdog = Watchdog(args.section_limit_s or (240.0 if args.tiny else 900.0))
    with tempfile.TemporaryDirectory() as root:
        run_section("b. llama", lambda: llama(root, args.tiny, args.cpu), rows, watchdog)
        workers = SharedWorkers(2, root)
        try:
            run_section("a. equivalence", lambda: equivalence(workers, args.tiny), rows, watchdog)
            run_section("c. transfer", lambda: transfers(workers, args.tiny, args.cpu), rows, watchdog)
            run_section("d. overhead", lambda: overhead(workers, args.tiny), rows, watchdog)
        finally:
            workers.close()
    header["total_s"] = round(time.time() - started, 1)
    Path(args.out).write_text(json.dumps({**header, "rows": rows}, indent=1))
    print(f"wrote {args.out} ({header['total_s']} s)")
    failed = [r for r in rows if "error" in r and r["case"] == "(failed)"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
