"""`mpmd plan goodput` (recipes/commands/plan.py): a 1,024-slice plan printed with its goodput,
lost time by cause and the intervals to choose; costs given, measured by a run directory, or
the defaults; bad input refused in one line with exit status 2. No worker starts."""

import re

import pytest

from mpmd.recipes.commands import plan as command
from tests.report.test_costs import write_run


def plan(capsys, *overrides: str) -> tuple[int, str, str]:
    rc = command.main(["goodput", "configs/gpt_tiny.yaml", *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


def goodput_of(out: str, row: str) -> tuple[int, int, float]:
    """(every, memory_every, goodput) of a row of the table."""
    every, memory, value = re.search(rf"^{row}\s+(\d+)\s+(\d+)\s+([0-9.]+)", out, re.M).groups()
    return int(every), int(memory), float(value)


def test_1024_slices_print_goodput_lost_time_and_the_intervals_that_maximise_it(capsys):
    rc, out, err = plan(capsys, "plan.num_slices=1024", "plan.mtbf_h=1000", "checkpoint.every=200")
    assert rc == 0, err
    assert out.startswith("1024 slices on 1024 hosts")
    every, memory, best = goodput_of(out, "best")
    assert goodput_of(out, "configured")[:2] == (200, 0) and goodput_of(out, "configured")[2] < best
    assert goodput_of(out, "Young/Daly")[2] <= best
    assert f"choose: checkpoint.every={every} checkpoint.memory_every={memory}" in out
    assert "replay" in out and "costs (s): step 0.06 (default)" in out


def test_costs_are_given_keys_else_measured_by_plan_from_run_else_the_defaults(tmp_path, capsys):
    write_run(tmp_path / "run")
    rc, out, err = plan(capsys, f"plan.from_run={tmp_path / 'run'}", "plan.spawn_s=7", "plan.mtbf_h=100")
    assert rc == 0, err
    assert "step 0.1 (measured)" in out and "spawn 7 (given)" in out and "promote 0.035 (default)" in out


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["plan.mtbf_h=-1"], "plan.mtbf_h must be > 0.0, got -1"),
        (["plan.mtbf=3"], "unknown key 'plan.mtbf'; did you mean 'plan.mtbf_h'?"),
        (["plan.step_s=0"], "plan.step_s must be > 0.0, got 0"),
        (["plan.slices_per_host=2", "cluster.processes_per_slice=2"], "not both; set one of them to 1"),
        (["plan.from_run=/nonexistent/run"], "plan.from_run='/nonexistent/run': run directory"),
    ],
)
def test_bad_input_is_one_line_naming_it_and_exit_2(capsys, overrides, says):
    rc, out, err = plan(capsys, *overrides)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def test_a_mode_other_than_goodput_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exit_:
        command.main(["checkpoints", "configs/gpt_tiny.yaml"])
    assert exit_.value.code == 2 and "invalid choice: 'checkpoints'" in capsys.readouterr().err
