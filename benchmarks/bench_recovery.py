"""Recovery after a lost worker, part by part, and what checkpointing costs a step.

    .venv/bin/python benchmarks/bench_recovery.py [--quick] [--model tiny|small|both]
        [--only recovery|cost|snapshot|tier]

Model: the tiny GPT recipe's (vocab 256, d_model 64, 2 heads, 4 layers, seq 64, batch 16)
or with --model small gpt_small's (d_model 256, 4 heads, 8 layers, seq 128, batch 32), 2 stages,
1F1B, 4 microbatches, adamw, LocalCluster(num_workers=2) (real processes, gRPC),
checkpoints in a temporary run_dir.

a. Recovery, checkpoint_every=5, side by side: the persistent tier only; the in-memory tier
   too (memory_every=1; a row notes it if a recovery restored from another tier); the same
   with a hot spare (hot_spares=1: the loss is taken over by a warm worker); and a slice
   served by a gang of two processes (mesh data=2), with a hot spare gang. Slice 1's worker
   (a gang's last process) gets a signal (by pid) halfway through a step:
   SIGKILL (the process is gone: its RPCs fail at once) and SIGSTOP (it hangs: its heartbeat
   goes unanswered and its probe finds no process answering, runtime/control/heartbeat.py;
   failure_timeout_s, LocalCluster's default 5 s, only bounds it). Rounds alternate the two
   signals; medians over rounds. The parts, in order:
     detect  signal -> WorkerLost: signal to Rewound caught, minus the parts below that
             happen between them (replace, restore; trainer.recovery_s)
     spawn   the old process killed and reaped, a new one started and reporting ready
             (0 with a hot spare: the spare takes over, and its own replacement starts
             in the background once a step went through)
     setup   connect, Setup, every slice's Connect to the new peer table (and waiting for a
             checkpoint commit in flight, if any)
     ship    the lost slice's programs and plans sent again (compiled later, on first Run)
     restore every slice restored: from the last committed checkpoint, or (memory tier)
             survivors from their own snapshot and the new worker from its peer's copy
             (then a fresh snapshot, so the new worker holds its peer's copy again)
     1st     the first step after recovery: a new worker compiles its programs on its
             first Run; "of it compile" = 1st - the median steady step; "compiles" the
             executables XLA built in it, every slice together (0 with a hot spare)
     replay  the other steps computed again: (replayed - 1) x the steady step
   total = detect + spawn + setup + ship + restore + 1st step + replay. Goals: < 10 s for
   SIGKILL; with a hot spare and the in-memory tier < 0.3 s for SIGKILL, <= 1 s for SIGSTOP.
   spawn/setup/ship are timed by a LocalCluster subclass defined here (benchmark only).
b. Checkpoint cost per step, a save every step: no checkpointing vs the in-memory tier
   (memory_every=1: each slice's snapshot, and its copy sent to the peer slice, in the step;
   packed into one array per dtype, and "per-array": as before packing, each array on its own,
   by a benchmark-only subclass of the tier that leaves packing out of its plan)
   vs async persistent saves (checkpoint_every=1: every slice snapshots at once, writes in the
   background; a step waits only when two saves are already in flight) vs synchronous ones
   (the step waits until the write is committed). Four Trainers side by side, rounds interleaved
   (order rotated each round; an async write still in flight at the end of a round is
   waited for, untimed, so it does not slow the next Trainer's round). Median wall time of
   trainer.step (the save is inside it), its ratio to no checkpointing, and the median
   snapshot (blocking part) and finalize (write + commit) times from last_save_s (the
   memory tier's snapshot from trainer.memory.last_snapshot_s).
c. The in-memory tier's cost as a user pays it: `mpmd train configs/gpt_<model>.yaml` with
   checkpoint.memory_every=1 against without, rounds alternating (bench_memory_tier.py).

Workers inherit this process's stderr; it is sent to a log file (path printed) so Orbax's
INFO lines do not bury the tables. The load average is printed at the start and end: on a
2-core machine other processes inflate every figure.
"""

from __future__ import annotations

import os

# Before jax is imported: one host device per slice in this process, and no Eigen threads.
import cpu_setup  # noqa: E402  (first: sets the flags before anything imports jax)

cpu_setup.before_jax(devices=2)

import argparse  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from mpmd.runtime.launchers.workers import process_alive  # noqa: E402

MODELS = {  # gpt_tiny's and gpt_small's shapes (configs/), 2 stages
    "tiny": (dict(vocab_size=256, d_model=64, num_heads=2, num_layers=4, seq_len=64), 16),
    "small": (dict(vocab_size=256, d_model=256, num_heads=4, num_layers=8, seq_len=128), 32),
}
GPT, BATCH = MODELS["tiny"]
MODEL = "gpt_tiny"
M, LR, EVERY = 4, 3e-4, 5
TIERS = {"persistent": {}, "memory": {"memory_every": 1}}  # the mpmd.Checkpointing arguments of each
GOAL_S = 10.0
HOT_GOAL_S = 0.3  # a SIGKILL with a hot spare and the in-memory tier (issue 56)
SIGSTOP_GOAL_S = 1.0
PARTS = ("detect", "spawn", "setup", "ship", "restore", "first")


def make_trainer(cluster, **kw):
    from mpmd import models
    import mpmd
    import optax
    from flax import nnx

    pipe = mpmd.Pipeline(mpmd.split(models.GPT(**GPT, rngs=nnx.Rngs(0)), num_stages=2), models.lm_loss)
    return mpmd.Trainer(pipe, optax.adamw(LR), schedule="1f1b", num_microbatches=M, cluster=cluster, **kw)


def batches(n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, GPT["vocab_size"], (BATCH, GPT["seq_len"])).astype(np.int32) for _ in range(n)]


def timed_step(trainer, batch) -> float:
    t0 = time.perf_counter()
    trainer.step(batch, batch)
    return time.perf_counter() - t0


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def workers_log_to(tmp: str, name: str) -> Path:
    """Send this process's stderr (fd 2, which the workers inherit: Orbax's INFO lines) to
    <name>_<pid>.log beside the directory `tmp`, so they do not bury the tables; its path."""
    path = Path(tmp).parent / f"{name}_{os.getpid()}.log"
    with open(path, "w") as log:
        os.dup2(log.fileno(), 2)
    return path


# -- a. recovery -----------------------------------------------------------------------------
def timed_cluster(**kw):
    """A LocalCluster whose replace() records how long its parts took (in .parts)."""
    import mpmd

    class TimedLocalCluster(mpmd.LocalCluster):
        parts: dict = {}
        _in_replace = False

        def replace(self, slice_index, wait_s=None):
            self.parts, self._in_replace = {"spawn": 0.0, "ship": 0.0}, True
            t0 = time.perf_counter()
            try:
                super().replace(slice_index, wait_s)
            finally:
                self._in_replace = False
            self.parts["replace"] = time.perf_counter() - t0

        def _new_worker(self, slice_index, wait_s):
            t0 = time.perf_counter()
            address = super()._new_worker(slice_index, wait_s)
            if self._in_replace and threading.current_thread() is threading.main_thread():
                self.parts["spawn"] += time.perf_counter() - t0  # not a hot spare started behind
            return address

        def _load(self, slice_index, specs):
            t0 = time.perf_counter()
            super()._load(slice_index, specs)
            if self._in_replace:
                self.parts["ship"] += time.perf_counter() - t0

        def _install(self, slice_index, name, stream):
            t0 = time.perf_counter()
            super()._install(slice_index, name, stream)
            if self._in_replace:
                self.parts["ship"] += time.perf_counter() - t0

    return TimedLocalCluster(**kw)


def lose_worker(trainer, data, sig: int, steady_s: float) -> dict:
    """Send `sig` to worker 1 halfway through a step; step until Rewound; time the parts."""
    import mpmd

    cluster = trainer.cluster
    pid = cluster.slice_pids(1)[-1]  # its last process, for a gang
    sent = []

    def send():
        sent.append(time.perf_counter())
        os.kill(pid, sig)

    threading.Timer(steady_s / 2, send).start()
    i = 0
    while True:
        try:
            trainer.step(data[i % len(data)], data[i % len(data)])
        except mpmd.Rewound:
            caught = time.perf_counter()
            break
        i += 1
        assert i < 1000, "the worker was never declared lost"
    rec, parts = trainer.recovery_s, cluster.parts
    out = {
        "detect": caught - sent[0] - rec["replace_s"] - rec["restore_s"],
        "spawn": parts["spawn"],
        "ship": parts["ship"],
        "setup": rec["replace_s"] - parts["spawn"] - parts["ship"],
        "restore": rec["restore_s"],
    }
    t0 = time.perf_counter()
    first = trainer.step(data[0], data[0])
    out["first"] = time.perf_counter() - t0
    out["compiles"] = first.get("compiles", 0)  # executables built in it, every slice together
    return out


# The setups side by side: (name, mpmd.Checkpointing arguments, LocalCluster arguments, the
# Trainer's mesh). "gang": each slice two processes of one device (a mesh of 2 on data).
SETUPS = (
    ("persistent", {}, {}, None),
    ("memory", {"memory_every": 1}, {}, None),
    ("memory+hot", {"memory_every": 1}, {"hot_spares": 1}, None),
    ("gang+hot", {"memory_every": 1}, {"hot_spares": 1, "processes_per_slice": 2}, {"data": 2}),
)


def wait_for_spares(cluster, timeout_s: float = 300.0) -> None:
    """Until the cluster holds its hot spares again, warm (one is started after each loss)."""
    deadline = time.monotonic() + timeout_s
    while cluster.spares.ready < cluster.hot_spares and time.monotonic() < deadline:
        time.sleep(0.1)


def recovery(run_dir: Path, num_rounds: int, setups=SETUPS) -> None:
    """Per setup (persistent tier only; plus the in-memory tier every step; plus a hot spare;
    a gang slice with a hot spare), the signals' rounds. Each loss comes in the 3rd step after
    a persistent commit: the persistent tier replays 3 steps, the memory tier only the failed
    one. "replay" is those steps' time (replayed x the setup's steady step) and counts in the
    total. With a hot spare, each loss waits until the spare started after the last is warm;
    the steady step is timed only then (the 2 steps before each loss), not while a new spare
    starts and compiles beside the run on the same cores."""
    import mpmd

    signals = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}
    data = batches()
    results: dict[tuple, list[dict]] = {}
    steady: dict[str, list[float]] = {}
    pids, failure_timeout_s = [], None
    for name_setup, kw, cluster_kw, mesh in setups:
        cluster = timed_cluster(num_workers=2, **cluster_kw)
        failure_timeout_s = cluster.failure_timeout_s
        trainer = make_trainer(
            cluster,
            run_dir=run_dir / name_setup,
            checkpoint=mpmd.Checkpointing(every=EVERY, **kw),
            recovery=mpmd.Recovery(max_restarts=10**6),
            **({"mesh": mesh} if mesh else {}),
        )
        steady[name_setup] = []
        try:
            for x in data[:2]:
                timed_step(trainer, x)  # compile
            for _ in range(num_rounds):
                for name, sig in signals.items():
                    # A step just committed, then 2 steady steps to size the delay: the loss
                    # comes in the 3rd step after the commit.
                    while trainer.step_count < EVERY or trainer.step_count % EVERY != 0:
                        timed_step(trainer, data[trainer.step_count % len(data)])
                    trainer.checkpoints.wait()
                    wait_for_spares(cluster)
                    recent = [timed_step(trainer, data[j]) for j in range(2)]
                    steady[name_setup] += recent
                    row = lose_worker(trainer, data, sig, med(recent))
                    row["replayed"] = trainer.recovery_s["replayed"]
                    row["tier"] = trainer.recovery_s["tier"]
                    row["hot"] = cluster.spares.promoted
                    results.setdefault((name_setup, name), []).append(row)
            pids += list(cluster.pids)
        finally:
            trainer.close()
    print(
        f"\na. recovery of slice 1 (2 slices, 1f1b, m={M}, batch {BATCH}, checkpoint_every={EVERY}, "
        f"failure_timeout_s={failure_timeout_s:g}); medians over {num_rounds} round(s), seconds"
    )
    print(
        f"{'setup':>10} {'signal':>8} {'detect':>7} {'spawn':>6} {'setup':>6} {'ship':>6} {'restore':>8} "
        f"{'1st step':>9} {'(compile)':>10} {'compiles':>9} {'replayed':>9} {'replay':>7} {'total':>6}  "
        f"goal: {GOAL_S:g} s; memory+hot {HOT_GOAL_S:g} s (SIGKILL), {SIGSTOP_GOAL_S:g} s (SIGSTOP)"
    )
    for (name_setup, name), rows in results.items():
        steady_s = med(steady[name_setup])
        for r in rows:
            r["replay"] = max(r["replayed"] - 1, 0) * steady_s  # the 1st step is timed already
        m = {p: med([r[p] for r in rows]) for p in PARTS + ("replay", "replayed", "compiles")}
        tier = "persistent" if name_setup == "persistent" else "memory"
        used = sorted({r["tier"] for r in rows})
        total = med([sum(r[p] for p in PARTS + ("replay",)) for r in rows])
        # The goals are for gpt_tiny with the in-memory tier and a hot spare; every
        # other row is held to the general one.
        hot = name_setup == "memory+hot"
        goal = (HOT_GOAL_S if name == "SIGKILL" else SIGSTOP_GOAL_S) if hot else GOAL_S
        verdict = f"{'met' if total <= goal else 'MISSED'} (goal {goal:g} s)"
        print(
            f"{name_setup:>10} {name:>8} {m['detect']:>7.2f} {m['spawn']:>6.2f} {m['setup']:>6.2f} "
            f"{m['ship']:>6.3f} {m['restore']:>8.3f} {m['first']:>9.2f} {m['first'] - steady_s:>10.2f} "
            f"{m['compiles']:>9.0f} {m['replayed']:>9.0f} {m['replay']:>7.2f} {total:>6.2f}  {verdict}"
            f"{'' if used == [tier] else f' restored from {used}'}"
        )
    print(
        "steady step "
        + ", ".join(f"{k} {med(v) * 1e3:.0f} ms" for k, v in steady.items())
        + f" (medians); worker processes left: {len([p for p in pids if process_alive(p)])}"
    )


# -- b. checkpoint cost per step -------------------------------------------------------------
VARIANTS = {
    "none": {},
    "memory": dict(memory_every=1),
    "per-array": dict(memory_every=1),
    "async": dict(asynchronous=True, every=1),
    "sync": dict(asynchronous=False, every=1),
}  # mpmd.Checkpointing


def per_array_snapshots():
    """The in-memory tier as it was before packing (until 2026-12-03): every array of a
    stage's state copied, sent and re-placed on its own. Benchmark only: the snapshot plan
    of mpmd/train/snapshots.py with its Pack and Unpack left out."""
    from mpmd.runtime.worker.instructions import Copy, Recv, Send
    from mpmd.train import snapshots

    class PerArraySnapshots(snapshots.MemorySnapshots):
        def _snapshot_stream(self, r, g):
            stream = []
            for k in self._stages(r):
                for b in self._buffers[k]:
                    stream.append(Copy(b, f"s{g}/{b}", "host"))
                    if self.peer(r) is not None:
                        stream.append(Send(b, self.peer(r), f"s{g}/{b}"))
            for src, k in self._held(r):
                for b, specs in zip(self._buffers[k], self.packings[k].specs):
                    stream += [Recv(f"c{g}/{b}", src, f"s{g}/{b}", specs), Copy(f"c{g}/{b}", f"c{g}/{b}", "host")]
            return stream

    return PerArraySnapshots


def checkpoint_cost(run_dir: Path, num_rounds: int, steps_per_round: int, variants=tuple(VARIANTS)) -> None:
    """Per variant of VARIANTS the median step; "per-array" is the in-memory tier unpacked."""
    import mpmd
    from mpmd.train import snapshots

    data = batches()
    trainers = {}
    try:
        for name in variants:
            kw = VARIANTS[name]
            where = {"run_dir": run_dir / name} if "every" in kw else {}
            packed = snapshots.MemorySnapshots
            if name == "per-array":  # the Trainer makes its tier at its first step
                snapshots.MemorySnapshots = per_array_snapshots()
            try:
                trainers[name] = make_trainer(
                    mpmd.LocalCluster(num_workers=2), checkpoint=mpmd.Checkpointing(**kw), **where
                )
                for x in data[:2]:
                    timed_step(trainers[name], x)  # compile (and the first saves)
            finally:
                snapshots.MemorySnapshots = packed
            if trainers[name].checkpoints is not None:
                trainers[name].checkpoints.wait()
        step_s = {name: [] for name in variants}
        saves = {name: [] for name in variants}
        names = list(variants)
        for r in range(num_rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t = trainers[name]
                for j in range(steps_per_round):
                    step_s[name].append(timed_step(t, data[j % len(data)]))
                    if t.memory is not None:
                        saves[name].append({"snapshot_s": t.memory.last_snapshot_s})
                    if t.checkpoints is not None:
                        # One dict per save; an async commit fills in its finalize_s later
                        # (before the next save starts, or at the wait below).
                        saves[name].append(t.checkpoints.last_save_s)
                if t.checkpoints is not None:
                    t.checkpoints.wait()
    finally:
        for t in trainers.values():
            t.close()
    base = med(step_s["none"])
    print(
        f"\nb. checkpoint cost per step at {MODEL}, a save every step (memory: memory_every=1, packed, no "
        f"persistent saves; per-array: the same, each array on its own as before packing; async/sync: "
        f"checkpoint_every=1); {num_rounds} interleaved round(s) of {steps_per_round} steps per "
        f"variant. snapshot: the save's blocking part in the step (all slices at once); finalize: from "
        f"then until the step's manifest is committed, in the background for async"
    )
    print(f"{'variant':>9} {'step ms':>8} {'x none':>7} {'snapshot ms':>12} {'finalize ms':>12}")
    for name in variants:
        snap = med([s["snapshot_s"] for s in saves[name] if "snapshot_s" in s]) * 1e3
        fin = med([s["finalize_s"] for s in saves[name] if "finalize_s" in s]) * 1e3
        shown = f"{snap:>12.1f} {fin:>12.1f}" if saves[name] else f"{'-':>12} {'-':>12}"
        print(f"{name:>9} {med(step_s[name]) * 1e3:>8.1f} {med(step_s[name]) / base:>6.2f}x {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke run, not a measurement")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS) + ["both"],
        default="tiny",
        help="gpt_tiny's or gpt_small's shape, or both one after the other",
    )
    parser.add_argument(
        "--only",
        choices=("recovery", "cost", "snapshot", "tier"),
        help="run one part (snapshot: the cost part's none, memory and per-array rows; tier: c. alone)",
    )
    args = parser.parse_args()
    global GPT, BATCH, MODEL
    import jax
    from mpmd.runtime.launchers.workers import default_compilation_cache

    n = (
        dict(rounds=1, ck_rounds=2, ck_steps=4, tier_rounds=1)
        if args.quick
        else dict(rounds=3, ck_rounds=4, ck_steps=8, tier_rounds=4)
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_recovery_") as tmp:
        print(
            f"bench_recovery{' --quick' if args.quick else ''}: {os.cpu_count()} cores, jax {jax.__version__}, "
            f"load average at start {os.getloadavg()[0]:.2f}; compilation cache "
            f"of workers {default_compilation_cache() or 'off'}; worker logs: "
            f"{workers_log_to(tmp, 'bench_recovery')}",
            flush=True,
        )
        for model in sorted(MODELS, reverse=True) if args.model == "both" else [args.model]:
            GPT, BATCH = MODELS[model]
            MODEL = f"gpt_{model}"
            print(f"\nmodel: {model} {GPT}, batch {BATCH}", flush=True)
            if args.only in (None, "recovery"):
                recovery(Path(tmp) / model / "recovery", n["rounds"])
            if args.only in (None, "cost"):
                checkpoint_cost(Path(tmp) / model / "cost", n["ck_rounds"], n["ck_steps"])
            if args.only == "snapshot":
                checkpoint_cost(
                    Path(tmp) / model / "cost", n["ck_rounds"], n["ck_steps"], ("none", "memory", "per-array")
                )
            if args.only in (None, "tier"):
                import bench_memory_tier

                print(f"\nc. the in-memory tier's cost through `mpmd train configs/{MODEL}.yaml`", flush=True)
                bench_memory_tier.measure(f"configs/{MODEL}.yaml", n["tier_rounds"], 40, [])
    print(f"\ntotal {time.perf_counter() - start:.0f} s, load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
