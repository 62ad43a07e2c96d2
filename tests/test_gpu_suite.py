"""benchmarks/gpu_suite.py's CPU self-check (`--cpu --tiny`) in the suite, so the GPU
benchmark cannot rot between the sessions that have a GPU: every section reports, none
failed, and the pipelined GPT equals its unpipelined training. Its speed figures mean
nothing on this CPU and are not looked at."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # starts worker processes and a plain-JAX subprocess

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def test_gpu_suite_runs_every_section_on_cpu_at_tiny_sizes(tmp_path):
    out = tmp_path / "gpu_suite.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    # A stalled section exits 3 with every thread's stack on stderr (gpu_suite.Watchdog): keep them.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-30000:]
    result = json.loads(out.read_text())
    assert result["platform"] == "cpu" and result["tiny"] is True
    rows = result["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    by_section = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
    assert sorted(by_section) == ["a. equivalence", "b. llama", "c. transfer", "d. overhead"]
    equivalence = by_section["a. equivalence"]
    assert {r["case"] for r in equivalence} == {"GPT 1f1b, 2 slices on 1 device", "GPT zb-h1, 2 slices on 1 device"}
    assert all(r["ok"] and r["loss_max_rel_err"] <= 1e-4 and r["param_max_abs_err"] <= 1e-3 for r in equivalence)
    assert all(r["tokens_per_s"] > 0 for r in by_section["b. llama"])
    transfers = {r["case"]: r for r in by_section["c. transfer"]}
    assert sorted(transfers) == [
        "1 MB ping-pong, by path",
        "1 MB slice 0 -> 1",
        "4 MB ping-pong, by path",
        "4 MB slice 0 -> 1",
    ]
    assert all(transfers[f"{mb} MB slice 0 -> 1"]["transfer_gb_per_s"] > 0 for mb in (1, 4))
    assert all(
        transfers[f"{mb} MB ping-pong, by path"][f"{path}_gb_per_s"] > 0
        for mb in (1, 4)
        for path in ("shm+pinned", "shm+pageable", "socket")
    )
