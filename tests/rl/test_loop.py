"""GRPO across slice groups on real worker processes: a learner of two pipelined slices, a
sampler slice, the weights moved learner -> sampler each step (mpmd/rl/loop.py)."""

import os
import signal
import tempfile

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mpmd
from mpmd import models
from mpmd.groups.client import Groups
from mpmd.rl import grpo, sampler
from mpmd.rl.loop import GRPO, padded
from mpmd.stages.leaf_paths import path_string

pytestmark = [pytest.mark.slow, pytest.mark.every_jax]

TARGET = 3  # the token the reward asks for
NEW = 6


def reward(prompt, completion):
    return sum(t == TARGET for t in completion) / NEW


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rl"))
    g = Groups(mpmd.LocalCluster(4, root=root), {"learner": [{}, {}], "sampler": {}, "reference": {}}, root=root)
    yield g
    g.close()


def prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(4, 16, rng.integers(2, 5)))) for _ in range(64)]


def grpo_of(groups, lr=0.5, off_policy_steps=0, **kw) -> GRPO:
    """GRPO of a fresh tiny GPT (vocab 16, width 16, 2 blocks, 12 tokens): 4 prompts x 4 samples
    x NEW tokens a step, the learner in 2 stages (1F1B, 2 microbatches)."""
    model = models.GPT(16, 16, 2, 2, 12, rngs=nnx.Rngs(0))
    return GRPO(
        groups,
        model,
        optax.sgd(lr, momentum=0.9),
        reward=reward,
        num_stages=2,
        num_samples=4,
        max_new_tokens=NEW,
        prompt_len=4,
        off_policy_steps=off_policy_steps,
        schedule="1f1b",
        num_microbatches=2,
        **kw,
    )


def run(groups, steps, lr=0.5, off_policy_steps=0):
    """Per step, its metrics; and the GRPO (closed)."""
    rl = grpo_of(groups, lr, off_policy_steps)
    ps = prompts()
    ids = lambda s: [(4 * s + i) % len(ps) for i in range(4)]
    out = []
    try:
        for s in range(steps):
            out.append(rl.step([ps[i] for i in ids(s)], ids(s), [ps[i] for i in ids(s + 1)], ids(s + 1)))
    finally:
        rl.close()
    return out, rl


def test_grpo_raises_the_reward(groups):
    metrics, _ = run(groups, 8)
    rewards = [m["reward"] for m in metrics]
    assert rewards[0] < 0.15 and rewards[-1] > 0.8, rewards


def test_the_sampler_group_draws_what_the_learners_weights_draw_here(groups):
    """After training, the samples drawn on the sampler's slice from the synced weights are
    bitwise those the same sampler program draws on this process from those weights."""
    _, rl = run(groups, 2)
    model = models.GPT(16, 16, 2, 2, 12, rngs=nnx.Rngs(0))
    ps = prompts()[:3]
    tokens, lens = padded(ps, 4)
    key = jax.random.key_data(jax.random.key(7))
    handle = rl.sampler(rl.sync(), tokens, lens, [0, 1, 2], key)
    got = groups.fetch(handle)
    # the model on this process with the synced parameters (bitwise the learner's:
    # tests/groups/test_trainer_group.py), through the same sampler program, jitted here
    fn, _ = sampler.program(model, num_samples=4, max_new_tokens=NEW, temperature=1.0)
    paths = rl.trainer.pipeline.param_paths
    stage_params = [groups.fetch(h) for h in rl.sync.copies]
    leaves = {path: leaf for ps_, tree in zip(paths, stage_params) for path, leaf in zip(ps_, jax.tree.leaves(tree))}

    state = nnx.split(model)[1]
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    assert leaves and set(leaves) <= {path_string(p) for p, _ in flat}  # every trained leaf is placed
    full = [leaves.get(path_string(p), leaf) for p, leaf in flat]
    want = jax.jit(fn)(full, tokens, lens, np.arange(3, dtype=np.int32), key)
    assert np.array_equal(got.tokens, np.asarray(want.tokens))
    assert np.array_equal(got.lengths, np.asarray(want.lengths))
    np.testing.assert_allclose(got.logprobs, np.asarray(want.logprobs), atol=1e-6)


def test_the_kl_term_reads_a_frozen_reference_on_its_own_group(groups):
    """The reference group holds the model as it started: its log-probabilities of a batch's
    targets are the starting model's here (1e-5), the KL to it starts at 0 and grows as the
    policy moves away."""
    rl = grpo_of(groups, kl_coef=0.5, reference="reference")
    try:
        metrics = rl.run(prompts_of, 4)
        rng = np.random.default_rng(3)
        batch = {
            "inputs": rng.integers(0, 16, (4, 12)).astype(np.int32),
            "targets": rng.integers(0, 16, (4, 12)).astype(np.int32),
        }
        got = groups.fetch(rl.reference(batch))
    finally:
        rl.close()
    start = models.GPT(16, 16, 2, 2, 12, rngs=nnx.Rngs(0))
    want = grpo.token_logprobs(start(batch["inputs"]), batch["targets"])
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-5)
    kls = [m["kl"] for m in metrics]
    assert kls[0] < 1e-9 < kls[-1], kls  # step 0 samples from the reference's own weights


def test_off_policy_samples_come_from_the_weights_one_update_behind(groups):
    """With off_policy_steps=1, step 1 trains on samples drawn from the initial weights (while
    step 0 trained): the same draws as a run that never updates; step 0 is the same in both."""
    off, _ = run(groups, 3, off_policy_steps=1)
    frozen, _ = run(groups, 2, lr=0.0)
    assert [m["reward"] for m in off[:2]] == [m["reward"] for m in frozen[:2]]
    assert off[1]["loss"] != 0.0  # the ratio is no longer 1: the policy moved since the draw


# -- a worker lost on either group ------------------------------------------------------------
FAULT_STEPS = 5


def faulted(groups, off_policy_steps, kill=None, at=2, in_flight=False):
    """(per step: reward, length, loss) of a GRPO run of FAULT_STEPS steps with the in-memory tier,
    whose worker of slice `kill` (None: none) is SIGKILLed once, at step `at`: before it starts,
    or `in_flight`, right after its training step is sent (off-policy, the next step's sampling
    is in flight too)."""
    rl = grpo_of(
        groups,
        off_policy_steps=off_policy_steps,
        run_dir=tempfile.mkdtemp(dir=groups.root),  # under the workers' root
        checkpoint=mpmd.Checkpointing(memory_every=1),
    )
    killed = []
    before = groups.generations[kill] if kill is not None else None

    def fire(when):
        if kill is not None and when == in_flight and rl.step_count == at and not killed:
            killed.append(groups.cluster.pids[kill])
            os.kill(killed[0], signal.SIGKILL)

    submit = rl.trainer.submit

    def submit_then_fire(*args, **kw):
        pending = submit(*args, **kw)
        fire(True)
        return pending

    rl.trainer.submit = submit_then_fire
    try:
        out = rl.run(prompts_of, FAULT_STEPS, lambda t, m: fire(False))
    finally:
        rl.close()
    assert (kill is None) == (not killed)
    if killed:  # one new worker serves the slice
        seen = (groups.generations[kill] - before, groups.cluster.pids[kill], killed[0])
        assert seen[0] == 1 and seen[1] != seen[2], seen
    return figures(out)


def prompts_of(s):
    """Step s's 4 prompts and their ids."""
    ps = prompts()
    return [ps[(4 * s + i) % 64] for i in range(4)], [(4 * s + i) % 64 for i in range(4)]


def figures(metrics) -> list:
    return [(m["reward"], m["length"], m["loss"]) for m in metrics]


@pytest.fixture(scope="module")
def uninterrupted_rl(groups):
    return {off: faulted(groups, off) for off in (0, 1)}


@pytest.mark.parametrize(
    "group, off_policy_steps, in_flight",
    [("sampler", 1, True), ("learner", 1, True), ("sampler", 0, False), ("learner", 0, False)],
    ids=[
        "sampler-off-policy-in-flight",
        "learner-off-policy-in-flight",
        "sampler-between-steps",
        "learner-between-steps",
    ],
)
def test_a_killed_worker_of_either_group_recovers_bitwise(groups, uninterrupted_rl, group, off_policy_steps, in_flight):
    """The rewards, completion lengths and losses of every step equal the uninterrupted run's,
    bitwise: the learner restored from the in-memory tier (with the samples drawn ahead saved
    beside it), the sampler's new worker given the weights again, the same draws replayed."""
    kill = groups.slice_of("sampler") if group == "sampler" else groups.groups["learner"].slices[1]
    got = faulted(groups, off_policy_steps, kill=kill, in_flight=in_flight)
    assert got == uninterrupted_rl[off_policy_steps]


def test_a_resumed_run_equals_an_uninterrupted_one(groups, uninterrupted_rl):
    """Off-policy, stopped after step 3 with a checkpoint at step 2, and started again on the
    same run directory: steps 2..4 replay from the checkpoint (its data state holds the samples
    drawn ahead for step 2) and every step's figures are the uninterrupted run's."""
    run_dir = tempfile.mkdtemp(dir=groups.root)
    first = grpo_of(groups, off_policy_steps=1, run_dir=run_dir, checkpoint=mpmd.Checkpointing(every=2))
    try:
        before = first.run(prompts_of, 3)
    finally:
        first.close()
    again = grpo_of(groups, off_policy_steps=1, run_dir=run_dir, checkpoint=mpmd.Checkpointing(every=2))
    try:
        assert again.step_count == 2 and again._ahead is not None
        after = again.run(prompts_of, FAULT_STEPS)
    finally:
        again.close()
    assert figures(before[:2] + after) == uninterrupted_rl[1]
