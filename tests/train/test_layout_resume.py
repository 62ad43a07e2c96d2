"""A checkpoint restores onto another layout: leaves are keyed by parameter path.

Real worker processes (one LocalCluster of 4, shared), real Orbax. Each case trains a small
GPT (SGD with momentum, 4 microbatches) for 4 steps on layout A, checkpointing at steps 2
and 4; then a Trainer on layout B resumes A's step-2 checkpoint and trains steps 3 and 4:
  - its restored parameters equal A's after step 2 bitwise, path by path;
  - its losses equal A's steps 3 and 4 to relative 1e-6 (the gradient sums may be ordered
    differently on another layout);
  - its losses equal an uninterrupted run on layout B (steps 3 and 4) bitwise in every case
    here: 2 <-> 4 stages, 1f1b -> zb-h1 and v=1 -> v=2 interleaved all accumulate each stage's
    gradients over the microbatches in the same order and run the same per-layer math, and
    on this CPU (Eigen's threads off) the runs agree to the bit. The test asserts what holds.
"""

import json
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from mpmd import models
import mpmd
from tests.support import recovery_runs
from tests.support.marked_models import MarkedGPT

pytestmark = pytest.mark.slow  # worker processes or a controller (tests/README.md)

LAYOUTS = {
    "2x1f1b": (2, "1f1b", 1),
    "4x1f1b": (4, "1f1b", 1),
    "2xzbh1": (2, "zb-h1", 1),
    "4xinterleaved": (4, "interleaved-1f1b", 2),
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    cluster = mpmd.LocalCluster(num_workers=4, root=str(root))
    yield cluster, root
    cluster.close()


def make_trainer(cluster, run_dir, layout, model=None, optimizer=None, num_microbatches=4):
    num_stages, schedule, virtual = LAYOUTS[layout] if isinstance(layout, str) else layout
    model = model or models.GPT(64, 64, 2, 4, 32, rngs=nnx.Rngs(0))
    stages = mpmd.split(model) if isinstance(model, MarkedGPT) else mpmd.split(model, num_stages=num_stages)
    return mpmd.Trainer(
        mpmd.Pipeline(stages, models.lm_loss),
        optimizer or optax.sgd(0.1, momentum=0.9),
        schedule=schedule,
        num_microbatches=num_microbatches,
        virtual_stages=virtual,
        cluster=cluster,
        run_dir=str(run_dir),
        checkpoint=mpmd.Checkpointing(every=2, keep=2),
    )


def by_path(trainer) -> dict:
    """{parameter path: host array}; every copy of a tied weight must be bitwise equal."""
    out = {}
    for paths, state in zip(trainer.pipeline.param_paths, trainer.params()):
        for path, leaf in zip(paths, jax.tree.leaves(state)):
            leaf = np.asarray(leaf)
            if path in out:
                assert np.array_equal(out[path], leaf), f"the copies of tied weight {path} differ"
            out[path] = leaf
    return out


def run(trainer, steps=range(4), after=None):
    """Train the given batch indices; `after(i)` runs once step i+1 is collected."""
    data, losses = recovery_runs.data(), []
    for i in steps:
        losses.append(trainer.step(data[i], data[i], data_state={"i": i + 1})["loss"])
        if after is not None:
            after(i)
    return losses


def reference(cluster, layout, model_fn=None):
    """Layout `layout` uninterrupted for 4 steps: (its run_dir, losses, params after step 2)."""
    c, root = cluster
    name = layout if isinstance(layout, str) else "x".join(map(str, layout))
    run_dir = root / f"ref-{name}-{'tied' if model_fn else 'gpt'}"
    seen = {}
    trainer = make_trainer(c, run_dir, layout, model_fn() if model_fn else None)
    try:
        losses = run(trainer, after=lambda i: seen.setdefault("p2", by_path(trainer)) if i == 1 else None)
        trainer.checkpoints.wait()
    finally:
        trainer.close(close_cluster=False)
    return run_dir, losses, seen["p2"]


def resume_from_step_2(cluster, ref_dir, name, layout, **kw):
    """A copy of `ref_dir` holding only its step-2 checkpoint, resumed with `layout`."""
    c, root = cluster
    run_dir = root / name
    shutil.copytree(ref_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "4")
    return make_trainer(c, run_dir, layout, **kw)


@pytest.fixture(scope="module")
def refs(cluster):
    return {layout: reference(cluster, layout) for layout in ("2x1f1b", "4x1f1b")}


@pytest.mark.parametrize(
    "saved, resumed", [("2x1f1b", "4x1f1b"), ("4x1f1b", "2x1f1b"), ("2x1f1b", "2xzbh1"), ("4x1f1b", "4xinterleaved")]
)
def test_resume_on_another_layout_continues_the_same_training(cluster, refs, saved, resumed):
    ref_dir, ref_losses, ref_params = refs[saved]
    trainer = resume_from_step_2(cluster, ref_dir, f"{saved}-to-{resumed}", resumed)
    try:
        assert trainer.resumed == (2, {"i": 2})
        assert (
            trainer.layout_change and trainer.layout_change.split(" -> ")[0] != trainer.layout_change.split(" -> ")[1]
        )
        restored = by_path(trainer)
        assert sorted(restored) == sorted(ref_params)
        assert all(np.array_equal(restored[p], ref_params[p]) for p in ref_params), "restore is not exact"
        losses = run(trainer, range(2, 4))
    finally:
        trainer.close(close_cluster=False)
    np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-6)
    # The new layout's own uninterrupted run (a reference of its own, or one computed here).
    own = refs[resumed][1] if resumed in refs else reference(cluster, resumed)[1]
    assert losses == own[2:], f"not bitwise equal to the uninterrupted {resumed} run: {losses} vs {own[2:]}"


def test_tied_weight_is_stored_once_and_resumes_on_another_stage_count(cluster):
    """MarkedGPT ties its embedding to the LM head: stage 0 and the last stage both hold it."""
    three = lambda: MarkedGPT(vocab=64, d_model=16, seq_len=32, boundaries=(1, 3), rngs=nnx.Rngs(0))
    two = MarkedGPT(vocab=64, d_model=16, seq_len=32, boundaries=(1,), rngs=nnx.Rngs(0))
    ref_dir, ref_losses, ref_params = reference(cluster, (3, "1f1b", 1), three)
    manifest = json.loads((ref_dir / "checkpoints" / "2" / "manifest.json").read_text())
    tied = [n for n in manifest["leaves"] if n.endswith("embed.embedding")]
    assert sorted(tied) == ["opt/0.trace/embed.embedding", "params/embed.embedding"], tied  # once each
    assert {manifest["leaves"][n]["part"].split(".")[0] for n in tied} == {"slice_0"}
    trainer = resume_from_step_2(cluster, ref_dir, "tied-3-to-2", (2, "1f1b", 1), model=two)
    try:
        assert trainer.pipeline.shared, "the resumed pipeline shares the embedding between its two stages"
        restored = by_path(trainer)  # asserts the two copies are bitwise equal
        assert all(np.array_equal(restored[p], ref_params[p]) for p in ref_params)
        losses = run(trainer, range(2, 4))
        by_path(trainer)  # still equal after two updates
    finally:
        trainer.close(close_cluster=False)
    np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_microbatches": 8}, r"other settings that change the math \(num_microbatches: 4 -> 8\)"),
        ({"optimizer": optax.adamw(1e-3)}, r"another model or optimizer state.*opt/0\.mu/"),
        (
            {"model": models.GPT(64, 32, 2, 4, 32, rngs=nnx.Rngs(0))},
            r"another model.*opt/0\.trace/blocks\.0\.attn\.out\.bias saved \(64,\) float32, now \(32,\)",
        ),
    ],
)
def test_a_resume_that_changes_the_math_is_refused(cluster, refs, change, match):
    c, root = cluster
    with pytest.raises(ValueError, match=match):
        resume_from_step_2(cluster, refs["2x1f1b"][0], f"refused-{sorted(change)[0]}", "4x1f1b", **change)


def test_a_changed_global_batch_is_refused_at_the_first_step(cluster, refs):
    trainer = resume_from_step_2(cluster, refs["2x1f1b"][0], "refused-batch", "2x1f1b")
    try:
        x = recovery_runs.data()[2][:8]
        with pytest.raises(
            ValueError, match=r"global batch is 8x32 int32, 8x32 int32 .* trained on 16x32 int32, 16x32 int32"
        ):
            trainer.step(x, x)
    finally:
        trainer.close(close_cluster=False)


def test_stages_without_model_paths_refuse_another_stage_count(cluster):
    c, root = cluster
    layers = models.GPT(64, 64, 2, 4, 32, rngs=nnx.Rngs(0)).layers()
    pipe = lambda cuts: mpmd.Pipeline([nnx.Sequential(*layers[a:b]) for a, b in zip(cuts, cuts[1:])], models.lm_loss)
    trainer = mpmd.Trainer(
        pipe([0, 3, 6]),
        optax.sgd(0.1),
        schedule="1f1b",
        num_microbatches=4,
        cluster=c,
        run_dir=str(root / "modules"),
        checkpoint=mpmd.Checkpointing(every=1),
    )
    try:
        assert trainer.pipeline.scoped_paths
        run(trainer, range(1))
    finally:
        trainer.close(close_cluster=False)
    with pytest.raises(ValueError, match=r"saved with 2 stages, this run has 3: stages given as plain nnx.Modules"):
        mpmd.Trainer(
            pipe([0, 2, 4, 6]),
            optax.sgd(0.1),
            schedule="1f1b",
            num_microbatches=4,
            cluster=c,
            run_dir=str(root / "modules"),
        )


def test_a_checkpoint_from_before_keyed_leaves_restores_only_on_its_layout(cluster):
    """Step 2 written as mpmd wrote checkpoints before leaves were keyed (each stage's bundles
    p<k>, o<k> by position in `stage_<k>/`, the layout as the manifest's partition): it
    restores on that layout and training continues bitwise as without the stop; any other
    layout is refused, saying why."""
    c, root = cluster
    run_dir = root / "old-format"
    trainer = make_trainer(c, run_dir, "2x1f1b")
    trainer.checkpoint_every = 0
    try:
        run(trainer, range(2))
        saved = by_path(trainer)
        store = trainer.checkpoints.store
        step_dir = store.prepare(2)
        for k, r in enumerate(trainer.placement):
            c.save(r, {str(step_dir / f"stage_{k}"): [f"p{k}", f"o{k}"]})
        for r in range(trainer.num_slices):
            c.wait_saves(r)
        old = {
            "num_stages": 2,
            "num_slices": 2,
            "schedule": "1f1b",
            "virtual_stages": 1,
            "params": [[list(l.shape) for l in fn.param_leaves] for fn in trainer.pipeline.fns],
        }
        store.commit(2, {"partition": old, "data_state": {"i": 2}})
        want = run(trainer, range(2, 4))
    finally:
        trainer.close(close_cluster=False)
    with pytest.raises(
        ValueError,
        match=r"saved before checkpoints were keyed by parameter path.*restores only "
        r"onto the layout that saved it",
    ):
        make_trainer(c, run_dir, "4x1f1b")
    trainer = make_trainer(c, run_dir, "2x1f1b")
    try:
        assert trainer.resumed == (2, {"i": 2}) and trainer.layout_change is None
        restored = by_path(trainer)
        assert all(np.array_equal(restored[p], saved[p]) for p in saved)
        assert run(trainer, range(2, 4)) == want
    finally:
        trainer.close(close_cluster=False)
