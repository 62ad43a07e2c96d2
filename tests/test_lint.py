"""ruff's lint and format check over the repository (its config: pyproject.toml [tool.ruff])."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    out = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, (
        f"ruff {' '.join(command)} found problems (`ruff check --fix .` / `ruff format .` mend most):\n"
        f"{out.stdout[-3000:]}{out.stderr[-1000:]}"
    )
