"""mpmd.report.costs reads a run's costs from its metrics.jsonl: records written as `mpmd train`
writes them, with known step, save, snapshot and recovery costs."""

import json

import pytest

from mpmd.report.costs import MEMORY_TIER, measured
from mpmd.train.checkpoints import TIERS

STEP, SNAPSHOT, SAVE, COMPILE = 0.1, 0.02, 0.3, 0.3


def write_run(run_dir, steps: int = 60) -> None:
    """Steps of 0.1 s; a snapshot every 5 steps adds 0.02 s to its own step, a persistent save
    every 10 adds 0.3 s to the two steps after it. Slice 1 is lost after step 33 (back from
    step 30's snapshot) and after step 47 (with its peer: back from step 40's checkpoint); the
    first step after each compiles for 0.3 s. As the file ends up: a recovery's steps
    rewritten, its first record marked."""
    books = {"failures": 0, "aborted_s": 0.0, "replace_s": 0.0, "capacity_s": 0.0, "relayout_s": 0.0}
    books |= {"restore_s": 0.0, "replayed_s": 0.0, "replayed_steps": 0, "reduced_width_s": 0.0, "layout_changes": 0}
    recoveries = {31: ("memory", 0.13), 41: ("persistent", 0.5)}
    records, t = [], 1000.0
    for step in range(1, steps + 1):
        # A save slows the two steps after it, unless a recovery came between.
        slowed = step % 10 in (1, 2) and step > 2 and not {step, step - 1} & set(recoveries)
        dt = STEP + (SNAPSHOT if step % 5 == 0 else 0.0) + (SAVE / 2 if slowed else 0.0)
        record = {"step": step, "loss": 1.0, "step_s": dt}
        if step in recoveries:
            tier, restore_s = recoveries[step]
            books = dict(books, failures=books["failures"] + 1, aborted_s=books["aborted_s"] + 0.25)
            books |= {"replace_s": books["replace_s"] + 0.6, "restore_s": books["restore_s"] + restore_s}
            record["recovered"] = (
                f"recovered from slice 1 lost; replaced; resuming after step {step - 1} ({TIERS[tier]})"
            )
            dt = record["step_s"] = dt + COMPILE
            t += 5.0  # the failure, recovery and replay: not an interval of one step
        t += dt
        if step % 5 == 0:
            record["checkpoint"] = ["memory"] + (["persistent"] if step % 10 == 0 else [])
        if books["failures"]:
            record["goodput"] = dict(books, lost_s=0.0)
        records.append(record | {"time": t})
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_runs_records_give_its_step_save_and_recovery_costs(tmp_path):
    write_run(tmp_path / "run")
    got = measured(tmp_path / "run")
    assert got == pytest.approx(
        {
            "step_s": STEP,
            "snapshot_s": SNAPSHOT,
            "save_s": SAVE,
            "detect_s": 0.25 - STEP / 2,
            "spawn_s": 0.6,
            "restore_s": 0.5,
            "memory_restore_s": 0.13,
            "compile_s": COMPILE,
        }
    )


def test_a_run_without_recoveries_gives_what_it_measured_only(tmp_path):
    write_run(tmp_path / "run", steps=30)
    assert set(measured(tmp_path / "run")) == {"step_s", "snapshot_s", "save_s"}
    with pytest.raises(ValueError, match="holds no metrics.jsonl"):
        measured(tmp_path)


def test_the_memory_tier_is_named_as_the_trainer_names_it():
    assert MEMORY_TIER == TIERS["memory"]


def test_a_run_with_hot_spares_measured_promotions_not_spawns(tmp_path):
    write_run(tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text("cluster:\n  hot_spares: 1\n")
    got = measured(tmp_path / "run")
    assert got["promote_s"] == pytest.approx(0.6) and "spawn_s" not in got
