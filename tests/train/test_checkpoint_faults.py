"""Damaged checkpoints, changed configs, bad run directories and full or read-only disks.

Most runs are the real CLI (`python -m mpmd.recipes.cli train`) as a subprocess with the
in-process backend: the faults here are files, not processes. Disks are real: a tmpfs
mounted small fills up for real, and one remounted read-only refuses writes with EROFS
(these need root, as the test machine's user is; they skip otherwise).
"""

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import mpmd
from mpmd.train.checkpoints import CheckpointError
from mpmd.recipes.run import run_log
from mpmd.runtime.worker.slice_store import CheckpointStore
from tests.support import reference
from tests.support.processes import ROOT, children, mpmd_train, wait_gone
from tests.support.recovery_runs import slice_part

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)

OVERRIDES = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.seq_len=32",
    "train.batch_size=8",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "checkpoint.every=2",
    "checkpoint.keep=3",
    "log.progress=lines",
    "log.every=1",
    "log.trace_steps=[]",
    "log.tensorboard=false",
    "data.max_bytes=300000",
    "cluster.backend=inprocess",
]


def cli(run_dir, *extra, config="configs/gpt_tiny.yaml"):
    """(exit status, stdout, stderr) of one `mpmd train` run."""
    p = mpmd_train(config, *OVERRIDES, f"run_dir={run_dir}", *extra, timeout=240)
    return p.returncode, p.stdout, p.stderr


def error_line(stderr: str) -> str:
    """The one `error:` line a refused run prints, and no traceback through mpmd's code
    (Orbax and asyncio log what they could not read or write themselves, from threads of
    their own: a line of theirs may be cut by ours, so the line is found where it starts)."""
    assert not re.search(r'File ".*/(mpmd|recipes|runtime)/', stderr), stderr[-3000:]
    lines = [l[l.index("error: ") :] for l in stderr.splitlines() if re.match(r"\s*error: ", l)]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A finished 6-step run with steps 2, 4 and 6 committed; tests work on copies."""
    run_dir = tmp_path_factory.mktemp("faults") / "base"
    rc, out, err = cli(run_dir, "train.steps=6")
    assert rc == 0, err[-3000:]
    assert CheckpointStore(run_dir).committed() == [2, 4, 6]
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def damage_data(step_dir: Path, slice_index: int) -> None:
    """Truncate every array file of one slice's Orbax checkpoint."""
    files = [
        f
        for f in slice_part(step_dir, slice_index).rglob("*")
        if f.is_file() and f.stat().st_size > 0 and "d" in f.parts[-2:-1]
    ]
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def test_every_checkpoint_damaged_refuses_and_changes_nothing(six_steps, tmp_path):
    run_dir = copy_of(six_steps, tmp_path)
    ck = run_dir / "checkpoints"
    damage_data(ck / "6", 0)
    shutil.rmtree(slice_part(ck / "4", 1))
    (ck / "2" / "manifest.json").write_bytes(b"\x1f\x8b\x08\x00\xff\xfe garbage")
    before = {p: p.read_bytes() for p in (run_dir / "metrics.jsonl", run_dir / "config.yaml")}
    rc, out, err = cli(run_dir, "train.steps=8")
    assert rc == 1, err[-3000:]
    line = error_line(err)
    for step in (6, 4, 2):
        assert f"step {step}: " in line, line
    assert "manifest.json" in line and "slice_1" in line
    assert {p: p.read_bytes() for p in before} == before, "metrics.jsonl or config.yaml changed"
    assert sorted(p.name for p in ck.iterdir()) == ["2", "4", "6"], "nothing moved or deleted"
    assert "step 1/" not in out, "trained from step 0"


def test_restore_is_all_or_nothing(tmp_path):
    """Slice 0 reads its part of a step, slice 1 cannot: slice 0 keeps its state, and the
    next older step is restored on both, or none is (CheckpointError)."""
    batches = gpt_batches(8)
    trainer = gpt_trainer(mpmd.InProcessCluster(), tmp_path, asynchronous=False)
    with trainer:
        params = {}
        for i in range(6):
            trainer.step(batches[i], batches[i])
            params[trainer.step_count] = trainer.params()
        trainer.checkpoint_every = 0  # no more saves: the steps below only change state
        ck = tmp_path / "checkpoints"
        shutil.rmtree(slice_part(ck / "6", 1))
        damage_data(ck / "4", 1)
        assert trainer.checkpoints.restore_latest()[0] == 2
        assert same(trainer.params(), params[2])
        assert sorted(p.name for p in ck.iterdir()) == ["2", "4.damaged-0", "6.damaged-0"]

        trainer.step(batches[2], batches[2])
        live = trainer.params()
        assert not same(live[:1], params[2][:1])
        shutil.rmtree(slice_part(ck / "2", 1))
        with pytest.raises(CheckpointError, match=r"step 2: checkpoint part .*slice_1\.g\S+ does not exist"):
            trainer.checkpoints.restore_latest()
        assert same(trainer.params(), live), "a slice switched to a step the other could not read"
        assert sorted(p.name for p in ck.iterdir()) == ["2", "4.damaged-0", "6.damaged-0"]

        # Only steps set aside are left: still no start over from step 0 over them.
        (ck / "2").rename(ck / "2.damaged-0")
        with pytest.raises(CheckpointError, match="holds only checkpoints set aside as damaged"):
            trainer.checkpoints.restore_latest()


def gpt_batches(n: int) -> list:
    rng = np.random.default_rng(0)
    return [rng.integers(0, reference.VOCAB, (8, reference.SEQ)).astype(np.int32) for _ in range(n)]


def gpt_trainer(cluster, run_dir, asynchronous: bool = True) -> mpmd.Trainer:
    """The reference GPT in two stages on `cluster`, a checkpoint every 2 steps (3 kept)."""
    return mpmd.Trainer(
        mpmd.Pipeline(mpmd.split(reference.make_gpt(), num_stages=2), mpmd_loss()),
        optax.adamw(1e-3),
        schedule="gpipe",
        num_microbatches=4,
        cluster=cluster,
        run_dir=run_dir,
        checkpoint=mpmd.Checkpointing(every=2, keep=3, asynchronous=asynchronous),
    )


def mpmd_loss():
    from mpmd import models

    return models.lm_loss


def same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def test_damaged_steps_are_moved_aside_resaved_and_not_pruned(six_steps, tmp_path):
    """Rows 2 and 4 in one run: step 6's data truncated and step 4's manifest binary garbage.
    A warning names each step (and the unreadable file), step 2 is resumed, both damaged
    steps are set aside, so each is saved again and pruning counts only good steps."""
    run_dir = copy_of(six_steps, tmp_path)
    ck = run_dir / "checkpoints"
    damage_data(ck / "6", 1)
    (ck / "4" / "manifest.json").write_bytes(bytes(range(0x80, 0x100)) * 4)
    rc, out, err = cli(run_dir, "train.steps=10", "checkpoint.keep=2")
    assert rc == 0, err[-3000:]
    assert f"resumed from {run_dir}/checkpoints/2" in out
    assert "skipping checkpoint step 6" in err and "skipping checkpoint step 4" in err
    assert f"{ck}/4/manifest.json is unreadable" in err
    assert sorted(p.name for p in ck.iterdir()) == ["10", "4.damaged-0", "6.damaged-0", "8"]
    assert [r["step"] for r in run_log.read(run_dir)] == list(range(1, 11))
    assert "done: 8 steps" in out


def test_resume_with_changed_math_is_refused_unless_allowed(six_steps, tmp_path):
    run_dir = copy_of(six_steps, tmp_path)
    config_before = (run_dir / "config.yaml").read_bytes()
    rc, out, err = cli(
        run_dir, "train.steps=8", "optimizer.name=sgd", "optimizer.weight_decay=0", "seed=1", "optimizer.lr=0.1"
    )
    assert rc == 2, err[-3000:]
    line = error_line(err)
    for key in ("optimizer.name: 'adamw' -> 'sgd'", "seed: 0 -> 1", "optimizer.lr: 0.003 -> 0.1"):
        assert key in line, line
    assert "train.steps" not in line and "--allow-config-change" in line
    assert (run_dir / "config.yaml").read_bytes() == config_before
    assert CheckpointStore(run_dir).committed() == [2, 4, 6]

    # Keys that do not change the math (steps, cadence, logging) resume without a word.
    rc, out, err = cli(run_dir, "train.steps=8", "seed=1", "--allow-config-change")
    assert rc == 0, err[-3000:]
    assert "resuming with a changed config" in out and "seed: 0 -> 1" in out
    store = CheckpointStore(run_dir)
    old, new = store.manifest(6)["math_hash"], store.manifest(8)
    assert new["math_hash_before"] == old != new["math_hash"]
    assert "seed: 1" in (run_dir / "config.yaml").read_text()


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")


@pytest.fixture
def mounts():
    made = []
    yield made
    for path in reversed(made):
        subprocess.run(["umount", str(path)], check=False)


def test_full_disk_stops_after_the_last_committed_step(tmp_path, mounts):
    """A 1.6 MB tmpfs holds two checkpoints (~0.6 MB each): once two are committed a save
    fails with ENOSPC (found once its background write ends), its retry too; the run stops
    with one line naming the last committed step, no uncommitted directory, metrics.jsonl
    whole. (Two saves may be written at once, so which step fails first depends on timing.)"""
    run_dir = tmp_path / "full"
    _mount_tmpfs(run_dir, "1600k")
    mounts.append(run_dir)
    rc, out, err = cli(run_dir, "train.steps=12", "checkpoint.keep=2")
    assert rc == 1, err[-3000:]
    line = error_line(err)
    assert "No space left on device" in line and "saves in a row failed, max_failed_saves=1" in line, line
    committed = CheckpointStore(run_dir).committed()
    assert committed and committed[-1] >= 4, committed
    assert line.rstrip().endswith(f"the last committed step is {committed[-1]}"), line
    ck = run_dir / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == sorted(map(str, committed)), "an uncommitted directory was left"
    steps = [r["step"] for r in run_log.read(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= committed[-1] + 2
    assert not (run_dir / "metrics.jsonl.tmp").exists()
    assert "step 12/" not in out and "done:" not in out, "trained on past the failed retry"


def test_read_only_checkpoints_refused_before_training(tmp_path, mounts):
    run_dir = tmp_path / "ro"
    ck = run_dir / "checkpoints"
    _mount_tmpfs(ck, "1m")
    mounts.append(ck)
    subprocess.run(["mount", "-o", "remount,ro", str(ck)], check=True)
    rc, out, err = cli(run_dir, "train.steps=4")
    assert rc == 2, err[-3000:]
    line = error_line(err)
    assert f"cannot write in {ck}" in line and "Read-only file system" in line, line
    assert "step 1/" not in out


def test_bad_run_dir_config_and_data_are_one_line_errors(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    rc, out, err = cli(not_a_dir, "train.steps=2")
    assert rc == 2 and f"run_dir='{not_a_dir}'" in error_line(err)

    binary = tmp_path / "config.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    rc, out, err = cli(tmp_path / "r", config=str(binary))
    assert rc == 2 and "is not UTF-8 text" in error_line(err)

    rc, out, err = cli(tmp_path / "r2", "data.source=files", "data.paths=[/proc/self/mem]")
    assert rc == 2 and "data.paths: cannot read /proc/self/mem" in error_line(err)
    assert not (tmp_path / "r2").exists()


def test_summary_counts_distinct_steps_after_a_recovery(tmp_path):
    """A worker SIGKILLed mid-run (real worker processes): the steps after the last checkpoint
    are replayed, and the summary still counts each step once."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [a for a in OVERRIDES if not a.startswith("cluster.")] + [
        "train.steps=10",
        "cluster.backend=local",
        f"run_dir={tmp_path / 'rec'}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpmd.recipes.cli", "train", "configs/gpt_tiny.yaml", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if line.startswith("step 5/"):
                break
        workers = children(proc.pid)  # (a thread of the controller may end while they are listed)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out += proc.stdout.readlines()
        assert proc.wait(timeout=120) == 0, "".join(out)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(out)
    assert "recovered:" in text
    assert "done: 10 steps" in text, text[-2000:]
    assert wait_gone(workers) == []


def test_a_failed_save_that_a_newer_commit_supersedes_is_still_reported(tmp_path, caplog):
    """Step 4's save fails (its write's error found by the commit thread) only once step 6's
    save has started: step 6 commits, so nothing retries step 4, and the run goes on. The
    failure is still said, in one warning naming the step and why (it used to be dropped
    without a word: seen when a zombie's write made a replacement's save fail,
    tests/runtime/test_hosts.py)."""
    batches = gpt_batches(6)
    cluster = mpmd.InProcessCluster()
    real_save, real_wait_saves, six_started = cluster.save, cluster.wait_saves, threading.Event()

    def save(r, items, digests=True):
        real_save(r, items, digests)
        if any(Path(d).parent.name == "6" for d in items):
            six_started.set()

    def wait_saves(r, directories=None):
        finalized = real_wait_saves(r, directories)
        if any(Path(d).parent.name == "4" for d in directories or ()):  # as if its finalize failed
            assert six_started.wait(60), "step 6's save never started"
            raise OSError(28, "No space left on device (injected)")
        return finalized

    cluster.save, cluster.wait_saves = save, wait_saves
    trainer = gpt_trainer(cluster, tmp_path)
    with caplog.at_level(logging.WARNING, logger="mpmd"), trainer:
        for batch in batches:
            trainer.step(batch, batch)
        trainer.checkpoints.wait()
    assert CheckpointStore(tmp_path).committed() == [2, 6]
    said = [r.getMessage() for r in caplog.records if "checkpoint of step 4" in r.getMessage()]
    assert len(said) == 1 and "failed" in said[0] and "No space left on device (injected)" in said[0], said
