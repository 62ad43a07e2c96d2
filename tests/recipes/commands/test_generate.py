"""`mpmd generate` (recipes/commands/generate.py, recipes/run/generate.py) on a run of `mpmd train` on two
real worker processes: its greedy text is the end-of-run sample (which decodes from the
parameters fetched from the workers, `mpmd generate` from the Orbax checkpoint), the restored
model's eval loss is the workers' own, --step restores an older checkpoint, and a bad run
directory, step or model kind is one line on stderr with exit status 2."""

import numpy as np
import pytest

from mpmd import models
from mpmd.recipes import config
from mpmd.recipes.data import loaders as data
from mpmd.recipes.run import generate
from mpmd.recipes.run import run_log
from mpmd.recipes.config import ConfigError
from tests.support.processes import TINY_GPT, mpmd_command, mpmd_train

pytestmark = pytest.mark.slow  # `mpmd train` with local workers, `mpmd generate` as commands
STEPS, NEW = 4, 40
PROMPT = "def __init__(self"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    proc = mpmd_train(
        "configs/gpt_tiny.yaml",
        f"train.steps={STEPS}",
        f"train.eval_every={STEPS}",
        "checkpoint.every=2",
        "checkpoint.keep=3",
        f"train.sample_tokens={NEW}",
        "train.sample_temperature=0",
        f"run_dir={run_dir}",
        *TINY_GPT,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_greedy_generate_prints_the_end_of_run_sample_and_tokens_per_s(run_dir):
    proc = mpmd_command("generate", run_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--temperature", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sample = (run_dir / "sample.txt").read_text()
    assert sample.startswith(PROMPT) and len(sample.encode()) > len(PROMPT)
    assert proc.stdout == sample + "\n"
    assert (
        f"step {STEPS} of {run_dir}: {NEW} new tokens in" in proc.stderr and "tokens/s, key-value cache" in proc.stderr
    )
    # The full re-run per token draws the same tokens.
    slow = mpmd_command(
        "generate", run_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--temperature", "0", "--no-cache"
    )
    assert slow.returncode == 0 and slow.stdout == proc.stdout and "no cache" in slow.stderr


def test_the_restored_model_has_the_workers_eval_loss_sampling_is_seeded_and_step_picks_the_checkpoint(run_dir):
    cfg, step, model = generate.load_run(str(run_dir))
    _, eval_loader = data.make_loaders(cfg)
    model.eval()
    losses = [float(models.lm_loss(model(x), y)) for x, y in map(eval_loader.batch_at, range(cfg.train.eval_batches))]
    want = [r["eval_loss"] for r in run_log.read(run_dir) if r["step"] == STEPS][0]
    assert step == STEPS and np.mean(losses) == pytest.approx(want, rel=1e-5)
    # Sampling is seeded: the same seed draws the same text, another seed another.
    draw = lambda seed: generate.continue_text(model, generate.tokenizer_of(str(run_dir)), PROMPT, NEW, 1.0, 20, seed)
    assert draw(3) == draw(3) != draw(4) and draw(3)[1] == NEW
    _, older_step, older = generate.load_run(str(run_dir), 2)
    assert older_step == 2
    assert not np.array_equal(np.asarray(older.head.lm_head.kernel[...]), np.asarray(model.head.lm_head.kernel[...]))


def test_bad_run_dirs_steps_and_models_exit_2_with_one_line(run_dir, tmp_path):
    def error(*args) -> str:
        proc = mpmd_command("generate", *args, "--prompt", "x")
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        return lines[0]

    assert error(tmp_path / "nowhere") == f"error: run directory {str(tmp_path / 'nowhere')!r} does not exist"
    assert error(run_dir, "--step", 3) == (
        f"error: step 3 is not a committed checkpoint of {str(run_dir)!r}; committed: 2, 4"
    )
    # The command prints any of these as it prints the two above.
    with pytest.raises(ConfigError, match="no config.yaml: not a run directory"):
        generate.load_run(str(tmp_path))
    mlp = tmp_path / "mlp"
    config.dump(
        config.load(None, ["model.kind=mlp", "data.source=synthetic", "train.sample_tokens=0"]), mlp / "config.yaml"
    )
    with pytest.raises(
        ConfigError,
        match=r"model.kind='mlp' cannot generate: only a language model can "
        r"\(model.kind='gpt'.*'llama'",
    ):
        generate.load_run(str(mlp))
    empty = tmp_path / "empty"
    config.dump(config.load(None, []), empty / "config.yaml")
    with pytest.raises(ConfigError, match="has no committed checkpoint .*: train it first"):
        generate.load_run(str(empty))
    # hf:DIR is a Hugging Face directory (tests/recipes/run/test_generate.py): here one without config.json.
    with pytest.raises(ConfigError, match="config.json not found"):
        generate.load_run("hf:" + str(tmp_path))


def test_a_tied_llama_with_dropout_generates_its_end_of_run_sample(tmp_path):
    """The embedding both end stages hold is one parameter of the restored model (its path in
    the checkpoint and in Trainer.params() alike), and dropout is off when decoding."""
    run_dir = tmp_path / "tied"
    proc = mpmd_train(
        "configs/llama_tiny.yaml",
        "model.tie_embeddings=true",
        "model.dropout=0.1",
        "train.steps=2",
        "train.eval_every=0",
        f"train.sample_tokens={NEW}",
        "train.sample_temperature=0",
        f"run_dir={run_dir}",
        *TINY_GPT,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg, _, model = generate.load_run(str(run_dir))
    assert model.head.table is model.embed.token.embedding
    # Bytes: a random model's text holds carriage returns, which read_text would translate.
    assert (
        generate.continue_text(model, generate.tokenizer_of(str(run_dir)), PROMPT, NEW, 0.0)[0].encode()
        == (run_dir / "sample.txt").read_bytes()
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "inf"], "argument --temperature: must be a finite number >= 0, got 'inf'"),
        (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got 'nan'"),
        (["--temperature", "-0.5"], "argument --temperature: must be a finite number >= 0, got '-0.5'"),
        (["--seed", "-5"], "argument --seed: must be a whole number >= 0, got '-5'"),
        (["--top-k", "2.5"], "argument --top-k: must be a whole number >= 0, got '2.5'"),
        (["--max-new-tokens", "-1"], "argument --max-new-tokens: must be a whole number >= 0, got '-1'"),
    ],
)
def test_numeric_arguments_are_range_checked_when_parsed(args, message, capsys):
    from mpmd.recipes.commands import generate as generate_cli

    with pytest.raises(SystemExit) as exit_:
        generate_cli.parser().parse_args(["runs/x", "--prompt", "x", *args])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"mpmd generate: error: {message}"
