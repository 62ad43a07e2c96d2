"""recipes/run/rl.py end to end: `mpmd train` of a tiny GRPO config on worker processes (a
learner of two pipelined slices, the sampler on a third), from the real command line."""

import json

import pytest

from mpmd.recipes.commands import sft_data
from mpmd.recipes.run import run_log
from tests.support.processes import mpmd_train

pytestmark = pytest.mark.slow  # worker processes and a controller subprocess


def test_grpo_run_logs_rewards_and_exact_match_and_saves_the_policy(tmp_path):
    train, heldout = sft_data.make("reverse", 64, 4, seed=1)
    paths = sft_data.write(tmp_path / "data", train, heldout)
    run_dir = tmp_path / "run"
    args = [
        "configs/llama_grpo.yaml",
        "model.d_model=32",  # a random tiny Llama: the recipe's path, not its numbers
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.num_layers=2",
        f"data.path={paths[0]}",
        f"data.eval_path={paths[1]}",
        "train.steps=3",
        "train.eval_every=2",
        "train.exact_match=4",
        "pipeline.num_microbatches=2",
        "rl.prompts_per_step=2",
        "rl.num_samples=4",
        "rl.off_policy_steps=1",
        "rl.kl_coef=0.1",  # a reference worker too
        "log.progress=lines",
        "log.every=1",
        f"run_dir={run_dir}",
    ]
    proc = mpmd_train(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = run_log.read(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 <= r["reward"] <= 1 and 1 <= r["completion_length"] <= 8  # rl.max_new_tokens=8
        assert "loss" in r and r["step_s"] > 0 and r["kl"] >= 0
    assert 0 <= records[0]["exact_match_before"] <= 1
    assert [r["step"] for r in records if "exact_match" in r] == [2, 3]
    assert "reward" in proc.stdout and "done: 3 steps" in proc.stdout
    # The policy is saved at the end (for generate, export, init_from=run:), the run described.
    assert (run_dir / "checkpoints" / "3").is_dir()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["config_file"] == "configs/llama_grpo.yaml" and info["memory"]["slices"]
    page = (run_dir / "report.html").read_text()
    assert all(f"data-region='{name}'" in page for name in ("reward", "completion-length", "exact-match", "kl"))
    # The same command with more steps resumes from the checkpoint at the end (GRPO's data state
    # in it) and trains step 4 only.
    again = mpmd_train(*[a if a != "train.steps=3" else "train.steps=4" for a in args])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr
    assert [r["step"] for r in run_log.read(run_dir)] == [1, 2, 3, 4]
