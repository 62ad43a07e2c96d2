"""What the worker's `live_bytes()` (runtime/worker/sessions.py) costs with its gc.collect()
and without, side by side in one run.

    .venv/bin/python benchmarks/bench_live_bytes.py [--buffers 100 1000 10000] [--calls 20]

A shared worker answers the manager's Sessions probe (every HEALTH_S = 1 s,
runtime/manager/core.py) with live_bytes(), on the same process and GIL as the job's steps.
This process imports what a worker imports (mpmd.runtime.worker.main: JAX, the service,
executor, transport; no Flax) and holds a worker session whose executor has BUFFERS buffers
put on its slice (float32 arrays of 64x64, about the size of gpt_tiny's weights; gpt_small's
slice holds a few hundred: parameters, two Adam moments, gradient accumulators, activations
in flight), after one jitted program has run so JAX's caches are warm. For each count it
times, per call (the median of CALLS): live_bytes() collecting first (gc.collect, then the
sum over jax.live_arrays(): what the service asks while no session holds an executor),
live_bytes(collect=False) (the sum alone: what it asks while a job's session does),
gc.collect() alone and a young-generation gc.collect(0), and how many objects the collector
tracks.
"""

from __future__ import annotations

import cpu_setup  # noqa: I001  (first: before anything imports jax)

REPO = cpu_setup.before_jax(devices=1)

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--buffers", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()

    import jax
    import numpy as np

    import mpmd.runtime.worker.main  # noqa: F401  (a worker's imports)
    from mpmd.runtime.control.inprocess import MemoryTransport, _Hub
    from mpmd.runtime.worker import mesh, sessions
    from mpmd.runtime.worker.executor import Executor

    jax.jit(lambda x: (x @ x.T).sum())(np.ones((64, 64), np.float32)).block_until_ready()
    slice_mesh = mesh.bind({"data": 1}, jax.devices()[:1])
    print(
        f"{'buffers':>8} {'tracked objects':>16} {'live_bytes ms':>14} {'sum only ms':>12} "
        f"{'gc.collect ms':>14} {'gc.collect(0) ms':>17} {'with / without':>15}"
    )
    with tempfile.TemporaryDirectory() as root:
        for count in args.buffers:
            session = sessions.Session("bench-1", root, 10.0)
            session.attach(
                Executor(0, slice_mesh, MemoryTransport(_Hub(), slice_mesh)), MemoryTransport(_Hub(), slice_mesh)
            )
            for i in range(count):
                session.executor.put(f"b{i}", [np.full((64, 64), i, np.float32)])
            with_gc = median_ms(sessions.live_bytes, args.calls)
            without = median_ms(lambda: sessions.live_bytes(collect=False), args.calls)
            full = median_ms(gc.collect, args.calls)
            young = median_ms(lambda: gc.collect(0), args.calls)
            print(
                f"{count:>8} {len(gc.get_objects()):>16} {with_gc:>14.2f} {without:>12.2f} {full:>14.2f} "
                f"{young:>17.3f} {with_gc / without:>15.1f}"
            )
            session.close()


if __name__ == "__main__":
    main()
