"""benchmarks/gpu_suite.py end to end on CPU at toy sizes (`--cpu --tiny`), so the GPU run
finds a script that works: every section runs on real worker processes and reports, and
the pipelined GPT equals the unpipelined one."""
import json
import subprocess
import sys

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.slow      # worker processes and a subprocess (tests/README.md)


def test_cpu_tiny_runs_every_section(tmp_path):
    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_suite.py"), "--cpu", "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["platform"] == "cpu" and report["tiny"] and report["jax"]
    rows = report["rows"]
    assert not [r for r in rows if "error" in r and "snapshot" not in r["case"]], rows
    by_section = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
    assert sorted(by_section) == ["a. equivalence", "b. llama", "c. transfer", "d. overhead"]
    assert [r["ok"] for r in by_section["a. equivalence"]] == [True, True]
    plain, one_slice, two_slices = by_section["b. llama"]
    assert plain["case"].startswith("plain jit") and one_slice["case"].startswith("mpmd, 1 slice")
    assert all(r["tokens_per_s"] > 0 for r in (plain, one_slice, two_slices)) and one_slice["overhead_ratio"] > 0
    assert all(r["transfer_gb_per_s"] > 0 for r in by_section["c. transfer"])
    assert by_section["d. overhead"][0]["us_per_instruction"] > 0
    assert "a. equivalence" in proc.stdout and "wrote" in proc.stdout
