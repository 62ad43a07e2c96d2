"""`mpmd train` stopped and run again with the same command, end to end through the real CLI.

The controller is a real subprocess with real worker processes (cluster.backend=local). A
SIGKILLed controller takes its workers with it, and a SIGTERMed one commits a final
checkpoint and exits 143 (a preemption: the scheduler should run it again); either way the same command then finishes the run with exactly the
final state and per-step losses of an uninterrupted one (bitwise), and leaves no process.
"""

import os
import re
import shutil
import signal
import sysconfig
import uuid
from pathlib import Path

import numpy as np
import pytest

from mpmd.train.checkpoint_reader import read_leaves
from mpmd.recipes import config
from mpmd.recipes.data import grain as grain_data
from mpmd.recipes.run import preempt
from mpmd.recipes.run import run_log
from mpmd.recipes.data import tokenizer
from mpmd.recipes.data import tokens
from mpmd.recipes.run.records import batch_crc32
from mpmd.runtime.worker.slice_store import CheckpointStore
from tests.support.processes import Controller, processes_tagged, tiny_gpt_run, wait_gone

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)

STEPS, EVERY = 12, 3
OVERRIDES = tiny_gpt_run(STEPS, EVERY)
TAG = "MPMD_TEST_RESUME_CLI"  # marks every process a test starts, workers included (inherited env)


def controller(run_dir: Path, tag: str) -> Controller:
    return Controller(run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES], {TAG: tag})


def tagged(tag: str) -> list[int]:
    """Live processes started under `tag`, whoever their parent is now."""
    return processes_tagged(TAG, tag)


def run_to_end(run_dir: Path, tag: str) -> str:
    return controller(run_dir, tag).succeed()


def final_state(run_dir: Path) -> tuple[int, dict]:
    """(newest committed step, {leaf name: [host array]}) read straight from the checkpoint."""
    step, leaves = read_leaves(run_dir)
    return step, {name: [array] for name, array in leaves.items()}


def metrics(run_dir: Path) -> list[dict]:
    return run_log.read(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: (final state, per-step metrics, its run_dir)."""
    run_dir = tmp_path_factory.mktemp("resume") / "a"
    tag = uuid.uuid4().hex
    run_to_end(run_dir, tag)
    assert wait_gone(tagged(tag)) == []
    return final_state(run_dir), metrics(run_dir), run_dir


def assert_same_as_reference(run_dir: Path, reference):
    (want_step, want), want_metrics, _ = reference
    got_step, got = final_state(run_dir)
    assert got_step == want_step == STEPS
    assert got.keys() == want.keys()
    for name in want:
        assert all(np.array_equal(a, b) for a, b in zip(got[name], want[name])), f"{name} differs"
    got_metrics = metrics(run_dir)
    assert [r["step"] for r in got_metrics] == list(range(1, STEPS + 1)), "each step exactly once"
    assert [r["loss"] for r in got_metrics] == [r["loss"] for r in want_metrics]


def test_what_the_controller_and_its_workers_wrote_is_the_owners_only(reference):
    run_dir = reference[2]
    paths = [run_dir, *run_dir.rglob("*")]
    assert any("checkpoints" in p.parts and p.is_file() for p in paths), "the workers' checkpoint files"
    assert any(p.name.startswith("worker_") for p in paths), "the workers' logs"
    opened = {str(p.relative_to(run_dir)): oct(p.lstat().st_mode & 0o777) for p in paths if p.lstat().st_mode & 0o077}
    assert opened == {}, f"readable by others than the owner: {opened}"


@pytest.mark.every_jax  # counts compiles and the persistent cache's loads
def test_controller_sigterm_commits_and_sigkill_loses_nothing_once_resumed(reference, tmp_path):
    """One run stopped twice: SIGTERMed after step 5, the controller commits a final
    checkpoint (off the checkpoint.every grid or not) and exits 143; the same command resumes
    from it. That resumed run SIGKILLed two steps later takes its workers with it; the same
    command resumes again and finishes with the uninterrupted run's final state and per-step
    losses (bitwise), each step logged once. No process is left at any point."""
    run_dir, tag = tmp_path / "c", uuid.uuid4().hex
    ctl = controller(run_dir, tag)
    try:
        ctl.wait_for_step(5)
        os.kill(ctl.proc.pid, signal.SIGTERM)
        rc, out = ctl.finish()
    finally:
        if ctl.proc.poll() is None:
            ctl.proc.kill()
    assert rc == preempt.PREEMPTED_EXIT == 143, out
    m = re.search(
        r"stopped by SIGTERM after step (\d+); checkpoint committed, resume with the same command "
        r"\(exit code 143\)",
        out,
    )
    assert m, out
    stopped_at = int(m.group(1))
    assert 5 <= stopped_at < STEPS
    # The final checkpoint holds the step it stopped at, off the checkpoint.every grid or not.
    assert CheckpointStore(run_dir).committed()[-1] == stopped_at
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, stopped_at + 1))
    assert wait_gone(tagged(tag)) == []

    ctl = controller(run_dir, tag)
    try:
        ctl.wait_for_step(stopped_at + 2)
        ctl.wait_for_commit()  # a checkpoint to resume from (saves commit in the background)
        workers = ctl.workers()
        assert len(workers) == 2, workers
        os.kill(ctl.proc.pid, signal.SIGKILL)
    finally:
        if ctl.proc.poll() is None:
            ctl.proc.kill()
    rc, out = ctl.finish()
    assert rc == -signal.SIGKILL
    assert f"resumed from {run_dir}/checkpoints/{stopped_at}" in out
    # A worker learns of its controller's death from its stdin pipe closing.
    assert wait_gone(workers, timeout_s=5.0) == [], "workers outlived their SIGKILLed controller"
    killed_at = CheckpointStore(run_dir).committed()[-1]
    assert killed_at < STEPS, "the run finished before it was killed: nothing was resumed"

    out = run_to_end(run_dir, tag)
    assert f"resumed from {run_dir}/checkpoints/{killed_at}" in out
    assert_same_as_reference(run_dir, reference)
    assert wait_gone(tagged(tag)) == []
    # A resumed run's first step compiles nothing: its new workers load every executable
    # the first run compiled from JAX's persistent compilation cache.
    for step in (stopped_at + 1, killed_at + 1):
        first = next(r for r in metrics(run_dir) if r["step"] == step)
        assert first.get("cache_loads", 0) > 0 and first["compiles"] == first["cache_loads"], first


def test_controller_sigtermed_with_a_hung_worker_exits_within_its_grace(tmp_path):
    """A worker SIGSTOPped (a hung host: with no probes, its silence is not declared a loss for 60 s), then
    the controller SIGTERMed with train.preempt_grace_s=12: the step in flight never ends, so
    10 s before the grace runs out the controller gives up on it, keeps its last commit, stops
    every worker (the stopped one killed) and exits 143, saying which step it kept."""
    run_dir, tag = tmp_path / "g", uuid.uuid4().hex
    ctl = Controller(
        run_dir,
        [
            "configs/gpt_tiny.yaml",
            *OVERRIDES,
            "train.preempt_grace_s=12",
            "cluster.failure_timeout_s=60",
            "cluster.probe_timeout_s=null",
        ],
        {TAG: tag},
    )
    try:
        ctl.wait_for_step(4)
        committed = ctl.wait_for_commit()
        workers = ctl.workers()
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGSTOP)
        os.kill(ctl.proc.pid, signal.SIGTERM)
        # Without the alarm it would wait out failure_timeout_s (60 s) and be killed here
        # (exit -9); the seconds it takes are not asserted (they depend on the machine's load).
        rc, out = ctl.finish(timeout_s=40)
    finally:
        if ctl.proc.poll() is None:
            ctl.proc.kill()
    assert rc == 143, out
    kept = CheckpointStore(run_dir).committed()[-1]
    assert kept >= committed
    assert (
        f"stopped by SIGTERM: the 12 s grace after SIGTERM ran out before the steps in flight were "
        f"collected and committed; kept the last committed checkpoint, step {kept}; resume with the "
        f"same command (exit code 143)"
    ) in out, out
    assert wait_gone(tagged(tag)) == []


def test_resumes_on_another_stage_count(reference, tmp_path):
    """The uninterrupted 2-stage run's step-9 checkpoint resumed with `pipeline.num_stages=4
    cluster.num_workers=4`: the console names the layout change, and the losses after it
    equal the 2-stage run's to relative 1e-6, each step logged once."""
    run_dir, tag = tmp_path / "l", uuid.uuid4().hex
    shutil.copytree(reference[2], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / str(STEPS))
    assert CheckpointStore(run_dir).committed()[-1] == STEPS - EVERY
    out = Controller(
        run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES, "pipeline.num_stages=4", "cluster.num_workers=4"], {TAG: tag}
    ).succeed()
    assert f"resumed from {run_dir}/checkpoints/{STEPS - EVERY}" in out
    line = next(l for l in out.splitlines() if "layout changed:" in l)
    assert "2 stages on 2 slices, 1f1b" in line and "-> 4 stages on 4 slices, 1f1b" in line, line
    got, want = metrics(run_dir), reference[1]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "each step exactly once"
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-6)
    assert read_leaves(run_dir)[1].keys() == reference[0][1].keys(), "the same leaves, by path"
    assert wait_gone(tagged(tag)) == []


def kill_worker_after_step(run_dir: Path, tag: str, overrides: list[str], step: int) -> str:
    """Run gpt_tiny with `overrides`, SIGKILL worker 1 once step `step` is printed, and return
    the stdout of the run finishing."""
    base = TOKEN_OVERRIDES if "data.source=tokens" in overrides else OVERRIDES
    ctl = Controller(run_dir, ["configs/gpt_tiny.yaml", *base, *overrides], {TAG: tag})
    try:
        ctl.wait_for_step(step)
        workers = ctl.workers()
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        return ctl.succeed()
    finally:
        if ctl.proc.poll() is None:
            ctl.proc.kill()


def test_worker_sigkilled_restores_from_the_memory_tier(reference, tmp_path):
    """`checkpoint.memory_every=1`: a worker SIGKILLed after step 7 comes back from its peer's
    in-memory copy (the console says so), replays one step, and the run ends bitwise equal to
    the uninterrupted one; metrics.jsonl marks each step's snapshot tier."""
    run_dir, tag = tmp_path / "m", uuid.uuid4().hex
    out = kill_worker_after_step(run_dir, tag, ["checkpoint.memory_every=1"], 7)
    line = next(l for l in out.splitlines() if "recovered:" in l)
    assert "from the in-memory snapshot, 1 step(s) to replay" in line, line
    assert_same_as_reference(run_dir, reference)
    records = metrics(run_dir)
    assert all("memory" in r["checkpoint"] for r in records), records[:3]
    assert [r["step"] for r in records if "persistent" in r["checkpoint"]] == list(range(EVERY, STEPS + 1, EVERY))
    assert wait_gone(tagged(tag)) == []


def test_worker_lost_without_replacement_goes_on_and_reports_goodput(reference, tmp_path):
    """cluster.max_workers=2 leaves no replacement: a worker SIGKILLed after step 7 is not
    replaced (on_loss=auto, replace_timeout_s=0), the run goes on with both stages on the
    surviving slice from the last commit (step 3 or 6; the initial state if both were still
    being written) and ends with the uninterrupted run's final state and losses;
    metrics.jsonl records the layout change and the goodput figures (time lost, time at
    reduced width), and the summary prints them."""
    run_dir, tag = tmp_path / "s", uuid.uuid4().hex
    out = kill_worker_after_step(run_dir, tag, ["cluster.max_workers=2", "cluster.replace_timeout_s=0"], 7)
    print(out)  # shown if an assertion below fails
    assert_same_as_reference(run_dir, reference)
    records = metrics(run_dir)
    (change,) = [c for r in records for c in r.get("layout_changes", [])]
    assert change["num_slices"] == 1 and change["placement"] == [0, 0] and change["step"] in (0, 3, 6), change
    goodput = records[-1]["goodput"]
    assert goodput["failures"] == 1 and goodput["layout_changes"] == 1, goodput
    assert goodput["reduced_width_s"] > 0 and goodput["lost_s"] >= goodput["restore_s"] > 0, goodput
    assert re.search(r"goodput: 1 worker\(s\) lost, [\d.]+ s lost .* s on fewer slices, 1 layout change", out), out
    assert wait_gone(tagged(tag)) == []


def test_dropout_run_recovers_a_killed_worker_to_the_uninterrupted_run(tmp_path):
    """`model.dropout=0.1` (each layer's RNG stream carried on its slice, saved with it): a
    worker SIGKILLed after step 7 comes back from the persistent tier and the run ends with
    the uninterrupted dropout run's per-step losses and final state, streams included, bitwise."""
    tag = uuid.uuid4().hex
    want_dir = tmp_path / "want"
    Controller(want_dir, ["configs/gpt_tiny.yaml", *OVERRIDES, "model.dropout=0.1"], {TAG: tag}).succeed()
    run_dir = tmp_path / "d"
    out = kill_worker_after_step(run_dir, tag, ["model.dropout=0.1"], 7)
    assert "recovered:" in out, out
    reference = (final_state(want_dir), metrics(want_dir), want_dir)
    assert any(name.startswith("state/") and name.endswith("drop.rngs.key") for name in reference[0][1])
    assert_same_as_reference(run_dir, reference)
    assert wait_gone(tagged(tag)) == []


@pytest.fixture(scope="module")
def token_corpus(tmp_path_factory) -> Path:
    """A 300-token BPE learnt from two stdlib modules, and a corpus of ~2,850 of its tokens:
    with seq_len 32, batch_size 8 and data.eval_fraction=0.1, an epoch of 10 batches."""
    root = tmp_path_factory.mktemp("tokens")
    stdlib = Path(sysconfig.get_paths()["stdlib"]) / "json"
    tok = tokenizer.load(str(tokenizer.train_bpe([stdlib / "decoder.py", stdlib / "encoder.py"], 300, root / "tok")))
    (root / "text.txt").write_text((stdlib / "encoder.py").read_text()[:4200])
    tokens.write([root / "text.txt"], root / "corpus", tok, shard_tokens=1000)
    return root / "corpus"


# data.max_bytes is the byte corpus's key: a tokens source refuses it.
TOKEN_ARGS = ["data.source=tokens", "data.eval_fraction=0.1"]
TOKEN_OVERRIDES = [o for o in OVERRIDES if not o.startswith("data.max_bytes=")]


@pytest.fixture(scope="module")
def token_reference(token_corpus, tmp_path_factory):
    """The uninterrupted tokens run: (args, final state, per-step metrics, its run_dir, stdout)."""
    args = ["configs/gpt_tiny.yaml", *TOKEN_OVERRIDES, *TOKEN_ARGS, f"data.path={token_corpus}"]
    run_dir, tag = tmp_path_factory.mktemp("tokens_run") / "want", uuid.uuid4().hex
    out = Controller(run_dir, args, {TAG: tag}).succeed()
    assert wait_gone(tagged(tag)) == []
    return args, final_state(run_dir), metrics(run_dir), run_dir, out


def assert_same_batches(run_dir: Path, token_reference):
    """Every step once, each with the uninterrupted run's batch (CRC-32) and loss, bitwise, and
    the same final state."""
    args, want_state, want, want_dir, _ = token_reference
    got = metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "each step exactly once"
    assert [r["batch_crc32"] for r in got] == [r["batch_crc32"] for r in want]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert_same_as_reference(run_dir, (want_state, want, want_dir))


def test_tokens_run_reads_the_grain_pipelines_batches_and_records_its_tokenizer(token_reference, token_corpus):
    """The uninterrupted tokens run's batches are those the Grain pipeline gives here, step by
    step; the model's vocabulary followed the tokenizer (300 -> 384, said in one line); the run
    directory holds the tokenizer, which run_tokenizer reads back."""
    args, _, want, run_dir, out = token_reference
    assert "model.vocab_size=384: the tokenizer" in out and "has 300 tokens, padded by 84" in out, out
    cfg = config.load(args[0], args[1:])
    loader, _ = grain_data.loaders(cfg)
    assert [r["batch_crc32"] for r in want] == [batch_crc32(loader.next()) for _ in range(STEPS)]
    assert cfg.model.vocab_size == 384
    assert tokenizer.run_tokenizer(run_dir).hash == tokens.Corpus(token_corpus).tokenizer().hash != "bytes"


def test_tokens_run_sigkilled_mid_epoch_resumes_to_the_same_batches_and_losses(token_reference, tmp_path):
    """data.source=tokens: the controller SIGKILLed mid-epoch (after step 5, with a commit at 3
    or 6 of a 10-batch epoch), the same command resumes from Grain's iterator state in the
    manifest and goes on into the next epoch. Every step's batch (its CRC-32) and loss equal
    the uninterrupted run's bitwise; the final state is bitwise the same."""
    args, tag = token_reference[0], uuid.uuid4().hex
    run_dir = tmp_path / "k"
    ctl = Controller(run_dir, args, {TAG: tag})
    try:
        ctl.wait_for_step(5)
        ctl.wait_for_commit()
        os.kill(ctl.proc.pid, signal.SIGKILL)
    finally:
        if ctl.proc.poll() is None:
            ctl.proc.kill()
    assert ctl.finish()[0] == -signal.SIGKILL
    killed_at = CheckpointStore(run_dir).committed()[-1]
    assert 0 < killed_at < 10, "killed mid-epoch"
    out = Controller(run_dir, args, {TAG: tag}).succeed()
    assert f"resumed from {run_dir}/checkpoints/{killed_at}" in out
    assert_same_batches(run_dir, token_reference)
    assert wait_gone(tagged(tag)) == []


def test_tokens_run_recovers_a_killed_worker_to_the_same_batches(token_reference, token_corpus, tmp_path):
    """A worker SIGKILLed after step 7 of a tokens run: the run rewinds Grain's iterator to the
    restored checkpoint's state and ends with the uninterrupted run's batches, losses and state."""
    run_dir, tag = tmp_path / "w", uuid.uuid4().hex
    out = kill_worker_after_step(run_dir, tag, [*TOKEN_ARGS, f"data.path={token_corpus}"], 7)
    assert "recovered:" in out, out
    assert_same_batches(run_dir, token_reference)
    assert wait_gone(tagged(tag)) == []


def test_a_resume_on_another_corpus_is_refused(token_corpus, tmp_path):
    """The same data.path tokenized again from other text: the resume names both corpus hashes,
    before any worker starts."""
    corpus = tmp_path / "corpus"
    shutil.copytree(token_corpus, corpus)
    args = ["configs/gpt_tiny.yaml", *TOKEN_OVERRIDES, *TOKEN_ARGS, f"data.path={corpus}", "train.steps=3"]
    run_dir, tag = tmp_path / "r", uuid.uuid4().hex
    Controller(run_dir, args, {TAG: tag}).succeed()
    before = tokens.Corpus(corpus).hash
    text = corpus.parent / "other.txt"
    text.write_text((Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()[:4200])
    tokens.write([text], corpus, tokens.Corpus(corpus).tokenizer())
    rc, out = Controller(run_dir, args, {TAG: tag}).finish()
    err = (tmp_path / "r.stderr").read_text()
    assert rc == 2, out
    assert f"holds checkpoints trained on other data (corpus_hash {before} -> {tokens.Corpus(corpus).hash})" in err
    assert wait_gone(tagged(tag)) == []
