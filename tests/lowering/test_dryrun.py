"""Dry runs: a schedule replayed on the real runtime with declared costs and no model.

The measured step must cost about what the simulator predicts (loose bounds: this is about
behaviour, not speed), every task of the schedule must run in the schedule's order for its
declared time, and a multi-process cluster must get one Run RPC per worker per step.
"""

import statistics

import pytest

import mpmd
from mpmd.schedules import core as schedules
from mpmd.lowering.dryrun import dry_run
from mpmd.runtime.worker.instructions import Recv, Spec

COSTS = {"F": 0.005, "B": 0.010, "W": 0.005}  # seconds
ACTIVATION_BYTES = 16 * 2**10
P, M = 2, 4


def expected_labels(schedule) -> list[list[str]]:
    """Per slice, the traced Run labels in order: every task (but the first stage's B of a
    split backward, which has no program: its input is data), then the updates."""
    out = []
    for r, tasks in enumerate(schedule.slices):
        labels = [
            f"{t.kind} s{t.stage} mb{t.microbatch}"
            for t in tasks
            if not (schedule.split_backward and t.kind == "B" and t.stage == 0)
        ]
        out.append(labels + [f"U s{k}" for k in range(schedule.num_stages) if k % len(schedule.slices) == r])
    return out


def declared_s(label: str) -> float:
    kind = label.split()[0]
    return {"F": COSTS["F"], "W": COSTS["W"], "U": 0.0}.get(kind, COSTS["B"])


def check(schedule, result) -> None:
    ratio = statistics.median(result.step_s) / result.simulated_makespan_s
    assert 0.95 <= ratio <= 2.0, (schedule.name, result.step_s, result.simulated_makespan_s)
    # activations and cotangents travel at the declared size
    recvs = [i for s in result.streams for i in s if isinstance(i, Recv)]
    assert recvs and all(i.specs == (Spec((ACTIVATION_BYTES // 4,), "float32"),) for i in recvs)
    labels = expected_labels(schedule)
    for step_events in result.events:
        for r, events in enumerate(step_events):
            runs = [e for e in events if e.kind == "run"]
            assert [e.name for e in runs] == labels[r]
            for e in runs:
                full = e.name.startswith("B") and not schedule.split_backward
                want = declared_s(e.name) + (COSTS["W"] if full else 0.0)
                assert (e.end_ns - e.start_ns) / 1e9 >= want * 0.99, (e, want)
            # one task at a time per slice
            assert all(a.end_ns <= b.start_ns for a, b in zip(events, events[1:]))


@pytest.mark.parametrize("name,run_ahead", [("1f1b", 0), ("zb-h1", 0), ("1f1b", 1)])
def test_dry_run_in_process_matches_simulation(name, run_ahead):
    """Also with each step launched while the one before runs: every step still runs its
    tasks in order, one at a time per slice, and takes its simulated time."""
    schedule = schedules.make(name, P, M)
    cluster = mpmd.InProcessCluster()
    try:
        result = dry_run(schedule, COSTS, ACTIVATION_BYTES, cluster, steps=3, run_ahead=run_ahead)
    finally:
        cluster.close()
    assert len(result.step_s) == 3 and len(result.events) == 3
    check(schedule, result)


@pytest.mark.slow
def test_dry_run_on_worker_processes(workers):
    for name in ("1f1b", "zb-h1"):
        schedule = schedules.make(name, P, M)
        before = workers.rpc_counts["Run"]
        result = dry_run(schedule, COSTS, ACTIVATION_BYTES, workers, steps=3, warmup_steps=1)
        assert workers.rpc_counts["Run"] - before == P * 4  # one per worker per step
        check(schedule, result)


def test_per_stage_costs_interleaving_and_clipping():
    # 4 stages on 2 slices; the callable prices the last stage double; clip=True adds the
    # global-norm exchange (every slice sends its stages' squared norms to every other).
    schedule = schedules.make("interleaved-1f1b", 4, 4, 2)

    def cost(task):
        return COSTS[task.kind] * (2 if task.stage == 3 else 1)

    cluster = mpmd.InProcessCluster()
    try:
        result = dry_run(schedule, cost, ACTIVATION_BYTES, cluster, steps=2, clip=True)
    finally:
        cluster.close()
    ratio = statistics.median(result.step_s) / result.simulated_makespan_s
    assert 0.95 <= ratio <= 2.0, (result.step_s, result.simulated_makespan_s)
    runs = {e.name: (e.end_ns - e.start_ns) / 1e9 for sl in result.events[-1] for e in sl if e.kind == "run"}
    # Lower bounds only: a task lasts at least its price, and load can only lengthen it (an
    # upper bound on stage 2's forward failed once at 12 ms against 10 ms on a loaded machine).
    assert runs["F s3 mb0"] >= 2 * COSTS["F"] * 0.99 and runs["F s2 mb0"] >= COSTS["F"] * 0.99
    assert {"norm s0", "norm s3"} <= set(runs)


def test_reduce_and_gather_tasks_of_a_mesh_slice_run_once_a_step():
    """reduce=True, gather=True: each stage's stream reduces its gradients once, after its last
    gradient task, and gathers its weights once, before its first forward (free tasks)."""
    schedule = schedules.make("1f1b", P, M)
    cluster = mpmd.InProcessCluster()
    try:
        result = dry_run(schedule, COSTS, ACTIVATION_BYTES, cluster, steps=1, warmup_steps=0, reduce=True, gather=True)
    finally:
        cluster.close()
    for k, events in enumerate(result.events[0]):
        runs = [e.name for e in events if e.kind == "run"]
        assert runs.count(f"gather s{k}") == 1 and runs.count(f"reduce s{k}") == 1
        assert runs.index(f"gather s{k}") < runs.index(f"F s{k} mb0")
        assert runs.index(f"reduce s{k}") == runs.index(f"B s{k} mb{M - 1}") + 1


def test_bad_costs_are_refused_before_any_work():
    schedule = schedules.make("1f1b", P, M)
    with pytest.raises(ValueError, match="must not depend on the microbatch"):
        dry_run(schedule, lambda t: 0.001 * (1 + t.microbatch), ACTIVATION_BYTES, cluster=None)
    with pytest.raises(ValueError, match="exactly the keys"):
        dry_run(schedule, {"F": 0.001}, ACTIVATION_BYTES, cluster=None)
    with pytest.raises(ValueError, match="activation_bytes"):
        dry_run(schedule, COSTS, -1, cluster=None)
