"""Runs are private by default: run_dir (and checkpoints/) get run_dir_mode whatever the
umask, and what the run writes follows it. As another uid (root's tests only), nothing in a
run directory can be read, though a file in it was written world-readable."""

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from mpmd.recipes.run import build

NOBODY = 65534


def as_nobody(*command) -> subprocess.CompletedProcess:
    """`command` as user and group nobody. Through setpriv (util-linux), not subprocess's
    user=/group=: those make Python fork() rather than vfork(), and a fork while another
    thread of this process is in gRPC (a shared fixture's heartbeats) ran gRPC's fork
    handlers in the child, which crashed once (SIGSEGV) before it could exec."""
    ids = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return subprocess.run(["setpriv", *ids, *map(str, command)], capture_output=True, text=True, timeout=60, cwd="/")


@pytest.fixture
def open_parent():
    """A directory every user may enter (so only the run's own modes stand in the way)."""
    d = Path(tempfile.mkdtemp(prefix="mpmd-private-"))
    os.chmod(d, 0o755)
    umask = os.umask(0o022)
    yield d
    os.umask(umask)
    subprocess.run(["rm", "-rf", str(d)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_uid_reads_nothing_of_a_run(open_parent):
    run_dir = open_parent / "run"
    build.check_run_dir(str(run_dir))
    assert (run_dir.stat().st_mode & 0o777, (run_dir / "checkpoints").stat().st_mode & 0o777) == (0o700, 0o700)
    (run_dir / "config.yaml").write_text("seed: 0\n")
    assert (run_dir / "config.yaml").stat().st_mode & 0o777 == 0o600, "the umask follows the mode"
    os.chmod(run_dir / "config.yaml", 0o644)  # even a file made readable by all
    assert as_nobody("ls", open_parent).returncode == 0, "the parent lets anyone in"
    probe = as_nobody("cat", run_dir / "config.yaml")
    assert probe.returncode == 1 and "Permission denied" in probe.stderr, probe.stderr
    listing = as_nobody("ls", run_dir)
    assert listing.returncode == 2 and "Permission denied" in listing.stderr, listing.stderr
    # A team's group may be let in: 0750.
    shared = open_parent / "shared"
    build.check_run_dir(str(shared), "0750")
    assert shared.stat().st_mode & 0o777 == 0o750
    (shared / "config.yaml").write_text("seed: 0\n")
    assert (shared / "config.yaml").stat().st_mode & 0o777 == 0o640


def test_an_existing_run_dir_of_its_owner_is_made_private(open_parent):
    run_dir = open_parent / "old"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    build.check_run_dir(str(run_dir))
    assert run_dir.stat().st_mode & 0o777 == 0o700
