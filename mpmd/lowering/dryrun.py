"""Dry run: replay a schedule on the real runtime with declared task costs and no model.

    result = dry_run(schedules.make("1f1b", 4, 8), {"F": 0.02, "B": 0.04, "W": 0.02},
                     activation_bytes=64 * 2**10, cluster=mpmd.LocalCluster(num_workers=4))
    result.step_s, result.simulated_makespan_s      # measured vs predicted, in seconds

The instruction streams are exactly the training streams the Trainer installs
(`lowering.train_streams`, finished with Deletes and the receive window); only the programs are synthetic: every program
name the streams use becomes a "sleep" program (runtime/worker/programs.py) that takes its task's
declared duration and returns zero bundles of the right shapes, so the sends, receives,
deletes, transfers (activations and cotangents of `activation_bytes` each) and the control
plane are all real. Buffers that never leave a slice (residuals, what B keeps for W) are
scalar stand-ins, created and freed where the training streams create and free them. A sleep costs wall time but no CPU, so on a machine with few cores the
measured step time over the simulated makespan is a property of the runtime (dispatch,
transfers, waits), not of the cores.

Costs, as in mpmd.schedules.simulate: {"F": f, "B": b, "W": w} seconds for every stage, or a callable
cost(task) or a list of per-stage dicts for per-stage costs. A program has one duration, so a
callable must not depend on the microbatch. Program durations: fwd -> F, bwd_in (input
gradient) -> B, bwd_w_* (weight gradient) -> W, bwd_first / bwd_acc (full backward) -> BW
(B + W unless the costs give "BW"), update / sqnorm / reduce / gather -> 0.

One difference from `simulate(schedule, costs)`: in a split-backward schedule the first
stage has no input gradient to compute (its input is data), so the runtime runs no program
for its B tasks. The simulated makespan reported here prices those tasks at 0, so it
predicts what the runtime actually runs.
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple

import numpy as np

from mpmd.lowering import core as lowering
from mpmd.stages import names
from mpmd.schedules import core as schedules
from mpmd.schedules import timeline
from mpmd.schedules.simulate import FULL_BACKWARD, Simulation, cost_function, simulate
from mpmd.runtime.worker import programs
from mpmd.runtime.wire.results import Event
from mpmd.runtime.worker.instructions import Instruction, Run, Spec

PLAN = "dryrun"
SCALAR = (Spec((), "float32"),)
# Program kind -> the declared cost that is its duration (None: free).
_PROGRAM_COSTS = {
    "fwd": "F",
    "bwd_in": "B",
    "bwd_w_first": "W",
    "bwd_w_acc": "W",
    "bwd_first": FULL_BACKWARD,
    "bwd_acc": FULL_BACKWARD,
    "update": None,
    "sqnorm": None,
    "reduce": None,
    "gather": None,
}


class DryRunResult(NamedTuple):
    step_s: list[float]  # controller wall time of each measured step
    simulated_makespan_s: float  # the simulator's prediction for the same step
    events: list[list[tuple[Event, ...]]]  # [step][slice]: traced tasks (empty if trace=False)
    slice_wall_s: list[list[float]]  # [step][slice]: each worker's own wall time of the step
    simulation: Simulation  # the full simulated timeline
    streams: list  # the installed stream of each slice (runtime/worker/streams.py PackedStream)


def dry_run(
    schedule: schedules.Schedule,
    costs,
    activation_bytes: int,
    cluster,
    steps: int = 3,
    trace: bool = True,
    warmup_steps: int = 1,
    clip: bool = False,
    run_ahead: int = 0,
    reduce: bool = False,
    gather: bool = False,
) -> DryRunResult:
    """Run `steps` training steps of `schedule` on `cluster` with sleep programs.

    `cluster` is any cluster (InProcessCluster, LocalCluster, StaticCluster); it is started
    here with one slice per schedule slice and left open: the caller closes it (a
    LocalCluster can serve several dry runs; an InProcessCluster serves one).
    `warmup_steps` run first and are not reported (the first step opens connections).
    `clip` adds the global-norm exchange that gradient clipping performs. `run_ahead`: steps
    launched beyond the oldest in flight (Cluster.launch); a step's time is then the time
    between its collection and the one before it. `reduce`, `gather`: every stage's stream
    has the tasks of a mesh slice that reduces its gradients once a step (reduce{k} after its
    last gradient task, mpmd/stages/partials.py) and gathers its FSDP weights once a step
    (gather{k} before its first forward, mpmd/stages/gather.py), priced at 0 s: what they add
    is the runtime's cost of a task.
    """
    for name, value, low in (
        ("activation_bytes", activation_bytes, 0),
        ("steps", steps, 1),
        ("warmup_steps", warmup_steps, 0),
        ("run_ahead", run_ahead, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    timeline.validate(schedule)
    cost = _per_stage_costs(schedule, costs)
    S, P, placement = schedule.num_stages, len(schedule.slices), schedule.placement

    # One float32 bundle of activation_bytes (rounded down to whole floats) for every
    # activation and cotangent; everything else a scalar.
    act = (Spec((activation_bytes // 4,), "float32"),)
    io = lowering.StageIO(partial=(reduce,) * S, gather=(gather,) * S)
    raw = lowering.train_streams(schedule, lowering.Transfers.plain([act] * (S + 1)), clip, io=io)
    m = schedule.num_microbatches
    inputs = {r: {names.inputs(j) for j in range(m)} if r == placement[0] else set() for r in range(P)}
    inputs[placement[-1]] |= {names.targets(j) for j in range(m)}
    # Kept (name templates, runtime/worker/streams.py): state and the inputs, put once for every step.
    K, J = "{k}", "{j}"
    kept = {names.params(K), names.opt_state(K), names.inputs(J), names.targets(J)}
    windows = lowering.recv_windows(schedule)
    streams = [s.finishing(kept, windows[r]) for r, s in enumerate(raw)]
    specs = [_sleep_programs(s, cost, act) for s in streams]

    cluster.start(P)
    zero = [np.zeros((), np.float32)]
    for r in range(P):
        cluster.load_programs(r, specs[r])
        cluster.install_plan(r, PLAN, streams[r])
        # No model: parameters, optimizer state and microbatch inputs are scalar stand-ins,
        # put once and kept (the streams keep them), so a step's Run carries no feeds.
        mine = schedule.stages_on(r)
        for name in sorted({names.params(k) for k in mine} | {names.opt_state(k) for k in mine} | inputs[r]):
            cluster.put(r, name, zero)

    step_s, events, walls = [], [], []
    launched = collections.deque()  # (step, PendingRun), oldest first
    total = warmup_steps + steps
    for step in range(total):
        if not launched:
            collected_at = time.perf_counter()
        launched.append((step, cluster.launch(PLAN, step + 1, {}, {}, trace)))
        while len(launched) > run_ahead or (step == total - 1 and launched):
            done, run = launched.popleft()
            results = run.result()
            now = time.perf_counter()
            elapsed, collected_at = now - collected_at, now
            if done >= warmup_steps:
                step_s.append(elapsed)
                events.append([r.events for r in results])
                walls.append([r.wall_s for r in results])

    sim = simulate(schedule, _executed(schedule, cost))
    return DryRunResult(step_s, sim.makespan, events, walls, sim, streams)


def _per_stage_costs(schedule: schedules.Schedule, costs):
    """cost(stage, kind) in seconds, checked to be the same for every microbatch."""
    split = cost_function(costs, split_backward=True)  # raw F, B, W; validates `costs`
    full = cost_function(costs, split_backward=False)  # its B is the full backward
    kinds = {
        schedules.FORWARD: split,
        schedules.BACKWARD: split,
        schedules.WEIGHT: split,
        FULL_BACKWARD: lambda task: full(task._replace(kind=schedules.BACKWARD)),
    }
    table = {}
    for k in range(schedule.num_stages):
        for kind, task_cost in kinds.items():
            values = {task_cost(schedules.Task(k, j, kind)) for j in range(schedule.num_microbatches)}
            if len(values) != 1:
                raise ValueError(
                    f"dry run costs must not depend on the microbatch (one program per "
                    f"stage and kind has one duration): stage {k} {kind} costs "
                    f"{sorted(values)} over microbatches"
                )
            table[k, kind] = values.pop()
    return lambda stage, kind: table[stage, kind]


def executed_costs(schedule: schedules.Schedule, costs) -> list[dict]:
    """Per-stage costs of what the runtime runs for `schedule` under `costs`, for
    mpmd.schedules.simulate: `costs` itself except that the first stage's B costs 0 in a split-backward
    schedule (see the module doc). E.g. simulate(schedule, executed_costs(schedule, costs))."""
    return _executed(schedule, _per_stage_costs(schedule, costs))


def _executed(schedule: schedules.Schedule, cost) -> list[dict]:
    kinds = (schedules.FORWARD, schedules.BACKWARD, schedules.WEIGHT, FULL_BACKWARD)
    table = [{kind: cost(k, kind) for kind in kinds} for k in range(schedule.num_stages)]
    if schedule.split_backward:
        table[0][schedules.BACKWARD] = 0.0
    return table


def _sleep_programs(stream: list[Instruction], cost, act: tuple[Spec, ...]) -> dict:
    """A sleep program for every program name `stream` runs, with outputs shaped by name:
    activations and cotangents get `act`, everything else a scalar bundle."""
    out: dict[str, programs.ProgramSpec] = {}
    for ins in stream:
        if not isinstance(ins, Run):
            continue
        program = names.parse_program(ins.program)
        assert program.kind in _PROGRAM_COSTS, f"dryrun does not price program {ins.program!r}"
        kind = _PROGRAM_COSTS[program.kind]
        duration_s = 0.0 if kind is None else cost(program.stage, kind)
        outputs = tuple(
            act if names.parse_buffer(name).kind in ("activation", "cotangent") else SCALAR for name in ins.outputs
        )
        spec = programs.sleep(duration_s, outputs)
        assert out.setdefault(ins.program, spec) == spec, (ins.program, out[ins.program], spec)
    return out
