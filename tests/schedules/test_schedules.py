"""Schedules as data: generators, validator, simulator, SVG renderer and CLI."""

import xml.etree.ElementTree as ET

import pytest

from mpmd.schedules import core as schedules

from mpmd.schedules import timeline
from mpmd.schedules.cli import main
from mpmd.schedules.core import Schedule, ScheduleError, Task
from mpmd.schedules.simulate import simulate

UNIT = {"F": 1, "B": 1, "W": 1}


V_SCHEDULES = ("zb-v", "dualpipe-v")
SPLIT = ("zb-h1",) + V_SCHEDULES


def _grid():
    # Every (name, p slices, m, v) of the test grid that make() accepts.
    for name in schedules.SCHEDULES:
        v = 2 if name == "interleaved-1f1b" or name in V_SCHEDULES else 1
        for p in (1, 2, 4, 8):
            for m in (1, 4, 8, 16):
                if name not in ("gpipe",) + V_SCHEDULES and m < p:
                    continue
                yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(_grid()))
def test_every_schedule_validates(name, p, m, v):
    schedule = schedules.make(name, p * v, m, v)
    timeline.validate(schedule)
    assert len(schedule.slices) == p
    kinds_per_pair = 3 if schedule.split_backward else 2
    assert sum(map(len, schedule.slices)) == p * v * m * kinds_per_pair
    assert schedule.split_backward == (name in SPLIT)


@pytest.mark.parametrize("name,p,m,v", list(_grid()))
def test_bubble_formulas_with_default_costs(name, p, m, v):
    sim = simulate(schedules.make(name, p * v, m, v))
    expected = {
        "gpipe": (p - 1) / (m + p - 1),
        "1f1b": (p - 1) / (m + p - 1),
        "interleaved-1f1b": (p - 1) / (v * m + p - 1),
        # With F = B = W ZB-H1 idles (p-1) units per slice against 1F1B's 3(p-1).
        "zb-h1": (p - 1) / (3 * m + p - 1),
        # The V schedules idle only the p-1 units slice p-1 waits for its first forward:
        # no schedule on a V can do better (every slice has 6m units of work).
        "zb-v": (p - 1) / (6 * m + p - 1),
        "dualpipe-v": (p - 1) / (6 * m + p - 1),
    }[name]
    if name in V_SCHEDULES and m < 2 * p - 1:  # built for 2p-1 microbatches, some dropped
        assert sim.bubble_fraction > expected
    else:
        assert sim.bubble_fraction == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_v_schedules_near_zero_bubble_at_1f1b_memory(p):
    # The paper's claims for F = B = W: ZB-V has "zero bubble" (only the unavoidable ramp)
    # at 1F1B's peak activation memory. A V stage holds half a 1F1B stage's layers, so the
    # same model costs 1 per V stage task and 2 per 1F1B stage task, and 2p V
    # stage-microbatches weigh what p 1F1B ones do.
    m = 4 * p
    one_f_one_b = simulate(schedules.make("1f1b", p, m), {"F": 2, "B": 2, "W": 2})
    zb_h1 = simulate(schedules.make("zb-h1", p, m), {"F": 2, "B": 2, "W": 2})
    zb_v = simulate(schedules.make("zb-v", 2 * p, m), UNIT)
    dualpipe_v = simulate(schedules.make("dualpipe-v", 2 * p, m), UNIT)
    work = 6 * m
    assert one_f_one_b.makespan == work + 6 * (p - 1)  # 1F1B idles 3(p-1) tasks of 2 units
    assert zb_h1.makespan == work + 2 * (p - 1)
    assert zb_v.makespan == dualpipe_v.makespan == work + (p - 1)
    assert zb_v.peak_live_activations == (2 * p,) * p  # = 1F1B's p, in half stages
    assert max(one_f_one_b.peak_live_activations) == p
    assert max(dualpipe_v.peak_live_activations) == 2 * p + 1  # one more: its F&B pairs
    sched = schedules.make("zb-v", 2 * p, m)
    assert sched.placement == schedules.v_placement(2 * p, p) and sched.virtual_stages == 2
    assert sched.stages_on(0) == (0, 2 * p - 1)


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_schedules_with_fewer_microbatches_than_their_shape(name):
    # Built for 2p-1 microbatches with the extra ones dropped: still complete and valid.
    for m in (1, 2, 3):
        schedule = schedules.make(name, 8, m)
        timeline.validate(schedule)
        assert sum(map(len, schedule.slices)) == 8 * m * 3


@pytest.mark.parametrize("costs", [{"F": 1, "B": 2, "W": 0}, {"F": 2, "B": 1, "W": 0.5}])
def test_bubble_formulas_do_not_depend_on_cost_ratio(costs):
    p, m, v = 4, 8, 2
    for name, expected in (
        ("gpipe", (p - 1) / (m + p - 1)),
        ("1f1b", (p - 1) / (m + p - 1)),
        ("interleaved-1f1b", (p - 1) / (v * m + p - 1)),
    ):
        sim = simulate(
            schedules.make(name, p * (v if "interleaved" in name else 1), m, v if "interleaved" in name else 1), costs
        )
        assert sim.bubble_fraction == pytest.approx(expected), name


def test_zb_h1_beats_1f1b_with_equal_work():
    one_f_one_b = simulate(schedules.make("1f1b", 4, 8), UNIT)
    zb = simulate(schedules.make("zb-h1", 4, 8), UNIT)
    # Same total work: a full backward costs B + W.
    assert sum(e - s for row in zb.spans for _, s, e in row) == sum(
        e - s for row in one_f_one_b.spans for _, s, e in row
    )
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    assert zb.makespan < one_f_one_b.makespan
    # ... at the same peak memory as 1F1B: p microbatches alive.
    assert max(zb.peak_live_activations) == max(one_f_one_b.peak_live_activations) == 4


def test_peak_live_activations():
    p, m = 4, 16
    assert simulate(schedules.make("1f1b", p, m)).peak_live_activations == (4, 3, 2, 1)
    assert simulate(schedules.make("gpipe", p, m)).peak_live_activations == (m,) * p


def test_comm_latency_adds_to_critical_path():
    p, m = 4, 8
    base = simulate(schedules.make("gpipe", p, m)).makespan
    # GPipe's critical path crosses p-1 slice boundaries going forward and p-1 coming back.
    assert simulate(schedules.make("gpipe", p, m), comm_s=0.5).makespan == pytest.approx(base + 2 * (p - 1) * 0.5)


def test_per_stage_costs_callable():
    schedule = schedules.make("1f1b", 2, 4)
    sim = simulate(schedule, lambda task: 2.0 if task.stage == 1 else 1.0)
    busy = [sum(e - s for _, s, e in row) for row in sim.spans]
    # Non-split B costs cost(B) + cost(W): 4 microbatches x (F + B + W).
    assert busy == [4 * 3.0, 4 * 6.0]


@pytest.mark.parametrize(
    "costs,match",
    [
        ({"F": 1, "B": 1}, "exactly the keys"),
        ({"F": 1, "B": -1, "W": 0}, r"costs\['B'\] must be a number >= 0"),
    ],
)
def test_bad_costs(costs, match):
    with pytest.raises(ValueError, match=match):
        simulate(schedules.make("1f1b", 2, 2), costs)


def _replace_slice(schedule, r, tasks):
    slices = list(schedule.slices)
    slices[r] = tuple(tasks)
    return schedule._replace(slices=tuple(slices))


def test_validator_rejects_backward_before_its_forward():
    schedule = schedules.make("1f1b", 2, 2)
    tasks = list(schedule.slices[1])  # slice 1: F0 B0 F1 B1
    tasks[0], tasks[1] = tasks[1], tasks[0]
    with pytest.raises(
        ScheduleError,
        match=r"slice 1 waits at B\(stage=1, mb=0\), which needs "
        r"F\(stage=1, mb=0\) not yet run",
    ):
        timeline.validate(_replace_slice(schedule, 1, tasks))


def test_validator_rejects_missing_and_misplaced_tasks():
    schedule = schedules.make("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match=r"missing tasks: B\(stage=0, mb=1\)"):
        timeline.validate(_replace_slice(schedule, 0, schedule.slices[0][:-1]))
    with pytest.raises(ScheduleError, match=r"wrong slice: F\(stage=1, mb=0\) at slice 0"):
        timeline.validate(_replace_slice(schedule, 0, schedule.slices[0] + (Task(1, 0, "F"),)))
    with pytest.raises(ScheduleError, match=r"duplicate task F\(stage=0, mb=0\)"):
        timeline.validate(_replace_slice(schedule, 0, schedule.slices[0] + (Task(0, 0, "F"),)))
    with pytest.raises(ScheduleError, match="W tasks appear only in schedules with split"):
        timeline.validate(_replace_slice(schedule, 0, schedule.slices[0] + (Task(0, 0, "W"),)))
    zb = schedules.make("zb-h1", 2, 2)
    no_w = tuple(t for t in zb.slices[1] if t.kind != "W")
    with pytest.raises(ScheduleError, match=r"missing tasks: W\(stage=1, mb=0\)"):
        timeline.validate(_replace_slice(zb, 1, no_w))


def test_validator_rejects_cycle_between_slices():
    # Slice 0 runs mb 1 first, slice 1 runs mb 0 first: B(1, mb=0) waits for F(1, 0) which
    # waits for F(0, 0), queued on slice 0 behind B(0, 1), which needs B(1, 1) behind B(1, 0).
    f, b = "F", "B"
    slices = (
        (Task(0, 1, f), Task(0, 1, b), Task(0, 0, f), Task(0, 0, b)),
        (Task(1, 1, f), Task(1, 0, f), Task(1, 0, b), Task(1, 1, b)),
    )
    broken = Schedule("broken", 2, 2, 1, False, slices, placement=(0, 1))
    with pytest.raises(ScheduleError) as info:
        timeline.validate(broken)
    message = str(info.value)
    assert message.startswith("deadlock: ")
    assert "slice 0 waits at B(stage=0, mb=1), which needs B(stage=1, mb=1)" in message
    assert "slice 1 waits at F(stage=1, mb=0), which needs F(stage=0, mb=0)" in message
    with pytest.raises(ScheduleError):  # the simulator refuses it too
        simulate(broken)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ("pipedream", 4, 8),
            "unknown schedule 'pipedream'; known schedules: 1f1b, dualpipe-v, gpipe, interleaved-1f1b, zb-h1, zb-v",
        ),
        (
            ("zb-v", 6, 8, 1),
            "schedule 'zb-v' supports only virtual_stages=2 (it holds two stages per slice, a V), got 1",
        ),
        (
            ("dualpipe-v", 5, 8),
            "schedule 'dualpipe-v' puts two stages on each slice (a V), so it needs an even num_stages, got 5",
        ),
        (
            ("1f1b", 4, 8, 2),
            "schedule '1f1b' supports only virtual_stages=1, got 2; only 'interleaved-1f1b' takes virtual stages",
        ),
        (("interleaved-1f1b", 4, 8, 1), "schedule 'interleaved-1f1b' needs virtual_stages >= 2"),
        (
            ("interleaved-1f1b", 6, 8, 4),
            "schedule 'interleaved-1f1b' needs num_stages divisible by virtual_stages (4), got num_stages=6",
        ),
        (
            ("interleaved-1f1b", 8, 2, 2),
            "schedule 'interleaved-1f1b' needs num_microbatches >= number of pipeline slices (4), got 2",
        ),
        (
            ("interleaved-1f1b", 8, 6, 2),
            "schedule 'interleaved-1f1b' needs num_microbatches to be "
            "a multiple of the number of pipeline slices (4), got 6",
        ),
        (("1f1b", 4, 2), "schedule '1f1b' needs num_microbatches >= number of pipeline slices (4), got 2"),
        (("zb-h1", 4, 3), "schedule 'zb-h1' needs num_microbatches >= number of pipeline slices (4), got 3"),
        (("gpipe", 0, 4), "schedule 'gpipe' needs num_stages to be an integer >= 1, got 0"),
        (("gpipe", 4, -1), "schedule 'gpipe' needs num_microbatches to be an integer >= 1, got -1"),
        (
            ("interleaved-1f1b", 4, 4, 0),
            "schedule 'interleaved-1f1b' needs virtual_stages to be an integer >= 1, got 0",
        ),
    ],
)
def test_make_errors(args, message):
    with pytest.raises(ValueError) as info:
        schedules.make(*args)
    assert str(info.value).startswith(message)


def test_gpipe_accepts_fewer_microbatches_than_slices():
    timeline.validate(schedules.make("gpipe", 8, 2))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_large_schedule_validates_and_simulates(name):
    # How fast (seconds at p=1,024 x m=8,192) is benchmarks/bench_schedule_scale.py's to
    # measure: a time bound here would fail on a loaded machine, not on a slow schedule.
    sim = simulate(schedules.make(name, 64, 512))  # simulate() validates first
    assert len(sim.spans) == 64


def test_cli_prints_summary_and_writes_svg(tmp_path, capsys):
    out = tmp_path / "zb.svg"
    assert main(["zb-h1", "--stages", "4", "--microbatches", "8", "-o", str(out), "--costs", "1,1,1"]) == 0
    printed = capsys.readouterr().out
    assert "makespan:          27" in printed
    assert "peak live activations per slice: 4 4 4 4" in printed
    root = ET.parse(out).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) == 4 * 8 * 3 + 3  # one per task, plus the legend
    assert "zb-h1" in "".join(root.itertext())


def test_cli_writes_nothing_unless_asked(tmp_path, monkeypatch, capsys):
    """Without -o the summary is printed and no file appears (not NAME.svg in the cwd)."""
    monkeypatch.chdir(tmp_path)
    assert main(["1f1b", "--stages", "2", "--microbatches", "4"]) == 0
    printed = capsys.readouterr().out
    assert "makespan:" in printed and "svg" not in printed
    assert list(tmp_path.iterdir()) == []


def test_cli_reports_make_errors(tmp_path, capsys):
    assert main(["1f1b", "--stages", "4", "--microbatches", "2", "-o", str(tmp_path / "x.svg")]) == 2
    assert capsys.readouterr().err.startswith(
        "error: schedule '1f1b' needs num_microbatches >= number of pipeline slices (4)"
    )
    assert not (tmp_path / "x.svg").exists()


def _per_task_costs(costs):
    # The per-task price the reference simulation uses: a full backward is B + W when the
    # schedule does not split it (as mpmd.schedules.simulate prices it).
    return lambda split: (
        lambda task: costs[task.stage][task.kind] + (costs[task.stage]["W"] if task.kind == "B" and not split else 0.0)
    )


@pytest.mark.parametrize(
    "name,p,m,v",
    [("1f1b", 64, 512, 1), ("zb-v", 64, 128, 2)]
    + [
        (name, p, m, 2 if name in ("interleaved-1f1b",) + V_SCHEDULES else 1)
        for name in schedules.SCHEDULES
        for p, m in ((3, 6), (4, 8))
    ],
)
def test_array_walk_equals_per_task_definition(name, p, m, v):
    # Uneven per-stage costs and a transfer latency, so every dependency matters; the
    # vectorised walk must give the per-task simulation's timeline bit for bit.
    import random

    from tests.support import schedule_reference

    schedule = schedules.make(name, p * v, m, v)
    rng = random.Random(p * m)
    costs = [{"F": rng.uniform(0.5, 1.5), "B": rng.uniform(0.5, 2), "W": rng.uniform(0, 1)} for _ in range(p * v)]
    sim = simulate(schedule, costs, comm_s=0.25)
    makespan, busy, spans, peaks = schedule_reference.simulate(
        schedule, _per_task_costs(costs)(schedule.split_backward), comm_s=0.25
    )
    assert sim.makespan == makespan
    assert sim.bubble_fraction_per_slice == tuple(1 - b / makespan for b in busy)
    assert sim.peak_live_activations == peaks
    assert tuple(sim.spans) == spans
    assert set(timeline.execution_order(schedule)) == set(schedule_reference.execution_order(schedule))


def test_array_walk_finds_what_the_per_task_walk_finds():
    # Swapping two tasks of a valid schedule: both walks agree on valid or deadlocked.
    from tests.support import schedule_reference

    base = schedules.make("zb-v", 6, 5)
    verdicts = set()
    for r in range(base.num_slices):
        tasks = list(base.slices[r])
        for i in range(0, len(tasks) - 1, 2):
            swapped = tasks[:i] + [tasks[i + 1], tasks[i]] + tasks[i + 2 :]
            broken = _replace_slice(base, r, swapped)
            try:
                schedule_reference.execution_order(broken)
                expected = True
            except ScheduleError:
                expected = False
            try:
                timeline.validate(broken)
                got = True
            except ScheduleError as e:
                assert str(e).startswith("deadlock: slice ")
                got = False
            assert got == expected, (r, i)
            verdicts.add(got)
    assert verdicts == {True, False}


def test_cli_summarises_many_slices_and_refuses_an_unreadable_svg(tmp_path, capsys):
    out = tmp_path / "big.svg"
    assert main(["1f1b", "--stages", "64", "--microbatches", "512", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "peak live activations per slice: min 1, median 32.5, max 64 over 64 slices" in printed
    assert "svg not written: the 32 slices it would draw hold 32768 tasks" in printed
    assert not out.exists()
    # Fewer tasks: 32 of the 64 slices drawn, first and last included, and the title says so.
    assert main(["zb-v", "--stages", "128", "--microbatches", "4", "-o", str(out)]) == 0
    root = ET.parse(out).getroot()
    text = "".join(root.itertext())
    assert "p=64 slices (32 of them drawn)" in text and "slice 0" in text and "slice 63" in text
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) == 32 * 2 * 4 * 3 + 3
