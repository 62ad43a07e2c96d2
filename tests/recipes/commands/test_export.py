"""`mpmd export RUN_DIR --hf OUT_DIR [--step N]` (recipes/commands/export.py) on a run trained from a
Hugging Face Llama (model.init_from) on real worker processes: the first loss is transformers'
loss of the imported model, the export loads in transformers with mpmd's logits and reads back
bitwise; bad input is one error line and overwrites nothing."""

import numpy as np
import pytest

from mpmd.recipes import config
from mpmd.recipes.families import hf
from mpmd.recipes.commands.export import main
from tests.recipes.families.test_hf import llama_config, unpipelined
from tests.support import hf_llama

pytestmark = pytest.mark.slow  # the run starts worker processes (cluster.backend=local)

STEPS = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run config, summary, transformers' model it started from): STEPS steps from the
    imported GQA model, 2 slices, every step committed."""
    from mpmd.recipes.run import train

    hf_dir = tmp_path_factory.mktemp("hf")
    reference = hf_llama.make("gqa", hf_dir)
    run_dir = tmp_path_factory.mktemp("run")
    cfg = llama_config(
        hf_dir,
        "pipeline.num_stages=2",
        "pipeline.num_microbatches=2",
        "train.batch_size=4",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "log.trace_steps=[]",
        "log.tensorboard=false",
        "checkpoint.every=1",
        f"checkpoint.keep={STEPS}",
        "cluster.backend=local",
        "data.max_bytes=200000",
        f"run_dir={run_dir}",
    )
    return cfg, train.run(cfg), reference


def test_training_starts_from_the_imported_weights(trained):
    import torch
    from mpmd.recipes.data import loaders as data

    cfg, summary, reference = trained
    assert summary["steps"] == STEPS and np.isfinite(summary["last_loss"])
    inputs, targets = data.make_loaders(cfg)[0].batch_at(0)
    logits = torch.as_tensor(hf_llama.logits(reference, inputs))
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.as_tensor(targets, dtype=torch.long).reshape(-1)
    ).item()
    assert abs(summary["first_loss"] - want) / want < 1e-4


@pytest.mark.parametrize("step", [None, 1])
def test_export_loads_in_transformers_and_reads_back_bitwise(trained, tmp_path, capsys, step):
    from mpmd.train.checkpoint_reader import read_leaves

    cfg, _, _ = trained
    out = tmp_path / "exported"
    assert main([cfg.run_dir, "--hf", str(out), *(["--step", str(step)] if step else [])]) == 0
    assert f"wrote {out / hf.CONFIG}" in capsys.readouterr().out
    _, leaves = read_leaves(cfg.run_dir, step or STEPS, prefix="params/")
    trained_params = {name[len("params/") :]: a for name, a in leaves.items()}
    keys, again = hf.load(out)
    assert sorted(again) == sorted(trained_params)
    assert all(again[p].tobytes() == trained_params[p].tobytes() for p in again), "export -> import is bitwise"
    tokens = hf_llama.tokens()
    mpmd_logits = np.asarray(unpipelined(cfg, trained_params)(tokens))
    assert hf_llama.relative_error(hf_llama.load_logits(out, tokens), mpmd_logits) < 1e-4
    if step == 1:  # another step, other weights
        _, last = read_leaves(cfg.run_dir, STEPS, prefix="params/")
        assert any(not np.array_equal(last[f"params/{p}"], again[p]) for p in again)


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_error_line_and_overwrites_nothing(trained, tmp_path, capsys):
    cfg, _, _ = trained
    out = str(tmp_path / "out")
    assert "is not a run directory" in _refused(capsys, [str(tmp_path / "nowhere"), "--hf", out])
    assert f"step 7 is not a committed checkpoint of {str(cfg.run_dir)!r}; committed: 1, 2" in _refused(
        capsys, [cfg.run_dir, "--hf", out, "--step", "7"]
    )
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    assert "exists and is not an empty directory" in _refused(capsys, [cfg.run_dir, "--hf", str(full)])
    assert [p.name for p in full.iterdir()] == ["notes.txt"] and (full / "notes.txt").read_text() == "mine"
    gpt_run = tmp_path / "gpt_run"
    config.dump(config.load(None, []), gpt_run / "config.yaml")
    assert (
        "trained model.kind='gpt'; mpmd export --hf writes model.kind 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma3'"
        in _refused(capsys, [str(gpt_run), "--hf", out])
    )
    fresh = tmp_path / "fresh_run"
    config.dump(cfg, fresh / "config.yaml")
    assert "has no committed checkpoint" in _refused(capsys, [str(fresh), "--hf", out])
    assert not (tmp_path / "out").exists(), "nothing written on refusal"
