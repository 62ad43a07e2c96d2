"""`mpmd tune` / mpmd.tune: the search on declared costs against brute force, the memory cap
against hand-computed peaks, bad arguments, and one tiny real tune whose tuned.yaml trains."""

import numpy as np
import pytest
import yaml

import mpmd
from mpmd.schedules import core as schedules
from mpmd.schedules.simulate import simulate
from mpmd.stages.split import balanced_boundaries
from mpmd.tuner.profile import Profile
from mpmd.tuner.search import search, space
from mpmd.recipes.run import run_log
from tests.support.processes import TINY_GPT, mpmd_command, mpmd_train

MiB = 2**20


def declared(
    sizes=(2, 4, 8, 16),
    units=(4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0),
    latency_s=0.05,
    bytes_per_s=1e6,
    residual=MiB,
    param=MiB,
) -> Profile:
    """A Profile from declared costs (no compute): unit u's F costs units[u] x microbatch size
    x 1 ms plus 0.5 ms (a fixed cost per task that favours fewer microbatches), B = F
    (the first unit's 0), W = F; residuals `residual` bytes per row, kept half that."""
    s = np.asarray(sizes, float)[:, None]
    f = np.asarray(units)[None, :] * s * 1e-3 + 5e-4
    b = f.copy()
    b[:, 0] = 0.0
    n = len(units)
    return Profile(
        tuple(sizes),
        f,
        b,
        f.copy(),
        np.full((len(sizes), n), 1e-3),
        np.full(n, float(param)),
        np.full(n, 2.0 * param),
        s * np.full(n, float(residual)),
        s * np.full(n, residual / 2.0),
        s * np.full(n + 1, 1000.0),
        latency_s,
        bytes_per_s,
    )


def brute_force(profile: Profile, num_slices: int, batch: int) -> tuple[float, tuple]:
    """The fastest step over every (schedule, v, m) the search considers, each simulated
    here from the declared per-unit costs at its own balanced cut points, every task (and
    every stage's update) charged the profile's task_gap_s once, plus its step_overhead_s."""
    best = (float("inf"), None)
    for name, v, m in space(profile, num_slices, batch):
        try:
            schedule = schedules.make(name, v * num_slices, m, v)
        except ValueError:
            continue
        i = profile.microbatch_sizes.index(batch // m)
        f, b, w = profile.forward_s[i], profile.input_grad_s[i], profile.weight_grad_s[i]
        bounds = balanced_boundaries(f + b + w, v * num_slices)
        stages = list(zip(bounds, bounds[1:]))
        g = profile.task_gap_s
        costs = [
            {"F": f[a:z].sum() + g, "B": b[a:z].sum() + g, "W": w[a:z].sum() + g, "BW": (b[a:z] + w[a:z]).sum() + g}
            for a, z in stages
        ]
        if schedule.split_backward:
            costs[0] = dict(costs[0], B=0.0, W=costs[0]["BW"])
        comm = profile.latency_s + max(profile.boundary_bytes[i, c] for c in bounds[1:-1]) / profile.bytes_per_s
        sim = simulate(schedule, costs, comm)
        step = profile.step_overhead_s + max(
            row[-1][2] + sum(profile.update_s[i, a:z].sum() + g for a, z in (stages[k] for k in schedule.stages_on(r)))
            for r, row in enumerate(sim.spans)
        )
        if step < best[0]:
            best = (step, (name, v, m, tuple(bounds[1:-1])))
    return best


@pytest.mark.parametrize(
    "num_slices,batch,task_s", [(2, 16, 0.0), (4, 16, 0.0), (2, 12, 0.0), (2, 16, 2e-3), (4, 16, 5e-4)]
)
def test_search_finds_the_brute_force_optimum(num_slices, batch, task_s):
    profile = declared(sizes=tuple(d for d in range(1, batch + 1) if batch % d == 0))
    profile = profile._replace(task_gap_s=task_s, step_overhead_s=10 * task_s)
    ranked, excluded = search(profile, num_slices, batch, keep=3)
    assert not excluded
    step, (name, v, m, cuts) = brute_force(profile, num_slices, batch)
    best = ranked[0]
    assert best.predicted_step_s == pytest.approx(step, rel=1e-9)
    assert (best.schedule, best.virtual_stages, best.num_microbatches, best.cuts) == (name, v, m, cuts)
    # Pruning keeps the ranking exact: the exhaustive search agrees on the best three.
    everything, _ = search(profile, num_slices, batch, keep=None)
    assert [c.predicted_step_s for c in ranked] == pytest.approx([c.predicted_step_s for c in everything[:3]])
    assert len(everything) > len(ranked)


def test_memory_cap_excludes_by_hand_computed_peak():
    # 4 equal units on 2 slices, one stage each (cuts [2]), m = 4 microbatches of 4 rows:
    # slice 0 holds params + grads (2 x 2 MiB) and optimizer state (4 MiB) = 8 MiB, plus its
    # saved residuals: 2 units x 4 rows x 1 MiB = 8 MiB per microbatch in flight. GPipe keeps
    # all 4 in flight (8 + 32 = 40 MiB), 1F1B two (8 + 16 = 24 MiB); slice 1 under 1F1B one.
    profile = declared(sizes=(4,), units=(1.0, 1.0, 1.0, 1.0))
    kw = dict(num_slices=2, batch_size=16, microbatch_counts=[4], schedule_names=["gpipe", "1f1b"], keep=None)
    ranked, excluded = search(profile, **kw)
    peaks = {c.schedule: c.peak_bytes for c in ranked}
    assert peaks == {"gpipe": (40 * MiB, 40 * MiB), "1f1b": (24 * MiB, 16 * MiB)}
    assert all(c.cuts == (2,) for c in ranked) and not excluded
    ranked, excluded = search(profile, memory_bytes=30 * MiB, **kw)
    assert [c.schedule for c in ranked] == ["1f1b"] and [c.schedule for c in excluded] == ["gpipe"]
    assert np.isnan(excluded[0].predicted_step_s)
    ranked, excluded = search(profile, memory_bytes=24 * MiB, **kw)  # the cap is inclusive
    assert [c.schedule for c in ranked] == ["1f1b"]
    ranked, excluded = search(profile, memory_bytes=24 * MiB - 1, **kw)
    assert ranked == [] and len(excluded) == 2
    with pytest.raises(mpmd.tuner.search.NoCandidateFits, match="no candidate fits memory_gb=0.001.*0.023 GiB"):
        mpmd.tune(
            [object()] * 4,
            None,
            None,
            np.zeros((16, 1)),
            None,
            None,
            2,
            memory_gb=1e-3,
            confirm=0,
            microbatch_counts=[4],
            schedule_names=["1f1b"],
            profile=profile,
            log=lambda _: None,
        )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(memory_gb=0), "memory_gb must be a number > 0"),
        (dict(confirm=-1), "confirm must be an integer >= 0"),
        (dict(num_slices=9), "num_slices=9 needs at least as many units"),
        (dict(microbatch_counts=[3]), r"divisors of the batch size 16 \(\[1, 2, 4, 8, 16\]\), got \[3\]"),
        (dict(schedule_names=["1f2b"]), "schedule_names must be a non-empty list of"),
        (dict(max_virtual_stages=0), "max_virtual_stages must be an integer >= 1"),
    ],
)
def test_bad_tune_arguments_are_value_errors(kw, match):
    args = dict(num_slices=2, profile=declared(), confirm=0, log=lambda _: None)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        mpmd.tune([object()] * 8, None, None, np.zeros((16, 1)), None, None, **args)


def test_split_at_given_cuts():
    from flax import nnx
    from mpmd import models

    model = models.GPT(256, 16, 2, 4, 8, rngs=nnx.Rngs(0))  # 6 layers: embed, 4 blocks, head
    stages = mpmd.split(model, 3, cuts=[1, 4])
    assert [len(s.layers) for s in stages] == [1, 3, 2]
    for cuts, match in (
        ([1], "make 2 stages, but num_stages=3"),
        ([4, 1], "increasing integers in 1..5"),
        ([1, 6], "increasing integers in 1..5"),
    ):
        with pytest.raises(ValueError, match=match):
            mpmd.split(model, 3, cuts=cuts)


@pytest.mark.parametrize(
    "override,match",
    [
        ("tune.confirm=-1", "tune.confirm must be >= 0"),
        ("tune.memory_gb=0", "tune.memory_gb must be > 0"),
        (
            "tune.microbatch_counts=[3]",
            "tune.microbatch_counts=[3] must be a non-empty list of divisors of train.batch_size=8",
        ),
        ("tune.schedule_names=[1f2b]", "tune.schedule_names[0] must be one of"),
        ("pipeline.cuts=[2,1]", "pipeline.cuts=[2, 1] must be 1 increasing layer indices"),
        ("cluster.backend=inprocess", "cluster.backend must be 'local', 'static', 'ray' or 'shared'"),
    ],
)
def test_bad_tune_config_exits_2_and_writes_nothing(tmp_path, override, match):
    output = tmp_path / "tuned.yaml"
    proc = mpmd_command("tune", "configs/gpt_tiny.yaml", *TINY_GPT, f"tune.output={output}", override)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and match in proc.stderr, proc.stderr
    assert not output.exists()


@pytest.mark.slow
def test_tune_writes_a_config_that_trains(tmp_path):
    run_dir, output = tmp_path / "run", tmp_path / "tuned.yaml"
    output_taken = tmp_path / "taken.yaml"
    output_taken.write_text("# mine\n")
    args = [
        "configs/gpt_tiny.yaml",
        *TINY_GPT,
        f"run_dir={run_dir}",
        "cluster.backend=local",
        "tune.microbatch_counts=[1,4]",
        "tune.schedule_names=[1f1b,zb-v]",
        "tune.confirm=1",
        "tune.confirm_steps=1",
    ]
    proc = mpmd_command("tune", *args, f"tune.output={output_taken}")
    assert proc.returncode == 2 and "exists" in proc.stderr and output_taken.read_text() == "# mine\n"
    proc = mpmd_command("tune", *args, f"tune.output={output}", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pred step" in proc.stdout and "meas step" in proc.stdout and " *" in proc.stdout
    tuned = yaml.safe_load(output.read_text())
    p = tuned["pipeline"]
    assert p["schedule"] in ("1f1b", "zb-v") and p["num_microbatches"] in (1, 4)  # m = 1: the profile repeats the batch
    assert len(p["cuts"]) == p["num_stages"] - 1 and p["num_stages"] == 2 * p["virtual_stages"]
    assert tuned["model"]["d_model"] == 32 and tuned["train"]["batch_size"] == 8  # the input's keys kept
    proc = mpmd_train(output, "train.steps=2", "train.eval_every=0", "train.sample_tokens=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in run_log.read(run_dir)] == [1, 2]


def test_profiled_times_follow_a_robust_line_in_the_size():
    from mpmd.tuner.profile import affine_in_size

    sizes = (2, 4, 8, 16)
    seconds = np.array([[1.0, 0.0], [1.5, 1.0], [2.5, 3.0], [4.5, 7.0]])  # 0.5 + 0.25 x, and 0.5 x - 1
    assert np.allclose(affine_in_size(sizes, seconds), seconds)
    spiked = seconds.copy()
    spiked[1] *= 3  # one size measured under a burst of other load
    assert np.allclose(affine_in_size(sizes, spiked)[:, 0], [1.0, 1.5, 2.5, 4.5])
    assert np.array_equal(affine_in_size(sizes[:2], spiked[:2]), spiked[:2])  # two sizes: as measured


def test_a_stage_pays_the_task_cost_once_whatever_its_units():
    # The same compute declared as 4 units or as 8 half units: a stage of twice the units is
    # one program per task, so every prediction is the same (per unit, the 8 halves would
    # pay the 2 ms task cost twice as often).
    whole = declared(sizes=(4,), units=(1.0, 1.0, 1.0, 1.0))._replace(task_gap_s=2e-3, step_overhead_s=5e-3)
    half = lambda a: np.repeat(np.asarray(a) / 2, 2, axis=-1)
    halves = Profile(
        (4,),
        half(whole.forward_s),
        half(whole.input_grad_s),
        half(whole.weight_grad_s),
        half(whole.update_s),
        half(whole.param_bytes),
        half(whole.optimizer_bytes),
        half(whole.residual_bytes),
        half(whole.kept_bytes),
        np.full((1, 9), 4000.0),
        whole.latency_s,
        whole.bytes_per_s,
        2e-3,
        5e-3,
    )
    kw = dict(num_slices=2, batch_size=16, microbatch_counts=[4], schedule_names=["1f1b", "zb-h1", "zb-v"], keep=None)
    by_whole = {(c.schedule, c.cuts): c.predicted_step_s for c in search(whole, **kw)[0]}
    by_halves = {(c.schedule, tuple(u // 2 for u in c.cuts)): c.predicted_step_s for c in search(halves, **kw)[0]}
    assert by_whole == pytest.approx(by_halves, rel=1e-9) and len(by_whole) == 3


def test_profile_fits_program_task_and_step_costs_from_two_groupings():
    from mpmd.tuner.profile import (
        Grouping,
        _grouping_step_s,
        profile_schedule,
        profile_stages,
        program_s,
        task_and_step_s,
    )

    # 6 units on 2 slices with declared compute; every traced program holds 0.4 ms of fixed
    # cost, an untraced step pays 1.5 ms per task and 20 ms per step.
    compute = {
        "F": [3e-3, 1e-3, 2e-3, 2e-3, 1e-3, 4e-3],
        "B": [0.0, 1e-3, 2e-3, 2e-3, 1e-3, 3e-3],
        "W": [5e-3, 1e-3, 2e-3, 2e-3, 1e-3, 3e-3],
        "U": [1e-3] * 6,
    }
    program, task, overhead = 4e-4, 1.5e-3, 2e-2
    groupings = []
    for units_per_stage in (1, 2):
        stages = profile_stages(6, 2, units_per_stage)
        schedule = profile_schedule(6, 2, 4, units_per_stage)
        durations = {}
        for k, (a, z) in enumerate(stages):
            for kind, seconds in compute.items():
                if kind == "B" and a == 0:
                    continue  # the first stage's B runs no program
                total = sum(seconds[a:z]) + (sum(compute["B"][a:z]) if kind == "W" and a == 0 else 0.0)
                durations[kind, k] = total + program
        g = Grouping(stages, schedule, [durations], [0.0])
        groupings.append(g._replace(step_s=[_grouping_step_s(g, 0, program, task) + overhead]))
    single, paired = groupings
    # Unit 0's W is its whole backward here, so its B's seconds sit in W: sum them in.
    single.durations[0]["W", 0] = compute["W"][0] + program
    assert program_s(single, paired) == pytest.approx(program, rel=1e-6)
    fitted_task, fitted_overhead = task_and_step_s(groupings, program)
    assert fitted_task == pytest.approx(task, rel=1e-6) and fitted_overhead == pytest.approx(overhead, rel=1e-6)


def test_slices_sharing_a_core_share_its_time():
    from mpmd.runtime.wire.results import Event
    from mpmd.schedules.simulate import step_s
    from mpmd.tuner.profile import shared_step_s, task_durations

    # Traced: slice 1's forward ran while slice 0's was half done; on one shared core each ran
    # at half speed while both ran, so each took 7.5 ms of the core, not its 10 ms of wall time.
    ms = 1_000_000
    events = [[Event("F s0 mb0", "run", 0, 10 * ms)], [Event("F s1 mb0", "run", 5 * ms, 15 * ms)]]
    assert task_durations([events]) == {("F", 0): [0.010], ("F", 1): [0.010]}
    alone = task_durations([events], core_groups=(((0, 1), 1),))
    assert alone[("F", 0)] == pytest.approx([0.0075]) and alone[("F", 1)] == pytest.approx([0.0075])
    # Priced: two slices on one core take at least their summed work, on two cores as unshared.
    schedule = schedules.make("1f1b", 2, 8)
    costs = [{"F": 1.0, "B": 1.0, "W": 1.0}] * 2
    apart = step_s(schedule, costs, [0.5, 0.5])
    assert shared_step_s(schedule, costs, [0.5, 0.5], 0.0, (((0, 1), 2),)) == apart
    shared = shared_step_s(schedule, costs, [0.5, 0.5], 0.0, (((0, 1), 1),))
    assert shared >= 2 * (8 * 3 + 0.5) > apart


def test_shared_timeline_is_the_simulator_without_sharing_and_shares_only_overlaps():
    import random
    from mpmd.schedules.simulate import step_s
    from mpmd.tuner.profile import _shared_timeline, shared_step_s

    # With no core shared it is the simulator's timeline, for every kind of schedule.
    for name, stages, v in [
        ("gpipe", 4, None),
        ("1f1b", 4, None),
        ("zb-h1", 4, None),
        ("interleaved-1f1b", 8, 2),
        ("zb-v", 8, 2),
        ("dualpipe-v", 8, 2),
    ]:
        schedule = schedules.make(name, stages, 8, v)
        rng = random.Random(stages)
        costs = [
            {"F": rng.uniform(1, 2), "B": rng.uniform(1, 2), "W": rng.uniform(1, 2), "BW": rng.uniform(2, 4)}
            for _ in range(schedule.num_stages)
        ]
        updates = [rng.uniform(0, 1) for _ in range(schedule.num_slices)]
        assert _shared_timeline(schedule, costs, updates, 0.3, []) == pytest.approx(
            step_s(schedule, costs, updates, 0.3), rel=1e-12
        ), name
    # Two slices on one core, 2 stages, 1 microbatch, split backward, unit costs: F0, F1
    # and B1 run alone (the other slice waits on them), then B0 and W1 share the core (2
    # units of work in 2 units of time), then W0 alone: 6, the summed work; unshared 5.
    from mpmd.schedules.core import Schedule, Task

    schedule = Schedule(
        "by hand", 2, 1, 1, True, tuple((Task(k, 0, "F"), Task(k, 0, "B"), Task(k, 0, "W")) for k in range(2)), (0, 1)
    )
    costs = [{"F": 1.0, "B": 1.0, "W": 1.0}] * 2
    assert step_s(schedule, costs, [0.0, 0.0]) == 5.0
    assert shared_step_s(schedule, costs, [0.0, 0.0], 0.0, (((0, 1), 1),)) == pytest.approx(6.0)
    # Each slice runs at least at half speed on a core shared by two: slower than unshared,
    # faster than every task at half speed.
    schedule = schedules.make("1f1b", 4, 4)
    costs = [{"F": 1.0, "B": 1.0, "W": 1.0}] * 4
    apart = step_s(schedule, costs, [0.0] * 4)
    assert apart < shared_step_s(schedule, costs, [0.0] * 4, 0.0, (((0, 2), 1), ((1, 3), 1))) < 2 * apart
