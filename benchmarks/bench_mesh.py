"""Slices of several devices: what a mesh per slice costs, and what resharding between unlike
slices costs on the wire.

    .venv/bin/python benchmarks/bench_mesh.py [--quick] [--rounds N] [--block N] [--reps N] [--no-inprocess] [--only overhead|transfer|gather]

Every ratio is measured in this one run on this machine.

1. Overhead. A small GPT (GPT_SIZES), 1F1B on 2 slices, m microbatches, one global batch,
   adamw: 2 slices x D=2 (mesh data=2: each microbatch split over two devices, gradients
   reduced once a step, mpmd/stages/partials.py) against 2 slices x D=1. LocalCluster: one worker
   process per slice, each pinned to its own core with XLA's intra-op threads off, so a D=2
   worker runs its two devices on one core: with the same cores, the ratio is the cost of
   the SPMD programs and the resharding-free shard-to-shard transfers, not a speedup. The
   two trainers live side by side and run alternating blocks of steps, so load drift hits
   both alike; a step's time is the interval between consecutive returns of trainer.step
   within a block (the first of each block dropped: it overlaps the other trainer's tail).
   Same again on InProcessCluster (all slices are threads of this process, unpinned) unless
   --no-inprocess. loss[0] must agree between D=1 and D=2. A last traced step per trainer
   splits each slice's time into its programs and its receive waits: where the D=2 excess
   sits (in the SPMD programs, or in waiting for transfers). Last, the floor: the same step
   in JAX alone, in a child process pinned to one core, D=2 against D=1 in alternating
   blocks, written two ways: one jitted program (a shard_map over data with one psum), and
   the programs a pipeline stage runs (a forward per microbatch that stores its residuals, a
   backward per microbatch, one update): what two simulated devices on one core cost XLA:CPU
   itself, with no pipeline and no runtime; last of all LocalCluster's ratio over the
   second's, what mpmd adds beyond the programs it must run.
2. Resharding transfer. A float32 activation [64, 256, 256] (16 MB) moved from slice 0 to
   slice 1 of LocalCluster(num_workers=2, devices_per_worker=2), by hand-written plans: slice
   0 runs a program that makes the array in its layout, sends it; slice 1 receives it in its
   own layout. One-way time = the receive's end on slice 1 (the array assembled in its
   layout and ready) - the producing program's end on slice 0 (traced, both wall clocks of
   this machine). Cases:
     a  data=2 -> data=2, pieces=2: shard to shard (each device's half crosses on its own)
     a1 data=2 -> data=2, pieces=1: the same move sent whole (the sender gathers first)
     b  data=2 -> tensor=2, pieces=2: batch-split sender, receiver replicated over tensor
        (the halves land on its two devices, one device_put replicates them)
     c  tensor=2 -> data=2, pieces=1: replicated sender sends one replica whole, the
        receiver slices it over its two devices
     ref D=1 -> D=1: the plain one-device transport (no resharding), on 1-device workers
   GB/s = payload bytes / median one-way time; "x a" = GB/s over case a's. The "local"
   columns time the same resharding inside this process, no wire, between two 2-device
   meshes (runtime/wire/reshard.py): cut on the sender (free where the pieces are its shards, a
   gather where they are not) and assemble on the receiver (slices, copies, concatenations
   after the pieces have landed): what resharding costs beyond moving the bytes.
3. FSDP weights gathered once a step (mesh.fsdp_gather, mpmd/stages/gather.py). The same GPT
   on 2 slices x D=2 with mesh fsdp=2 (the weights the rules put on fsdp in halves), as in
   1.: per_microbatch (every forward and backward program all-gathers them) against per_step
   (gather{k} once before the stage's first forward, the programs take the gathered copy),
   each on its own LocalCluster of the same pinned cores, in alternating blocks; then on
   InProcessCluster unless --no-inprocess. loss[0] must agree to rounding.

The load average is printed at the start and the end: other processes on a 2-core machine
inflate every figure here.
"""

from __future__ import annotations

import os

# Before jax is imported: this process hosts the in-process slices (2 slices x up to 2
# devices) and the local reshard timings; LocalCluster's workers set their own flags.
import cpu_setup  # noqa: E402  (first: sets the flags before anything imports jax)

cpu_setup.before_jax(devices=4)

import argparse  # noqa: E402
import sys  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import timing  # noqa: E402

MS = 1e-3
GPT_SIZES = dict(vocab_size=256, d_model=128, num_heads=4, num_layers=4, seq_len=64)
GPT_BATCH, GPT_M, LR = 32, 4, 3e-4
ACT_SHAPE = (64, 256, 256)  # float32: 16 MB
ACT_BYTES = 4 * ACT_SHAPE[0] * ACT_SHAPE[1] * ACT_SHAPE[2]


# -- 1. overhead of a 2-device slice ---------------------------------------------------------
def make_batches(num: int) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (GPT_BATCH, GPT_SIZES["seq_len"])
    return [
        (
            rng.integers(0, GPT_SIZES["vocab_size"], shape).astype(np.int32),
            rng.integers(0, GPT_SIZES["vocab_size"], shape).astype(np.int32),
        )
        for _ in range(num)
    ]


def make_trainer(cluster, mesh, fsdp_gather="per_microbatch"):
    import optax
    from flax import nnx

    from mpmd import models
    import mpmd

    model = models.GPT(**GPT_SIZES, rngs=nnx.Rngs(0))
    pipe = mpmd.Pipeline(mpmd.split(model, 2), models.lm_loss)
    return mpmd.Trainer(
        pipe,
        optax.adamw(LR),
        schedule="1f1b",
        num_microbatches=GPT_M,
        mesh=mpmd.Mesh(mesh, fsdp_gather=fsdp_gather),
        cluster=cluster,
    )


def alternate(trainers: dict, num_rounds: int, block: int, batches) -> tuple[dict, dict]:
    """Per trainer: step times (s) from alternating blocks of `block` steps, and first losses."""
    losses = {name: [] for name in trainers}
    for name, t in trainers.items():  # warm-up: compile, first dispatch
        losses[name] += [t.step(*batches[i % len(batches)])["loss"] for i in range(2)]
    times = timing.alternating_blocks(
        {name: (lambda i, t=t: t.step(*batches[i % len(batches)])) for name, t in trainers.items()}, num_rounds, block
    )
    return times, losses


def traced_busy_s(trainer, batch) -> list[tuple[float, float]]:
    """Per slice (program time, receive wait) in seconds in one traced step (the second of
    two: the first also waits for the previous step's tail). Tracing blocks on every task."""
    events = [trainer.step(*batch, trace=True) for _ in range(2)][-1]["events"]
    return [
        (
            sum(e.end_ns - e.start_ns for e in ev if e.kind == "run") / 1e9,
            sum(e.end_ns - e.start_ns for e in ev if e.kind == "recv") / 1e9,
        )
        for ev in events
    ]


def side_by_side(title: str, cases: dict, setups: list, num_rounds: int, block: int) -> list:
    """Two trainers per setup, run in alternating blocks and printed side by side: `cases`
    {name: (mesh, fsdp_gather)}, the second over the first is the ratio; `setups` [(cluster
    label, {name: a function giving that case's cluster})]. Returns the rows printed: (label,
    step times, first losses, traced busy, wall s) per setup."""
    batches = make_batches(4)
    a, b = cases
    rows = []
    for label, clusters in setups:
        t0 = time.perf_counter()
        trainers = {name: make_trainer(clusters[name](), *case) for name, case in cases.items()}
        try:
            times, losses = alternate(trainers, num_rounds, block, batches)
            busy = {name: traced_busy_s(t, batches[0]) for name, t in trainers.items()}
        finally:
            for t in trainers.values():
                t.close(close_cluster=label != "LocalCluster")
        rows.append((label, times, losses, busy, time.perf_counter() - t0))

    print(
        f"\n{title}: GPT {GPT_SIZES}, batch {GPT_BATCH}, 1f1b, m={GPT_M}, adamw, 2 slices; "
        f"{num_rounds} alternating blocks of {block} steps each (median over "
        f"{num_rounds * (block - 1)} step intervals)"
    )
    print(
        f"{'cluster':>17} {a + ' ms/step':>20} {b + ' ms/step':>20} {b + ' / ' + a:>26} "
        f"{'(p25..p75 of ' + b + ' / median ' + a + ')':>42} {'loss[0] ' + a + ' / ' + b:>36} {'wall s':>7}"
    )
    for label, times, losses, busy, wall in rows:
        ta, tb = statistics.median(times[a]), statistics.median(times[b])
        q = statistics.quantiles(times[b], n=4)
        print(
            f"{label:>17} {ta / MS:>20.1f} {tb / MS:>20.1f} {tb / ta:>26.3f} "
            f"{f'{q[0] / ta:.3f}..{q[2] / ta:.3f}':>42} "
            f"{f'{losses[a][0]:.5f} / {losses[b][0]:.5f}':>36} {wall:>7.1f}"
        )
    print("traced step, per slice program ms / receive wait ms (tracing blocks on every task):")
    for label, _, _, busy, _ in rows:
        print(
            f"{label:>17}  "
            + "   ".join(
                f"{name}: " + "  ".join(f"s{r} {run / MS:.1f}/{wait / MS:.1f}" for r, (run, wait) in enumerate(bz))
                for name, bz in busy.items()
            )
        )
    return rows


def overhead(local_d1, local_d2, num_rounds: int, block: int, inprocess: bool) -> None:
    import mpmd

    setups = [("LocalCluster", {"D=1": lambda: local_d1, "D=2": lambda: local_d2})]
    if inprocess:
        setups.append(("InProcessCluster", {"D=1": mpmd.InProcessCluster, "D=2": mpmd.InProcessCluster}))
    rows = side_by_side(
        "1. overhead",
        {"D=1": (None, "per_microbatch"), "D=2": ({"data": 2}, "per_microbatch")},
        setups,
        num_rounds,
        block,
    )
    times = xla_floor(num_rounds, block)
    ratio = {}
    for form, what in (
        ("step", "one jitted step"),
        ("split", "forward and backward programs per microbatch, one update"),
    ):
        d1, d2 = (statistics.median(times[f"{form} D={d}"]) for d in (1, 2))
        q = statistics.quantiles(times[f"{form} D=2"], n=4)
        ratio[form] = d2 / d1
        print(
            f"{'JAX alone, ' + form:>17} {d1 / MS:>20.1f} {d2 / MS:>20.1f} {d2 / d1:>26.3f} "
            f"{f'{q[0] / d1:.3f}..{q[2] / d1:.3f}':>42}   ({what}; one process pinned to one core, "
            f"no pipeline: xla_floor)"
        )
    local = statistics.median(rows[0][1]["D=2"]) / statistics.median(rows[0][1]["D=1"])
    print(f"LocalCluster's D=2 / D=1 over JAX alone's with the same programs (split): {local / ratio['split']:.3f}")


def xla_floor(num_rounds: int, block: int) -> dict:
    """D=2 against D=1 in JAX alone, in a child process pinned to one core like a worker: the
    same GPT, batch, m and adamw, (step) as one jitted training step (a shard_map over `data`:
    each device runs its half of every microbatch, accumulates its partial gradients, one
    psum), and (split) as the programs a pipeline stage runs, a forward per microbatch that
    stores its residuals, a backward per microbatch, one update. What XLA:CPU itself costs
    for running two simulated devices on one core, with no pipeline and no runtime: the floor
    under the mpmd ratio above. {"step D=1": [s, ...], "step D=2": ..., "split D=1": ...}."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, __file__, "--xla-floor-child", str(num_rounds), str(block)], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"xla_floor's child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _xla_floor_child(num_rounds: int, block: int) -> None:
    os.sched_setaffinity(0, {1})  # before jax starts its threads: one core, as a worker
    import json

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mpmd import models
    from mpmd.runtime import compat

    graphdef, params = nnx.split(models.GPT(**GPT_SIZES, rngs=nnx.Rngs(0)))
    optimizer = optax.adamw(LR)
    loss = lambda p, x, y: models.lm_loss(nnx.merge(graphdef, p)(x), y)

    def adamw(p, state, grads):
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    def whole_step(mesh):
        """One jitted step: a shard_map over data, each device its half of every microbatch."""

        def partial_grads(p, x, y):  # this device's rows of the batch, m microbatches
            xs, ys = (a.reshape(GPT_M, -1, *a.shape[1:]) for a in (x, y))
            grads, total = jax.tree.map(jnp.zeros_like, p), 0.0
            for i in range(GPT_M):  # unrolled (as a scan: 0.84, its D=1 loop the slower one)
                value, g = jax.value_and_grad(loss)(p, xs[i], ys[i])
                grads, total = jax.tree.map(jnp.add, grads, g), total + value
            n = GPT_M * jax.lax.psum(1, "data")
            return jax.lax.psum(grads, "data"), jax.lax.psum(total, "data") / n

        def step(p, state, x, y):
            grads, value = jax.shard_map(
                partial_grads, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()), check_vma=False
            )(p, x, y)
            return (*adamw(p, state, jax.tree.map(lambda g: g / GPT_M, grads)), value)

        return jax.jit(step, donate_argnums=(0, 1))

    def split_programs(mesh):
        """A forward program per microbatch that stores its vjp residuals, a backward program
        per microbatch that accumulates per-device partial gradients, one update summing them:
        the programs a pipeline stage runs (the microbatch viewed as one group per device and
        vmapped over, as mpmd/stages/partials.py does), with no pipeline and no runtime."""
        n, groups = mesh.size, NamedSharding(mesh, P("data"))

        def forward(p, x, y):
            def group(xg, yg):
                return jax.vjp(lambda q: loss(q, xg, yg), p)[1]

            vjp = jax.vmap(group)(*(a.reshape(n, -1, *a.shape[1:]) for a in (x, y)))
            return jax.tree.map(lambda r: jax.lax.with_sharding_constraint(r, groups), vjp)

        def backward(acc, vjp):
            return jax.tree.map(jnp.add, acc, jax.vmap(lambda f: f(jnp.float32(1 / n))[0])(vjp))

        def update(p, state, acc):
            return (*adamw(p, state, jax.tree.map(lambda g: g.sum(0) / GPT_M, acc)), None)

        fwd, bwd = jax.jit(forward), jax.jit(backward, donate_argnums=(0,))
        upd = jax.jit(update, donate_argnums=(0, 1, 2))

        def step(p, state, x, y):
            xs, ys = (a.reshape(GPT_M, -1, *a.shape[1:]) for a in (x, y))
            stored = [jax.block_until_ready(fwd(p, xs[i], ys[i])) for i in range(GPT_M)]
            acc = jax.tree.map(lambda a: jax.device_put(np.zeros((n, *a.shape), a.dtype), groups), p)
            for vjp in stored:  # a program at a time, as a worker runs them
                acc = jax.block_until_ready(bwd(acc, vjp))
            return upd(p, state, acc)

        return step

    batches = make_batches(4)
    cases = {}
    for form, make in (("step", whole_step), ("split", split_programs)):
        for d in (1, 2):
            mesh = compat.mesh(np.array(jax.devices()[:d]), ("data",))
            replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
            fresh = lambda tree: jax.tree.map(lambda a: jax.device_put(np.array(a), replicated), tree)
            p = fresh(params)  # own buffers: the step donates them
            state = fresh(optimizer.init(p))
            data = [tuple(jax.device_put(a, split) for a in b) for b in batches]
            cases[f"{form} D={d}"] = [make(mesh), p, state, data]

    def run(case, i):
        step, p, state, data = case
        # One step at a time: XLA:CPU deadlocked here (a collective's rendezvous waited on a
        # device's thread) when 2-device steps were dispatched back to back on one core.
        case[1], case[2], _ = jax.block_until_ready(step(p, state, *data[i % len(data)]))

    for case in cases.values():
        for i in range(2):
            run(case, i)
    times = {}
    for form in ("step", "split"):  # D=1 and D=2 of one form in alternating blocks
        times.update(
            timing.alternating_blocks(
                {name: (lambda i, c=c: run(c, i)) for name, c in cases.items() if name.startswith(form)},
                num_rounds,
                block,
            )
        )
    print(json.dumps(times))


# -- 3. FSDP weights gathered once a step ----------------------------------------------------
def gathering(local_d2, local_d2b, num_rounds: int, block: int, inprocess: bool) -> None:
    """mesh fsdp=2 on both slices: the weights gathered inside every forward and backward
    program (per_microbatch) against once a step by gather{k} (per_step, mpmd/stages/gather.py)."""
    import mpmd

    setups = [("LocalCluster", {"per_microbatch": lambda: local_d2, "per_step": lambda: local_d2b})]
    if inprocess:
        setups.append(
            ("InProcessCluster", {"per_microbatch": mpmd.InProcessCluster, "per_step": mpmd.InProcessCluster})
        )
    side_by_side(
        "3. fsdp_gather",
        {"per_microbatch": ({"fsdp": 2}, "per_microbatch"), "per_step": ({"fsdp": 2}, "per_step")},
        setups,
        num_rounds,
        block,
    )


# -- 2. resharding transfer ------------------------------------------------------------------
def produce_program(sizes: tuple[int, int, int], layout: tuple):
    """A no-input program that makes the activation laid out as `layout` on a mesh of `sizes`
    (data, fsdp, tensor): row i holds the value i everywhere (checked on arrival)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from mpmd.runtime import compat
    from mpmd.runtime.worker import programs
    from mpmd.runtime.worker.mesh import AXES, shape_of

    def produce():
        return ((jax.lax.broadcasted_iota(jnp.float32, ACT_SHAPE, 0),),)

    out = NamedSharding(compat.abstract_mesh(shape_of(sizes), AXES), PartitionSpec(*layout))
    return programs.exported(produce, out_shardings=((out,),))


# name, sender mesh, its layout, receiver mesh, its layout, pieces, what
CASES = [
    ("a", (2, 1, 1), ("data",), (2, 1, 1), ("data",), 2, "data=2 -> data=2, shard to shard"),
    ("a1", (2, 1, 1), ("data",), (2, 1, 1), ("data",), 1, "data=2 -> data=2, sent whole"),
    ("b", (2, 1, 1), ("data",), (1, 1, 2), (), 2, "data=2 -> tensor=2 (replicated)"),
    ("c", (1, 1, 2), (), (2, 1, 1), ("data",), 1, "tensor=2 (replicated) -> data=2"),
]
REF = ("ref", (1, 1, 1), (), (1, 1, 1), (), 1, "D=1 -> D=1, one device each")


class RunIds:
    """Run ids never repeat on a cluster (transfer keys are prefixed with them)."""

    next = 1000

    @classmethod
    def take(cls) -> int:
        cls.next += 1
        return cls.next


def one_way_s(cluster, case, num_reps: int, num_warmup: int = 3) -> list[float]:
    """One-way times of the activation slice 0 -> slice 1 under `case`, after `num_warmup`
    untimed transfers (the first one checked: the array arrives whole and in order)."""
    import numpy as np

    from mpmd.runtime.worker.instructions import Delete, Recv, Run, Send, Spec

    _, src, src_layout, dst, dst_layout, pieces, _ = case
    axes = ("data", "fsdp", "tensor")
    cluster.start(2, meshes=[dict(zip(axes, src)), dict(zip(axes, dst))])
    cluster.load_programs(0, {"produce": produce_program(src, src_layout)})
    cluster.load_programs(1, {})
    spec = Spec(ACT_SHAPE, "float32", dst_layout)
    cluster.install_plan(0, "move", [Run("produce", (), ("a",), "produce"), Send("a", 1, "x", (pieces,)), Delete("a")])
    cluster.install_plan(1, "move", [Recv("b", 0, "x", (spec,), (pieces,))])
    got = cluster.run("move", RunIds.take(), {}, {1: ("b",)})[1].fetched["b"][0]
    want = np.broadcast_to(np.arange(ACT_SHAPE[0], dtype=np.float32)[:, None, None], ACT_SHAPE)
    assert np.array_equal(got, want), f"case {case[0]}: the received array is wrong"
    for _ in range(num_warmup - 1):
        cluster.run("move", RunIds.take(), {}, {})
    out = []
    for _ in range(num_reps):
        sent, received = cluster.run("move", RunIds.take(), {}, {}, trace=True)
        produced = next(e for e in sent.events if e.kind == "run").end_ns
        ready = next(e for e in received.events if e.kind == "recv").end_ns
        out.append((ready - produced) / 1e9)
    return out


def local_reshard_s(case, num_reps: int) -> tuple[float, float]:
    """(cut, assemble) median seconds of `case`'s resharding inside this process, no wire:
    reshard.cut on a 2-device sender mesh (a gather where the pieces are not its shards), then,
    after the pieces are put where the receiver lands them, reshard.assemble on another
    2-device mesh (the receiver's slicing, copying and concatenating)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from mpmd.runtime.worker import mesh
    from mpmd.runtime.wire import reshard

    _, src, src_layout, dst, dst_layout, pieces, _ = case
    devices = jax.devices()
    src_mesh, dst_mesh = mesh.bind(src, devices[:2]), mesh.bind(dst, devices[2:4])
    a = jax.device_put(jax.numpy.zeros(ACT_SHAPE, "float32"), NamedSharding(src_mesh, PartitionSpec(*src_layout)))
    a.block_until_ready()
    cut_s, assemble_s = [], []
    for _ in range(num_reps + 1):
        start = time.perf_counter()
        cut = jax.block_until_ready(reshard.cut(a, pieces))
        cut_s.append(time.perf_counter() - start)
        landed = jax.block_until_ready(
            [jax.device_put(p, d) for p, d in zip(cut, reshard.landing(ACT_SHAPE, dst_layout, dst_mesh, pieces))]
        )
        start = time.perf_counter()
        jax.block_until_ready(reshard.assemble(landed, ACT_SHAPE, dst_layout, dst_mesh))
        assemble_s.append(time.perf_counter() - start)
    return statistics.median(cut_s[1:]), statistics.median(assemble_s[1:])


def resharding(local_d1, local_d2, num_reps: int) -> None:
    # Two passes, the second in reverse order, so load drift over the run hits every case alike.
    cases = CASES + [REF]
    times = {case[0]: [] for case in cases}
    for order in (cases, cases[::-1]):
        for case in order:
            times[case[0]] += one_way_s(local_d1 if case is REF else local_d2, case, -(-num_reps // 2))
    rows = []
    for case in cases:
        local = local_reshard_s(case, num_reps) if case is not REF else None
        t = times[case[0]]
        rows.append((case, statistics.median(t), statistics.quantiles(t, n=4), local))

    print(
        f"\n2. resharding transfer: float32 {list(ACT_SHAPE)} ({ACT_BYTES / 2**20:.0f} MB) slice 0 -> slice 1, "
        f"LocalCluster workers with D=2 (ref: D=1); median one-way of {len(times['a'])} "
        f"(two passes of {len(times['a']) // 2}, each after 3 untimed, the first checked)"
    )
    print(
        f"{'case':>4} {'what':>34} {'pieces':>6} {'one-way ms':>11} {'p25..p75 ms':>12} {'GB/s':>6} "
        f"{'x a':>6} {'local: cut ms':>14} {'assemble ms':>12}"
    )
    base = rows[0][1]
    for case, median, q, local in rows:
        name, *_, pieces, what = case
        cut, assemble = (f"{x / MS:.1f}" for x in local) if local else ("-", "-")
        print(
            f"{name:>4} {what:>34} {pieces:>6} {median / MS:>11.1f} {f'{q[0] / MS:.1f}..{q[2] / MS:.1f}':>12} "
            f"{ACT_BYTES / median / 1e9:>6.2f} {base / median:>6.2f} {cut:>14} {assemble:>12}"
        )


def main() -> None:
    if sys.argv[1:2] == ["--xla-floor-child"]:
        return _xla_floor_child(int(sys.argv[2]), int(sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke run, not a measurement")
    parser.add_argument("--rounds", type=int, default=None, help="alternating blocks per trainer (1.)")
    parser.add_argument("--block", type=int, default=None, help="steps per block (1.)")
    parser.add_argument("--reps", type=int, default=None, help="transfers per case (2.)")
    parser.add_argument("--no-inprocess", action="store_true", help="skip the InProcessCluster ratio (1.)")
    parser.add_argument("--only", choices=("overhead", "transfer", "gather"), help="run one part only")
    args = parser.parse_args()
    import jax

    import mpmd

    n = dict(rounds=2, block=3, reps=3) if args.quick else dict(rounds=8, block=10, reps=24)
    rounds, block, reps = args.rounds or n["rounds"], args.block or n["block"], args.reps or n["reps"]
    start = time.perf_counter()
    print(
        f"bench_mesh{' --quick' if args.quick else ''}: {os.cpu_count()} cores, jax {jax.__version__}, "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    # Both clusters stay up through the run: workers pinned one per core (slot 0 -> core 0,
    # slot 1 -> core 1), one XLA thread each, so the D=1 and D=2 slices get the same cores.
    local_d1 = (
        mpmd.LocalCluster(num_workers=2, devices_per_worker=1, threads_per_worker=1, pin=True)
        if args.only != "gather"
        else None
    )
    local_d2 = mpmd.LocalCluster(num_workers=2, devices_per_worker=2, threads_per_worker=1, pin=True)
    # A second D=2 cluster for 3.: both fsdp_gather trainers live side by side.
    local_d2b = (
        mpmd.LocalCluster(num_workers=2, devices_per_worker=2, threads_per_worker=1, pin=True)
        if args.only in (None, "gather")
        else None
    )
    try:
        if args.only in (None, "overhead"):
            overhead(local_d1, local_d2, rounds, block, not args.no_inprocess)
        if args.only in (None, "transfer"):
            resharding(local_d1, local_d2, reps)
        if args.only in (None, "gather"):
            gathering(local_d2, local_d2b, rounds, block, not args.no_inprocess)
    finally:
        for cluster in (local_d1, local_d2, local_d2b):
            if cluster is not None:
                cluster.close()
    print(f"\ntotal {time.perf_counter() - start:.0f} s, load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
