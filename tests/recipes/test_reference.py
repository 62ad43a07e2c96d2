"""The generated reference pages (recipes/reference.py) and the `mpmd` command's own help."""

import subprocess
import sys
from pathlib import Path

import jax

from mpmd.recipes import cli, reference

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_reference_pages_are_current():
    """docs/reference/*.md are what the schema and the parsers make now."""
    for path, text in reference.pages().items():
        on_disk = (DOCS / path).read_text() if (DOCS / path).exists() else ""
        assert on_disk == text, f"docs/{path} is stale: run `python -m mpmd.recipes.reference docs`"


def test_reference_lists_every_command_and_key():
    page = reference.cli_page()
    for name in cli.COMMANDS:
        assert f"## `mpmd {name}`" in page
    assert "### `mpmd cluster up`" in page and "`--workers WORKERS`" in page
    assert "tune.output: tuned.yaml" in page  # tune's epilog lists its keys
    config_page = reference.config_page()
    assert "  steps: " in config_page and "tune:" in config_page


def test_version_names_mpmd_jax_and_python():
    out = subprocess.run([sys.executable, "-m", "mpmd.recipes.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("mpmd 0.") and f"jax {jax.__version__}" in out.stdout
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}." in out.stdout


def test_compiling_commands_use_the_workers_compilation_cache(monkeypatch, tmp_path):
    """`mpmd train` (and generate, tune, export) caches its own compiles where the workers
    cache theirs, before JAX starts; a directory the environment names, even "" (off), stays."""
    from mpmd.runtime.launchers.workers import default_compilation_cache

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cli.use_compilation_cache()
    assert default_compilation_cache() == str(tmp_path / "mpmd" / "jax")
    assert cli.os.environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "mpmd" / "jax")
    assert cli.os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
    cli.use_compilation_cache()
    assert cli.os.environ["JAX_COMPILATION_CACHE_DIR"] == ""
    assert set(cli.COMPILING) <= set(cli.COMMANDS)
