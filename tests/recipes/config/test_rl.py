"""recipes/config/rl.py: the rl section's defaults, and each bad value refused while the config
loads, naming the key and what is allowed."""

import subprocess
import sys
import textwrap

import pytest

from mpmd.recipes import config
from mpmd.recipes.config import ConfigError
from tests.support.processes import ROOT

# A GRPO run's keys beside rl.*: a jsonl source, a language model, saves only at the end.
GRPO = [
    "model.kind=llama",
    "model.seq_len=24",
    "data.source=jsonl",
    "data.path=train.jsonl",
    "checkpoint.every=0",
    "rl.algorithm=grpo",
]


def refused(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        config.load(None, [*GRPO, *overrides])
    return str(e.value)


def test_rl_is_off_by_default_and_grpo_adds_the_samplers_worker():
    assert config.load(None, []).rl.algorithm is None
    cfg = config.load(None, GRPO)
    assert cfg.rl.reward == "mpmd.recipes.rl.rewards:exact_match"
    assert cfg.num_slices == 2 and len(cfg.slice_shapes()) == 2  # the learner's meshes
    assert cfg.num_workers == 3  # ... and the sampler's worker, which the local backend starts
    # The resolved config reloads to the same run.
    assert config.validate(cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize(
    "reward, says",
    [
        ("exact_match", "must be 'module:function'"),
        ("no_such_module_q:reward", "rl.reward: cannot import 'no_such_module_q'"),
        ("mpmd.recipes.rl.rewards:nothing", "module 'mpmd.recipes.rl.rewards' has no 'nothing'"),
        ("mpmd.recipes.rl.rewards:numbers", "is a module, not a function"),
        ("json:dumps", "must take (prompt, completion, *, response, ended)"),
    ],
)
def test_a_reward_that_is_not_such_a_function_is_refused_by_name(reward, says):
    message = refused(f"rl.reward={reward}")
    assert f"rl.reward={reward!r}" in message or "rl.reward:" in message
    assert says in message


def test_a_users_reward_module_beside_the_config_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_q.py").write_text("def short(prompt, completion, **_):\n    return -len(completion)\n")
    (tmp_path / "bad_rewards_q.py").write_text("raise RuntimeError('broken on import')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_module puts the cwd on it
    assert config.load(None, [*GRPO, "rl.reward=my_rewards_q:short"]).rl.reward == "my_rewards_q:short"
    assert "importing 'bad_rewards_q' raised RuntimeError: broken on import" in refused("rl.reward=bad_rewards_q:short")
    for name in ("my_rewards_q", "bad_rewards_q"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "override, says",
    [
        ("rl.off_policy_steps=2", "rl.off_policy_steps must be one of"),
        ("rl.num_samples=1", "rl.num_samples must be >= 2"),
        ("rl.temperature=0", "rl.temperature must be > 0"),
        ("rl.algorithm=ppo", "rl.algorithm must be one of"),
        ("rl.sampler_mesh.tensor=0", "rl.sampler_mesh.tensor must be > 0"),
        ("rl.seeds=1", "unknown key 'rl.seeds'; did you mean 'rl.seed'?"),
        # across sections
        ("data={source: synthetic}", "needs data.source='jsonl', got 'synthetic'"),
        ("cluster.backend=inprocess", "rl.algorithm runs on cluster.backend='local'"),
        ("pipeline.num_microbatches=3", "rl.prompts_per_step x rl.num_samples = 128 rows must be divisible by"),
        ("rl.max_new_tokens=24", "rl.max_new_tokens=24 must be below model.seq_len=24"),
        (
            "cluster.num_workers=2",
            "cluster.num_workers=2 must equal pipeline.num_stages // pipeline.virtual_stages + 1",
        ),
        ("rl.sampler_mesh.tensor=2", "rl.sampler_mesh:"),
        ("pipeline.cuts=[2]", "set pipeline.cuts=null"),
        ("model.tie_embeddings=true", "model.tie_embeddings=true yet"),
    ],
)
def test_bad_rl_values_are_refused_naming_the_key(override, says):
    message = refused(override)
    assert says in message, message


def test_a_bad_reward_stops_mpmd_train_before_anything_starts(tmp_path):
    """Exit status 2 and one error naming rl.reward, from the config alone: no run directory,
    no worker, and JAX never imported (the check is in the config's load)."""
    run_dir = tmp_path / "never"
    script = textwrap.dedent(
        f"""
        import sys
        from mpmd.recipes.commands import train
        status = train.main(["configs/llama_sft.yaml", "rl.algorithm=grpo", "checkpoint.every=0",
                             "rl.reward=no_such_module_q:r", "run_dir={run_dir}"])
        print("jax imported:", "jax" in sys.modules)
        sys.exit(status)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: rl.reward: cannot import 'no_such_module_q'")
    assert "jax imported: False" in proc.stdout
    assert not run_dir.exists()
