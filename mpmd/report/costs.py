"""What a run's parts cost, read back from its run directory: the goodput planner's inputs
(mpmd.tuner.goodput.Costs) as this run measured them, from metrics.jsonl alone.

    measured("runs/gpt_tiny")   # {"step_s": 0.058, "save_s": 0.21, ...}: only what the run saw

How each is measured, in wall seconds (a record's "time" is when its step was logged):
- step_s: the median interval between consecutive steps' records (a recovery's first record,
  and a resumed controller's, left out): saves are rare enough not to move a median.
- save_s, snapshot_s: per save, the time the steps from its step up to the next save took
  over as many median steps: an asynchronous save slows the steps after it, and that is its
  cost (a save a recovery or the end of the records comes after first is left out). Averaged per tier: a step saved to the in-memory tier alone gives
  snapshot_s, to the persistent tier alone save_s; where every persistent save is also a
  snapshot, save_s is the two together less snapshot_s.
- detect_s, spawn_s, restore_s, memory_restore_s: the Trainer's goodput books (the last
  record's cumulative "goodput"), per failure: "aborted_s" less half a step (it runs from
  the last step collected, so it holds the part of the failed step done before the loss,
  which the planner counts as replay), "replace_s", "restore_s" (a recovery's tier is in
  its "recovered" mark: where the records show recoveries from both tiers, each tier's
  restore is the mean of the recoveries they show alone).
- compile_s: the first step after a recovery (its record's step_s) over a median step: the
  new worker compiles its programs on it.
Nothing here imports JAX.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from mpmd.report.load import load as load_report

# How a recovery's mark names the in-memory tier (mpmd.train.checkpoints.TIERS["memory"] says
# "from the in-memory snapshot"; tests/report/test_costs.py holds the two together).
MEMORY_TIER = "from the in-memory snapshot"


def _intervals(metrics: list[dict]) -> list[tuple[dict, float | None]]:
    """(record, seconds since the record before it) in step order; None where the interval is
    not one step's (the first record, a gap, a recovery's or a resume's first record)."""
    out, before = [], None
    for r in metrics:
        ok = (
            before is not None
            and r["step"] == before["step"] + 1
            and "time" in r
            and "time" in before
            and "recovered" not in r
            and "resumed_from" not in r
        )
        out.append((r, r["time"] - before["time"] if ok else None))
        before = r
    return out


def _save_costs(intervals: list, step_s: float) -> dict:
    """{tiers: [excess seconds of each save of those tiers]} (see the module docstring). A save
    whose window a recovery or the end of the records cuts is left out: its cost is not all
    there."""
    out: dict = {}
    for k, (r, first) in enumerate(intervals):
        if "checkpoint" not in r:
            continue
        window = [first]
        for later, dt in intervals[k + 1 :]:
            if "checkpoint" in later or "recovered" in later:
                break
            window.append(dt)
        else:
            continue  # the end of the records came first
        if "recovered" not in later and None not in window:
            out.setdefault(tuple(sorted(r["checkpoint"])), []).append(sum(window) - len(window) * step_s)
    return out


def _recoveries(metrics: list[dict]) -> tuple[dict | None, dict]:
    """(the last controller life's goodput totals, {tier: [restore_s of each recovery the
    records show alone]}): a record's goodput is cumulative, so a recovery's own figures are
    the difference from the record before it, when that is one failure apart. A recovery
    whose record a later rewind dropped is in the totals only."""
    alone: dict = {}
    before, last = None, None
    for r in metrics:
        if "resumed_from" in r:
            before = last = None
        g = r.get("goodput")
        if g is None:
            continue
        if "recovered" in r:
            tier = "memory" if MEMORY_TIER in r["recovered"] else "persistent"
            old = before or {}
            if g["failures"] - old.get("failures", 0) == 1:
                alone.setdefault(tier, []).append(g["restore_s"] - old.get("restore_s", 0.0))
            else:
                alone.setdefault(tier, [])
        before = last = g
    return last, alone


def measured(run_dir: str | Path) -> dict:
    """The costs run_dir's records measure (see the module docstring), by Costs' field names;
    a cost the run did not exercise (no recovery, no snapshot) is left out. ValueError when
    run_dir holds no metrics."""
    report = load_report(run_dir)
    metrics = report.metrics
    # A run with hot spares replaced its lost workers by promoting one: what it measured is a
    # promotion, not a spawn.
    hot = bool(((report.config or {}).get("cluster") or {}).get("hot_spares"))
    intervals = _intervals(metrics)
    plain = [dt for _, dt in intervals if dt is not None]
    if not plain:
        return {}
    step_s = statistics.median(plain)
    out = {"step_s": step_s}
    saves = {tiers: statistics.mean(v) for tiers, v in _save_costs(intervals, step_s).items()}
    if ("memory",) in saves:
        out["snapshot_s"] = max(saves[("memory",)], 0.0)
    if ("persistent",) in saves:
        out["save_s"] = max(saves[("persistent",)], 0.0)
    elif ("memory", "persistent") in saves:
        out["save_s"] = max(saves[("memory", "persistent")] - out.get("snapshot_s", 0.0), 0.0)
    totals, alone = _recoveries(metrics)
    if totals and totals["failures"]:
        per_failure = {key: totals[key] / totals["failures"] for key in ("aborted_s", "replace_s", "restore_s")}
        out["detect_s"] = max(per_failure["aborted_s"] - step_s / 2, 0.0)
        out["promote_s" if hot else "spawn_s"] = per_failure["replace_s"]
        names = {"persistent": "restore_s", "memory": "memory_restore_s"}
        if len(alone) == 1:  # every recovery the records show came from one tier: the mean is its
            out[names[next(iter(alone))]] = per_failure["restore_s"]
        else:
            out.update({names[tier]: statistics.mean(v) for tier, v in alone.items() if v})
    firsts = [r["step_s"] for r in metrics if "recovered" in r and "step_s" in r]
    if firsts:
        out["compile_s"] = max(statistics.mean(firsts) - step_s, 0.0)
    return out
