"""`mpmd train` end to end, as the real command in a subprocess, on tiny configs."""

import json
import sys

import pytest

from mpmd.recipes import config
from mpmd.recipes.run import run_log
from tests.support.processes import ROOT, TINY_GPT, mpmd_train

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gpt") / "run"
    proc = mpmd_train(
        "configs/gpt_tiny.yaml",
        "cluster.backend=inprocess",
        "train.steps=6",
        "train.eval_every=3",
        "log.trace_steps=[2]",
        "train.sample_tokens=8",
        f"run_dir={run_dir}",
        *TINY_GPT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_gpt_run_writes_config_and_metrics(gpt_run):
    run_dir, proc = gpt_run
    cfg = config.load(run_dir / "config.yaml")  # the resolved config reloads to the same run
    assert cfg.train.steps == 6 and cfg.model.d_model == 32 and cfg.run_dir == str(run_dir)
    assert cfg.cluster.backend == "inprocess"
    records = run_log.read(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["grad_norm"] > 0 and "lr" in r
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert [r["step"] for r in records if "bubble" in r] == [2]
    assert 0 <= records[1]["bubble"] < 1
    # Warmup: lr rises linearly from 0 over optimizer.warmup_steps (20 by default).
    assert records[0]["lr"] == 0 and records[5]["lr"] == pytest.approx(5 * 3e-3 / 20)
    assert records[-1]["loss"] < records[0]["loss"]
    assert "step 6/6" in proc.stdout and "done: 6 steps" in proc.stdout


def test_gpt_run_writes_trace_tensorboard_and_sample(gpt_run):
    run_dir, proc = gpt_run
    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}  # both slices' tasks, pipeline.num_stages=2
    assert {e["args"]["step"] for e in spans} == {2}
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    sample = (run_dir / "sample.txt").read_text()
    prompt = config.load(run_dir / "config.yaml").train.sample_prompt
    assert sample.startswith(prompt) and len(sample.encode("utf-8", "replace")) > len(prompt)
    assert "sample (8 bytes" in proc.stdout


def test_bad_config_exits_2_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "never"
    proc = mpmd_train("configs/gpt_tiny.yaml", "train.steps=0", "train.bacth_size=4", f"run_dir={run_dir}")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ")
    assert "train.bacth_size" in proc.stderr and "train.batch_size" in proc.stderr
    assert not run_dir.exists()
    proc = mpmd_train("configs/gpt_tiny.yaml", "pipeline.num_microbatches=3", f"run_dir={run_dir}")
    assert proc.returncode == 2 and "divisible by pipeline.num_microbatches=3" in proc.stderr
    assert not run_dir.exists()


def test_custom_stages_config_trains(tmp_path):
    run_dir = tmp_path / "custom"
    proc = mpmd_train(
        "configs/custom_stages.yaml",
        "train.steps=3",
        "model.d_model=16",
        "train.batch_size=8",
        "data.max_bytes=300000",
        "log.tensorboard=false",
        f"run_dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = run_log.read(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "eval_loss" in records[-1]  # eval at the end even off the eval_every grid
    trace = json.loads((run_dir / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, 2, 3}


def test_custom_stage_count_mismatch_is_a_config_error(capsys, tmp_path):
    # In this process: the command's exit 2 on a ConfigError, before anything starts, is
    # test_bad_config_exits_2_and_starts_nothing's (and tests/recipes/commands/test_train_mesh.py's).
    from mpmd.recipes.commands import train as train_cli

    run_dir = tmp_path / "custom"
    status = train_cli.main(
        [
            str(ROOT / "configs/custom_stages.yaml"),
            "pipeline.num_stages=2",
            "data.max_bytes=300000",
            f"run_dir={run_dir}",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2, err[-3000:]
    assert err.startswith("error: ") and "returned 4 stages but pipeline.num_stages=2" in err
    assert not run_dir.exists()


def test_mlp_config_trains(tmp_path):
    run_dir = tmp_path / "mlp"
    proc = mpmd_train("configs/mlp.yaml", "train.steps=4", "train.eval_every=2", f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = run_log.read(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert not (run_dir / "sample.txt").exists()


def test_a_bug_while_building_is_an_error_not_a_config_error(monkeypatch, tmp_path):
    from mpmd.recipes.run import build
    from mpmd.recipes.commands import train as train_cli

    def broken_optimizer(cfg):
        raise ValueError("a bug in the recipe")

    monkeypatch.setattr(build, "build_optimizer", broken_optimizer)
    run_dir = tmp_path / "bug"
    with pytest.raises(ValueError, match="a bug in the recipe") as error:
        train_cli.main([str(ROOT / "configs/mlp.yaml"), f"run_dir={run_dir}"])
    assert not isinstance(error.value, config.ConfigError)  # a traceback, not "error: ..."
    assert not run_dir.exists()


def test_missing_ray_is_a_one_line_error_naming_the_install(monkeypatch, capsys, tmp_path):
    from mpmd.recipes.commands import train as train_cli

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    run_dir = tmp_path / "ray"
    status = train_cli.main([str(ROOT / "configs/mlp.yaml"), "cluster.backend=ray", f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: cluster.backend='ray': RayCluster needs Ray") and err.count("\n") == 1
    assert "pip install -e '.[ray]'" in err
    assert not run_dir.exists()


def test_too_few_devices_for_inprocess_is_a_config_error():
    import jax

    from mpmd.recipes.run import build

    n = len(jax.devices()) + 1
    cfg = config.load(
        None,
        [
            "cluster.backend=inprocess",
            f"model.num_layers={n}",
            f"pipeline.num_stages={n}",
            f"pipeline.num_microbatches={n}",
            f"train.batch_size={n}",
        ],
    )
    with pytest.raises(config.ConfigError, match=rf"cluster.backend='inprocess': .*device_count={n}"):
        build.build_cluster(cfg)


def test_a_rerun_with_fewer_steps_than_the_run_holds_says_why_it_trains_none(gpt_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(gpt_run[0], run_dir)  # the fixture's run stays as its tests read it
    proc = mpmd_train(
        "configs/gpt_tiny.yaml",
        "cluster.backend=inprocess",
        "train.steps=4",
        "train.sample_tokens=0",
        f"run_dir={run_dir}",
        *TINY_GPT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to train: the run is at step 6 and train.steps=4" in proc.stdout + proc.stderr
    assert "done: 0 steps" in proc.stdout
    assert [r["step"] for r in run_log.read(run_dir)] == [1, 2, 3, 4, 5, 6]  # nothing dropped


def test_moe_tiny_logs_aux_loss_dropped_tokens_and_expert_load(tmp_path):
    """configs/moe_tiny.yaml's MoE (smaller), 4 steps: every record has the auxiliary loss (in the
    loss), each eval step the routing of the steps since the previous one, and the run ends
    with a sample."""
    run_dir = tmp_path / "moe"
    proc = mpmd_train(
        "configs/moe_tiny.yaml",
        "cluster.backend=inprocess",
        "train.steps=4",
        "train.eval_every=2",
        "train.sample_tokens=8",
        f"run_dir={run_dir}",
        *TINY_GPT[1:],
        "model.d_model=48",
        "model.num_layers=4",
        "model.moe.expert_mlp_dim=32",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = run_log.read(run_dir)
    assert all(0 < r["aux_loss"] < r["loss"] for r in records)
    routed = [r for r in records if "expert_load" in r]
    assert [r["step"] for r in routed] == [2, 4]
    cfg = config.load(run_dir / "config.yaml")
    for r in routed:
        # Both MoE blocks (blocks 1 and 3), each expert's share of what its block routed.
        assert sorted(r["expert_load"]) == ["blocks.1.mlp", "blocks.3.mlp"]
        assert all(
            sum(load) == pytest.approx(1.0, abs=1e-3) and len(load) == cfg.model.moe.num_experts
            for load in r["expert_load"].values()
        )
        assert 0 <= r["dropped_fraction"] < 1 and r["tokens_dropped"] >= 0
    assert "done: 4 steps" in proc.stdout
    # The end-of-run sample decodes through the MoE blocks (eval mode: nothing counted).
    assert (run_dir / "sample.txt").read_text().startswith(cfg.train.sample_prompt)
