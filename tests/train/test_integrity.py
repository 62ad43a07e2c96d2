"""Silent damage and non-finite steps (issue 29, items 1 and 2): checksummed checkpoints and
the non-finite guard.

A bit flipped in a checkpoint's data, or a byte in its manifest that keeps it valid JSON, is
found on restore by the digests recorded at commit: the step is set aside and the older one
resumed, bitwise as an uninterrupted run. A step whose loss is not finite is never
committed, and pruning keeps the newest good step whatever came after it.
"""

import json
import logging
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpmd
from mpmd.recipes import config
from mpmd.runtime.control.inprocess import InProcessCluster
from mpmd.runtime.worker.slice_store import MANIFEST_DIGEST, CheckpointStore
from mpmd.train.checkpoint_reader import read_leaves
from tests.support import recovery_runs
from tests.support.processes import mpmd_train


def flip_bit_in_stored_leaf(run_dir: Path, step: int) -> str:
    """Flip one low mantissa bit of one value of step `step`'s largest leaf where Orbax stored
    it, through tensorstore, so that the part still decodes: damage only the digests can
    find (a bit flipped in Orbax's files themselves mostly breaks their zstd frames, which
    tensorstore refuses before any digest is checked). The leaf's name."""
    import tensorstore as ts

    manifest = CheckpointStore(run_dir).manifest(step)
    _, leaves = read_leaves(run_dir, step)
    name = max(leaves, key=lambda k: (leaves[k].nbytes, k))
    part = run_dir / "checkpoints" / str(step) / manifest["leaves"][name]["part"]
    stored = ts.open(
        {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{part}", "path": f"{name}/"}}
    ).result()
    values = np.array(stored.read().result())
    assert np.array_equal(values, leaves[name])
    flat = values.reshape(-1).view(np.uint32)
    flat[flat.size // 2] ^= 0x10
    stored.write(values).result()
    return name


def six_steps(run_dir, cluster):
    """Train recovery_runs' pipeline 6 steps on `cluster` with steps 2, 4 and 6 committed."""
    with recovery_runs.make_trainer(cluster, run_dir, checkpoint=mpmd.Checkpointing(every=2, keep=3)) as t:
        recovery_runs.train(t, recovery_runs.data(), steps=6)
    assert CheckpointStore(run_dir).committed() == [2, 4, 6]


def resume_to_the_end(run_dir, cluster) -> tuple:
    """Resume `run_dir` on `cluster` and train to recovery_runs.STEPS: (resumed step, losses, params)."""
    with recovery_runs.make_trainer(cluster, run_dir, checkpoint=mpmd.Checkpointing(every=2, keep=3)) as t:
        resumed = t.resumed[0]
        losses, params, _ = recovery_runs.train(t, recovery_runs.data())
    return resumed, losses, params


@pytest.mark.slow  # real worker processes
def test_flipped_bit_in_data_is_set_aside_and_the_older_step_resumed(uninterrupted, workers, tmp_path, caplog):
    """One bit of the largest leaf flipped where step 6 stores it: restore finds the leaf
    does not match its digest, warns naming the step, the slice's part and the leaf, sets step
    6 aside and resumes from 4; the run then ends bitwise equal to the uninterrupted one."""
    six_steps(tmp_path, workers)
    leaf = flip_bit_in_stored_leaf(tmp_path, 6)
    with caplog.at_level(logging.WARNING, logger="mpmd"):
        resumed, losses, params = resume_to_the_end(tmp_path, workers)
    assert resumed == 4
    warning = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping checkpoint step 6")]
    assert len(warning) == 1, caplog.text
    assert re.search(
        rf"checkpoints/6/slice_\d\.g[0-9a-f-]+: leaf '{re.escape(leaf)}' does not match the digest", warning[0]
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "6", "6.damaged-0", "8"]
    assert {s: l for s, l in losses.items()} == {s: l for s, l in uninterrupted[0].items() if s > 4}
    assert all(np.array_equal(a, b) for a, b in zip(params, uninterrupted[1])), "final parameters differ"


def test_flipped_byte_in_manifest_is_damage(uninterrupted, tmp_path, caplog):
    """The data position in step 6's manifest changed 6 -> 7 (valid JSON still): it does not
    match its digest, so step 6 is damaged and set aside, and the run resumes from step 4."""
    six_steps(tmp_path, InProcessCluster())
    path = tmp_path / "checkpoints" / "6" / "manifest.json"
    text = path.read_text()
    assert '"i": 6' in text
    path.write_text(text.replace('"i": 6', '"i": 7'))
    json.loads(path.read_text())
    with caplog.at_level(logging.WARNING, logger="mpmd"):
        resumed, losses, params = resume_to_the_end(tmp_path, InProcessCluster())
    assert resumed == 4
    assert f"{path} does not match its digest in {MANIFEST_DIGEST}" in caplog.text
    assert (tmp_path / "checkpoints" / "6.damaged-0").is_dir()
    assert all(np.array_equal(a, b) for a, b in zip(params, uninterrupted[1])), "final parameters differ"


@pytest.mark.slow
@pytest.mark.every_jax
def test_checkpoint_without_digests_restores_unverified(uninterrupted, tmp_path, caplog):
    """A step saved before digests were recorded (no leaf digests, no manifest.sha256)
    restores, with one line saying it is unverified, and trains on as before."""
    six_steps(tmp_path, InProcessCluster())
    for step in (2, 4, 6):
        d = tmp_path / "checkpoints" / str(step)
        manifest = json.loads((d / "manifest.json").read_text())
        for leaf in manifest["leaves"].values():
            del leaf["digest"]
        del manifest["finite"]
        (d / "manifest.json").write_text(json.dumps(manifest))
        (d / MANIFEST_DIGEST).unlink()
    with caplog.at_level(logging.WARNING, logger="mpmd"):
        resumed, losses, params = resume_to_the_end(tmp_path, InProcessCluster())
    assert resumed == 6
    assert "checkpoint step 6 has no digests (saved before mpmd recorded them): restored unverified" in caplog.text
    assert all(np.array_equal(a, b) for a, b in zip(params, uninterrupted[1])), "final parameters differ"


def test_pruning_keeps_the_newest_good_step(tmp_path):
    """keep=1: a newer committed step that is not good (its loss not finite, or no digests)
    never makes pruning drop the newest good one."""
    store = CheckpointStore(tmp_path)
    leaves = {"params/w": {"shape": [], "dtype": "float32", "part": "slice_0", "digest": "sha256:00"}}
    for step, finite, digested in ((2, True, True), (4, True, True), (6, False, True), (8, True, False)):
        store.prepare(step)
        unverified = {"params/w": {k: v for k, v in leaves["params/w"].items() if k != "digest"}}
        store.commit(step, {"format": 2, "finite": finite, "leaves": leaves if digested else unverified})
    store.prune(1)
    assert store.committed() == [4, 8]


# -- non-finite steps ----------------------------------------------------------------------
def linear_trainer(run_dir, on_nonfinite):
    """Two nnx.Linear stages on float inputs (a batch can hold a NaN), a checkpoint every step."""
    rngs = nnx.Rngs(0)
    pipe = mpmd.Pipeline(
        [nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)], lambda out, y: jnp.mean((out - y) ** 2)
    )
    return mpmd.Trainer(
        pipe,
        optax.sgd(0.1),
        num_microbatches=2,
        max_grad_norm=1.0,
        run_dir=run_dir,
        checkpoint=mpmd.Checkpointing(every=1, keep=1),
        recovery=mpmd.Recovery(on_nonfinite=on_nonfinite),
    )


def float_batches(n):
    rng = np.random.default_rng(3)
    return [rng.normal(size=(8, 4)).astype(np.float32) for _ in range(n)]


def test_nonfinite_step_stops_and_keeps_the_last_committed(tmp_path):
    """A batch holding a NaN at step 3 (on_nonfinite="stop"): NonFinite names step 3, step 3
    is not committed, step 2 (keep=1) is still there, and a save of the state is refused."""
    batches = float_batches(3)
    batches[2][0, 0] = np.nan
    with linear_trainer(tmp_path, "stop") as t:
        for x in batches[:2]:
            t.step(x, x)
        with pytest.raises(mpmd.NonFinite, match=r"^step 3 has a non-finite loss nan.*last committed step is 2"):
            t.step(batches[2], batches[2])
        with pytest.raises(ValueError, match="never saved"):
            t.save(wait=True)
    assert CheckpointStore(tmp_path).committed() == [2]


def test_nonfinite_step_rewinds_once(tmp_path):
    """on_nonfinite="rewind": the NaN batch at step 3 rewinds to committed step 2 (Rewound),
    training goes on with the next batches and ends as a run that never saw that batch; the
    same step non-finite again after its rewind stops."""
    good = float_batches(4)
    bad = good[0].copy()
    bad[1, 2] = np.inf
    with linear_trainer(tmp_path / "ref", "stop") as t:
        for x in good:
            t.step(x, x)
        want = [np.asarray(l) for l in jax_leaves(t.params())]
    with linear_trainer(tmp_path / "run", "rewind") as t:
        for x in good[:2]:
            t.step(x, x)
        with pytest.raises(mpmd.Rewound) as e:
            t.step(bad, bad)
        assert e.value.step == 2 and e.value.tier == "persistent"
        for x in good[2:]:
            t.step(x, x)
        assert t.step_count == 4
        assert all(np.array_equal(a, b) for a, b in zip(jax_leaves(t.params()), want))
        with pytest.raises(mpmd.Rewound):
            t.step(bad, bad)  # step 5, rewound to 4
        with pytest.raises(mpmd.NonFinite, match="step 5 .* again after a rewind"):
            t.step(bad, bad)
    assert CheckpointStore(tmp_path / "run").committed() == [4]


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_on_nonfinite_skip_is_refused_in_config():
    with pytest.raises(config.ConfigError, match="train.on_nonfinite: 'skip' is not supported"):
        config.load(None, ["train.on_nonfinite=skip"])
    assert config.load(None, ["train.on_nonfinite=rewind"]).train.on_nonfinite == "rewind"


@pytest.mark.slow  # a controller subprocess
def test_nan_run_stops_with_one_error_line_and_keeps_the_good_step(tmp_path):
    """`mpmd train` at a learning rate of 1e30 with a checkpoint every step and keep=1: the
    loss turns non-finite, the run ends with one error line naming that step, and the step
    before it, the last committed one, is still on disk."""
    p = mpmd_train(
        "configs/gpt_tiny.yaml",
        "model.d_model=32",
        "model.num_layers=2",
        "model.seq_len=32",
        "train.batch_size=8",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.steps=20",
        "optimizer.lr=1e30",
        "optimizer.warmup_steps=0",
        "checkpoint.every=1",
        "checkpoint.keep=1",
        "log.progress=lines",
        "log.trace_steps=[]",
        "log.tensorboard=false",
        "data.max_bytes=300000",
        "cluster.backend=inprocess",
        f"run_dir={tmp_path}",
        timeout=240,
    )
    assert p.returncode == 1, p.stderr[-3000:]
    lines = [l for l in p.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, p.stderr[-3000:]
    step = int(re.match(r"error: step (\d+) has a non-finite loss", lines[0]).group(1))
    assert f"the last committed step is {step - 1} (kept)" in lines[0]
    store = CheckpointStore(tmp_path)
    assert store.committed() == [step - 1]
    assert store.manifest(step - 1)["finite"] is True
    read_leaves(tmp_path, step - 1)  # its digests verify
