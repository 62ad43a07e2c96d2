"""The runtime measured on itself: scheduling fidelity, per-instruction overhead, overlap of
transfers with compute, and end-to-end GPT training against one core.

    .venv/bin/python benchmarks/bench_runtime.py [--quick]

Every ratio is measured in this one run on this machine. Stage costs are declared "sleep"
programs (mpmd/lowering/dryrun.py) wherever the question is about the runtime, not the cores: a
sleep takes wall time and no CPU, so two cores do not distort it.

a. Scheduling fidelity. p = 4 slices, m = 8, F 20 ms, B 40 ms, W 20 ms (B + W as one task
   where the backward is not split), 64 KB activations; interleaved-1f1b runs 8 stages on
   4 slices at half the per-stage cost, so every slice does the same work. Median measured
   step time / simulated makespan, on LocalCluster(num_workers=4) (real processes, gRPC,
   real transfers) and on InProcessCluster. Goal <= 1.05. The columns after the ratio say
   where the excess over the simulation went, on the slice that finished last:
   ctl = controller wall - that worker's own step wall (RPC, dispatch, reply);
   over = its programs' run time - their declared time (sleep overshoot, tracing);
   gaps = its wall time outside programs and receive waits (executor bookkeeping, sends);
   hop = median latency of a transfer that a slice waited for (sender's task end to data
   ready on the receiver), over all slices: each cross-slice edge on the critical path
   costs about this much, which the simulation (comm_s = 0) does not charge; "x +hop" is
   the measured step over the simulation re-run with comm_s = hop: near 1 when per-hop
   latency explains the excess.
b. Worker overhead per instruction: zero-duration programs, many microbatches; a worker's
   own step wall time / instructions in its stream (p = 1: no transfers, no waits; p = 2:
   receive waits subtracted using the trace). Goal <= 100 us. Plus the control plane:
   RPCs per step by method (must be one Run per worker) and controller time per step
   beyond the slowest worker.
c. Overlap. p = 2, m = 8, 30 ms per task (F and full B) and an activation sized so that one
   transfer takes ~30 ms here (measured first, in this run, by ping-pong on the runtime).
   Overlap bound = simulate(comm_s = transfer time); no overlap = simulate with each
   transfer added to the task that sends it. hidden = share of the transfer time that the
   runtime hid: (no overlap - measured) / (no overlap - overlap bound), shown only where
   the two bounds differ by > 10% (in 1F1B on 2 slices every transfer is on the critical
   path, so there is little to hide). "in-step" = median transfer latency measured inside
   the step from the trace (see a.'s hop), to tell a slow wire from a runtime that does not
   overlap; "x bound(in-step)" is the measured step over the bound re-simulated with it.
d. End to end: GPT (vocab 256, 8 layers, d_model 512, 8 heads, seq 64, batch 32), m = 8,
   1F1B on 2 slices and interleaved-1f1b (v = 2, 4 stages) on LocalCluster(num_workers=2),
   against the unpipelined model: one jitted adamw step in a subprocess pinned to one core
   with XLA's intra-op threads off. speedup = unpipelined / pipelined step time (the
   ceiling on 2 cores is ~2x; the controller shares those cores); "vs accum" divides the
   unpipelined step that accumulates the same 8 microbatches instead (same matmul shapes
   as the pipeline's programs: on CPU the whole-batch step is slower per row). Two more
   traced steps per schedule give each slice's busy share (program time / step), program
   time and receive waits.

The load average is printed at the start and the end: other processes on a 2-core machine
inflate every figure here (sleep wake-ups, transfers and compute all wait for a core), so
compare runs made at low load.
"""

from __future__ import annotations

import os
import sys

# Before jax is imported. The baseline subprocess gets its own flags (run_baseline).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--baseline" not in sys.argv:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MS = 1e-3
FIDELITY_COSTS = {"F": 20 * MS, "B": 40 * MS, "W": 20 * MS}
FIDELITY_P, FIDELITY_M, FIDELITY_ACT_BYTES = 4, 8, 64 * 2**10
OVERLAP_TASK_S, OVERLAP_P, OVERLAP_M = 30 * MS, 2, 8
GPT = dict(vocab_size=256, d_model=512, num_heads=8, num_layers=8, seq_len=64)
GPT_BATCH, GPT_M, LR = 32, 8, 3e-4


def fidelity_cases():
    from mpmd.schedules import core as schedules

    p, m, c = FIDELITY_P, FIDELITY_M, FIDELITY_COSTS
    half = {k: v / 2 for k, v in c.items()}
    return [
        (schedules.make("gpipe", p, m), c),
        (schedules.make("1f1b", p, m), c),
        (schedules.make("zb-h1", p, m), c),
        (schedules.make("interleaved-1f1b", 2 * p, m, 2), half),
    ]


def busy_s(simulation, r: int) -> float:
    """Declared program time of slice r in one step (what its sleeps should take)."""
    return sum(end - start for _, start, end in simulation.spans[r])


def hop_latencies_s(events) -> list[float]:
    """Transfer latencies seen in one traced step: for every receive that had to wait, data
    ready on the receiver minus the end of the producing task on the sender (one clock:
    every slice is on this machine)."""
    ends = {e.name: e.end_ns for slice_events in events for e in slice_events if e.kind == "run"}
    out = []
    for slice_events in events:
        for e in slice_events:
            if e.kind != "recv" or e.end_ns - e.start_ns < 50_000:
                continue  # the data was there already: no latency to see
            what, _, rest = e.name[len("recv ") :].partition("/")
            if what.startswith("act"):
                producer = f"F s{int(what[3:]) - 1} mb{rest}"
            elif what.startswith("grad"):
                producer = f"B s{int(what[4:]) + 1} mb{rest}"
            else:
                continue
            if producer in ends:
                out.append((e.end_ns - ends[producer]) / 1e9)
    return out


def excess_breakdown(result) -> tuple[float, float, float, float]:
    """(ctl, over, gaps, hop) in seconds, medians over steps: the first three for the slice
    that finished last, hop over all slices."""
    ctl, over, gaps, hops = [], [], [], []
    for step_s, walls, events in zip(result.step_s, result.slice_wall_s, result.events):
        r = max(range(len(walls)), key=walls.__getitem__)
        run_s = sum(e.end_ns - e.start_ns for e in events[r] if e.kind == "run") / 1e9
        recv_s = sum(e.end_ns - e.start_ns for e in events[r] if e.kind == "recv") / 1e9
        ctl.append(step_s - walls[r])
        over.append(run_s - busy_s(result.simulation, r))
        gaps.append(walls[r] - run_s - recv_s)
        hops += hop_latencies_s(events)
    hop = statistics.median(hops) if hops else float("nan")
    return statistics.median(ctl), statistics.median(over), statistics.median(gaps), hop


def goal(ok: bool) -> str:
    return "met" if ok else "MISSED"


# -- a. scheduling fidelity -------------------------------------------------------------------
def fidelity(local, num_steps: int) -> None:
    import mpmd
    from mpmd.lowering.dryrun import dry_run, executed_costs
    from mpmd.schedules.simulate import simulate

    print(
        f"\na. scheduling fidelity: p={FIDELITY_P} slices, m={FIDELITY_M}, F/B/W = "
        f"{'/'.join(f'{v / MS:g}' for v in FIDELITY_COSTS.values())} ms, activations "
        f"{FIDELITY_ACT_BYTES // 2**10} KB, median of {num_steps} steps (goal: ratio <= 1.05)"
    )
    print(
        f"{'schedule':>17} {'cluster':>10} {'simulated ms':>13} {'measured ms':>12} {'ratio':>6} "
        f"{'ctl ms':>7} {'over ms':>8} {'gaps ms':>8} {'hop ms':>7} {'x +hop':>7}  goal"
    )
    for schedule, costs in fidelity_cases():
        for label, make in (("local", lambda: local), ("in-process", mpmd.InProcessCluster)):
            cluster = make()
            try:
                result = dry_run(schedule, costs, FIDELITY_ACT_BYTES, cluster, steps=num_steps)
            finally:
                if cluster is not local:
                    cluster.close()
            measured = statistics.median(result.step_s)
            ratio = measured / result.simulated_makespan_s
            ctl, over, gaps, hop = excess_breakdown(result)
            with_hops = simulate(schedule, executed_costs(schedule, costs), comm_s=hop).makespan
            name = schedule.name + (f" v={schedule.virtual_stages}" if schedule.virtual_stages > 1 else "")
            print(
                f"{name:>17} {label:>10} {result.simulated_makespan_s / MS:>13.1f} {measured / MS:>12.1f} "
                f"{ratio:>6.3f} {ctl / MS:>7.2f} {over / MS:>8.2f} {gaps / MS:>8.2f} {hop / MS:>7.2f} "
                f"{measured / with_hops:>7.3f}  "
                f"{goal(ratio <= 1.05) if label == 'local' else '(reference)'}"
            )


# -- b. per-instruction overhead and dispatch ------------------------------------------------
def overhead(local, num_steps: int, num_microbatches: int) -> None:
    import mpmd
    from mpmd.schedules import core as schedules
    from mpmd.lowering.dryrun import dry_run

    zero = {"F": 0.0, "B": 0.0, "W": 0.0}
    print(
        f"\nb. worker overhead per instruction: zero-duration programs, 1f1b, m={num_microbatches}, "
        f"median of {num_steps} steps (goal <= 100 us)"
    )
    print(f"{'case':>38} {'instructions':>13} {'worker step ms':>15} {'waits ms':>9} {'us/instr':>9}  goal")
    cases = (
        ("p=1 LocalCluster worker, untraced", 1, local, False),
        ("p=1 InProcessCluster, untraced", 1, None, False),
        ("p=2 LocalCluster workers, traced", 2, local, True),
    )
    for label, p, cluster, trace in cases:
        cluster = cluster or mpmd.InProcessCluster()
        schedule = schedules.make("1f1b", p, num_microbatches)
        before = dict(local.rpc_counts)
        t0 = time.perf_counter()
        try:
            result = dry_run(schedule, zero, 4 * 2**10, cluster, steps=num_steps, trace=trace)
        finally:
            if cluster is not local:
                cluster.close()
        elapsed = time.perf_counter() - t0
        per_instr, walls, waits = [], [], []
        for step_walls, step_events in zip(result.slice_wall_s, result.events):
            for r, wall in enumerate(step_walls):
                wait = sum(e.end_ns - e.start_ns for e in step_events[r] if e.kind == "recv") / 1e9
                per_instr.append((wall - wait) / len(result.streams[r]))
                walls.append(wall)
                waits.append(wait)
        us = statistics.median(per_instr) / 1e-6
        num_instr = "/".join(str(len(s)) for s in result.streams)
        print(
            f"{label:>38} {num_instr:>13} {statistics.median(walls) / MS:>15.2f} "
            f"{statistics.median(waits) / MS:>9.2f} {us:>9.1f}  {goal(us <= 100)}"
        )
        if cluster is local:
            rpcs = {k: v - before.get(k, 0) for k, v in local.rpc_counts.items() if k != "Heartbeat"}
            run_steps = num_steps + 1  # + the warm-up step
            ctl = statistics.median(s - max(w) for s, w in zip(result.step_s, result.slice_wall_s))
            print(
                f"{'':>38} control plane: {rpcs.get('Run', 0) / run_steps:g} Run RPC(s) per step for "
                f"{p} worker(s) ({goal(rpcs.get('Run', 0) == p * run_steps)}: one per worker); "
                f"setup RPCs {sorted((k, v) for k, v in rpcs.items() if k != 'Run')}; "
                f"controller time beyond the slowest worker {ctl / MS:.2f} ms/step "
                f"(whole dry run {elapsed:.1f} s)"
            )


# -- c. overlap of transfers with compute ----------------------------------------------------
def transfer_s(cluster, num_bytes: int, num_reps: int) -> float:
    """One-way transfer time of `num_bytes` slice 0 -> slice 1 on the runtime: half of a
    ping-pong's round trip, both ends timed on slice 0's clock (median of num_reps)."""
    from mpmd.runtime.worker import programs
    from mpmd.runtime.worker.instructions import Delete, Recv, Run, Send, Spec

    spec = (Spec((num_bytes // 4,), "float32"),)
    cluster.start(2)
    cluster.load_programs(0, {"produce": programs.sleep(0.0, (spec,))})
    cluster.load_programs(1, {})
    cluster.install_plan(
        0,
        "pingpong",
        [
            Run("produce", (), ("a",), "produce"),
            Send("a", 1, "ping"),
            Delete("a"),
            Recv("b", 1, "pong", spec),
            Delete("b"),
        ],
    )
    cluster.install_plan(1, "pingpong", [Recv("a", 0, "ping", spec), Send("a", 0, "pong"), Delete("a")])
    one_way = []
    for step in range(1 + num_reps):
        events = cluster.run("pingpong", step + 1, {}, {}, trace=True)[0].events
        produced = next(e for e in events if e.kind == "run").end_ns
        back = next(e for e in events if e.kind == "recv").end_ns
        if step:
            one_way.append((back - produced) / 2e9)
    return statistics.median(one_way)


def overlap(local, num_steps: int) -> None:
    from mpmd.schedules import core as schedules
    from mpmd.lowering.dryrun import dry_run
    from mpmd.schedules.simulate import simulate

    probe = 8 * 2**20
    probe_s = transfer_s(local, probe, 3)
    num_bytes = int(probe * OVERLAP_TASK_S / probe_s) // 4 * 4
    comm_s = transfer_s(local, num_bytes, 5)
    print(
        f"\nc. overlap: p={OVERLAP_P}, m={OVERLAP_M}, {OVERLAP_TASK_S / MS:g} ms per task (F, full B); "
        f"activation {num_bytes / 2**20:.1f} MB, measured one-way transfer {comm_s / MS:.1f} ms "
        f"({num_bytes / comm_s / 1e9:.2f} GB/s; probe {probe // 2**20} MB in {probe_s / MS:.1f} ms); "
        f"median of {num_steps} steps"
    )
    print(
        f"{'schedule':>9} {'no-overlap ms':>14} {'overlap bound ms':>17} {'measured ms':>12} "
        f"{'x bound':>8} {'hidden':>7} {'in-step ms':>11} {'x bound(in-step)':>17}"
    )
    costs = {"F": OVERLAP_TASK_S, "B": OVERLAP_TASK_S, "W": 0.0}
    for name in ("gpipe", "1f1b"):
        schedule = schedules.make(name, OVERLAP_P, OVERLAP_M)
        S = schedule.num_stages

        def serialised(task, S=S):
            # The transfer occupies the task that sends it: F sends forward (not the last
            # stage), B sends backward (not the first).
            sends = (task.kind == "F" and task.stage < S - 1) or (task.kind == "B" and task.stage > 0)
            return costs[task.kind] + (comm_s if sends else 0.0)

        no_overlap = simulate(schedule, serialised).makespan
        bound = simulate(schedule, costs, comm_s=comm_s).makespan
        result = dry_run(schedule, costs, num_bytes, local, steps=num_steps)
        measured = statistics.median(result.step_s)
        hidden = f"{(no_overlap - measured) / (no_overlap - bound):.0%}" if no_overlap - bound > 0.1 * bound else "-"
        in_step = statistics.median(h for events in result.events for h in hop_latencies_s(events))
        bound_in_step = simulate(schedule, costs, comm_s=in_step).makespan
        print(
            f"{name:>9} {no_overlap / MS:>14.1f} {bound / MS:>17.1f} {measured / MS:>12.1f} "
            f"{measured / bound:>8.3f} {hidden:>7} {in_step / MS:>11.1f} {measured / bound_in_step:>17.3f}"
        )


# -- d. end to end ---------------------------------------------------------------------------
def make_batches(num: int) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (GPT_BATCH, GPT["seq_len"])
    return [
        (
            rng.integers(0, GPT["vocab_size"], shape).astype(np.int32),
            rng.integers(0, GPT["vocab_size"], shape).astype(np.int32),
        )
        for _ in range(num)
    ]


def baseline(num_warmup: int, num_steps: int) -> None:
    """Subprocess body: the unpipelined step on one core, one thread; prints JSON.

    Two variants, each one jitted adamw step from the same initial state: "full" computes
    the gradient of the whole batch at once (the brief's baseline); "accum" accumulates it
    over the same GPT_M microbatches the pipeline uses (lax.scan), which separates the
    pipeline's parallel speedup from the change in matmul shapes (on CPU smaller
    microbatches can run faster per row: their activations stay in cache). Timed steps
    alternate between the two, so load drift hits both alike.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from mpmd import models

    graphdef, params0, rest = nnx.split(models.GPT(**GPT, rngs=nnx.Rngs(0)), nnx.Param, ...)
    optimizer = optax.adamw(LR)

    def loss_fn(p, x, y):
        return models.lm_loss(nnx.merge(graphdef, p, rest)(x), y)

    def full_grad(p, x, y):
        return jax.value_and_grad(loss_fn)(p, x, y)

    def accum_grad(p, x, y):
        split = lambda a: a.reshape((GPT_M, a.shape[0] // GPT_M) + a.shape[1:])

        def body(acc, xy):
            loss, grads = jax.value_and_grad(loss_fn)(p, *xy)
            return (acc[0] + loss, jax.tree.map(jnp.add, acc[1], grads)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, p))
        (loss, grads), _ = jax.lax.scan(body, zero, (split(x), split(y)))
        return loss / GPT_M, jax.tree.map(lambda g: g / GPT_M, grads)

    def make_step(grad_fn):
        def step(p, opt_state, x, y):
            loss, grads = grad_fn(p, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, loss

        return jax.jit(step, donate_argnums=(0, 1))

    batches = make_batches(num_warmup + num_steps)
    state, steps, losses, times = {}, {}, {}, {}
    for name, grad_fn in (("full", full_grad), ("accum", accum_grad)):
        steps[name] = make_step(grad_fn)
        params = jax.tree.map(jnp.copy, params0)
        state[name] = (params, optimizer.init(params))
        losses[name], times[name] = [], []
    for i, (x, y) in enumerate(batches):
        for name in ("full", "accum") if i % 2 == 0 else ("accum", "full"):
            start = time.perf_counter()
            params, opt_state, loss = steps[name](*state[name], x, y)
            losses[name].append(float(loss))
            state[name] = (params, opt_state)
            if i >= num_warmup:
                times[name].append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "step_s": {n: statistics.median(t) for n, t in times.items()},
                "losses": losses,
                "cpus": sorted(os.sched_getaffinity(0)),
            }
        )
    )


def run_baseline(num_warmup: int, num_steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")
    out = subprocess.run(
        [sys.executable, __file__, "--baseline", str(num_warmup), str(num_steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def end_to_end(num_warmup: int, num_steps: int, baseline_after: bool = True) -> None:
    import optax
    from flax import nnx

    from mpmd import models
    import mpmd

    # The baseline runs before and (unless quick) after the pipelined runs, and the two are
    # averaged: this machine's load drifts over minutes.
    base_info = run_baseline(num_warmup, num_steps)
    before = base_info.pop("step_s")
    batches = make_batches(num_warmup + num_steps)
    rows = []
    cluster = mpmd.LocalCluster(num_workers=2)
    try:
        for name, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
            num_stages = 2 * v
            model = models.GPT(**GPT, rngs=nnx.Rngs(0))
            pipe = mpmd.Pipeline(mpmd.split(model, num_stages), models.lm_loss)
            trainer = mpmd.Trainer(
                pipe, optax.adamw(LR), schedule=name, num_microbatches=GPT_M, virtual_stages=v, cluster=cluster
            )
            try:
                losses = [trainer.step(x, y)["loss"] for x, y in batches[:num_warmup]]
                # A step's Run returns once its losses are fetched, while the backward and
                # update may still run (asynchronous dispatch); in steady state the time
                # between returns is the step time.
                start = time.perf_counter()
                losses += [trainer.step(x, y)["loss"] for x, y in batches[num_warmup:]]
                step_s = (time.perf_counter() - start) / num_steps
                # Tracing blocks on every task; the first traced step also waits for the
                # previous step's tail, so the second one is shown.
                traced = [trainer.step(*batches[-1], trace=True) for _ in range(2)][-1]
            finally:
                trainer.close(close_cluster=False)
            rows.append((name, num_stages, step_s, losses[0], traced))
    finally:
        cluster.close()
    base = run_baseline(num_warmup, num_steps) if baseline_after else {"step_s": before, **base_info}
    after = base["step_s"]
    base_s = {n: (before[n] + after[n]) / 2 for n in before}

    print(
        f"\nd. end to end: GPT {GPT}, batch {GPT_BATCH}, m={GPT_M}, adamw; {num_steps} timed steps "
        f"after {num_warmup} warm-up"
    )
    for n, what in (("full", "whole batch"), ("accum", f"{GPT_M} accumulated microbatches")):
        print(
            f"unpipelined ({n}: {what}), 1 core {base['cpus']}, 1 thread: {base_s[n]:.3f} s/step "
            f"(before {before[n]:.3f}, after {after[n]:.3f}); first loss {base['losses'][n][0]:.4f}"
        )
    print(
        f"{'schedule':>17} {'stages':>6} {'step s':>7} {'speedup':>8} {'vs accum':>9} {'loss[0]':>8}  "
        f"traced step: per slice busy % / program s / receive wait s"
    )
    for name, num_stages, step_s, loss0, traced in rows:
        shares = []
        for events in traced["events"]:
            wall_ns = events[-1].end_ns - events[0].start_ns
            run_ns = sum(e.end_ns - e.start_ns for e in events if e.kind == "run")
            recv_ns = sum(e.end_ns - e.start_ns for e in events if e.kind == "recv")
            shares.append(f"{run_ns / wall_ns:.0%}/{run_ns / 1e9:.2f}/{recv_ns / 1e9:.2f}")
        print(
            f"{name:>17} {num_stages:>6} {step_s:>7.3f} {base_s['full'] / step_s:>7.2f}x "
            f"{base_s['accum'] / step_s:>8.2f}x {loss0:>8.4f}  "
            f"{'  '.join(shares)} (traced step {traced['step_s']:.3f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke run, not a measurement")
    args = parser.parse_args()
    import jax

    import mpmd

    n = (
        dict(fid=2, instr=2, m=64, ovl=2, e2e_warm=1, e2e=1)
        if args.quick
        else dict(fid=7, instr=5, m=256, ovl=5, e2e_warm=1, e2e=4)
    )
    start = time.perf_counter()
    print(
        f"bench_runtime{' --quick' if args.quick else ''}: {os.cpu_count()} cores, jax {jax.__version__}, "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    local = mpmd.LocalCluster(num_workers=4)
    try:
        fidelity(local, n["fid"])
        overhead(local, n["instr"], n["m"])
        overlap(local, n["ovl"])
    finally:
        local.close()
    end_to_end(n["e2e_warm"], n["e2e"], baseline_after=not args.quick)
    print(f"\ntotal {time.perf_counter() - start:.0f} s, load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--baseline"]:
        # One core, before jax starts its threads: with Eigen's pool off, one thread computes.
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        baseline(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
