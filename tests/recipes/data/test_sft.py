"""recipes/data/sft.py: data.source=jsonl. Prompt/response lines and chat messages read as segments,
the loss mask covers exactly the response tokens and their end marker, packed rows hold whole
examples, bad lines are refused naming the file, line and field; and the recipe's fine-tuning
step (in-process runtime, 2 stages, 4 microbatches, SGD with momentum) equals unpipelined JAX
descending on the token-weighted mean over the step's response tokens, and a run started from
its checkpoint (model.init_from=run:) starts from its parameters."""

import json

import numpy as np
import pytest

from mpmd.recipes import config
from mpmd.recipes.data import sft
from mpmd.recipes.commands import sft_data as sft_data_cli
from mpmd.recipes.data import tokenizer
from mpmd.recipes.config import ConfigError

BYTES = tokenizer.load("bytes")


def write(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_prompt_response_and_chat_lines_become_trained_and_context_segments(tmp_path):
    path = write(
        tmp_path / "a.jsonl",
        [
            {"prompt": "2+2=", "response": "4"},
            "",
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "bye"},
                    {"role": "assistant", "content": "ciao"},
                ]
            },
        ],
    )
    first, chat = sft.read(path)
    assert first.segments == (("2+2=", False), ("4", True)) and first.where == f"{path}:1"
    assert first.response == "4"
    assert chat.where == f"{path}:3"  # the blank line is skipped, still counted
    assert chat.segments == (
        ("system: be brief\n", False),
        ("user: hi\n", False),
        ("assistant: ", False),
        ("hello", True),
        ("user: bye\n", False),
        ("assistant: ", False),
        ("ciao", True),
    )
    assert chat.response == "ciao"
    # Each trained segment ends with the end marker (bytes: a newline), so turns stay apart.
    ids, trained = sft.encode(chat, BYTES)
    assert BYTES.decode(ids) == "system: be brief\nuser: hi\nassistant: hello\nuser: bye\nassistant: ciao\n"
    assert BYTES.decode(ids[trained]) == "hello\nciao\n"


def test_the_loss_mask_is_one_exactly_where_the_target_is_a_response_token(tmp_path):
    examples = sft.read(
        write(tmp_path / "a.jsonl", [{"prompt": "ab", "response": "cd"}, {"prompt": "xyz", "response": "w"}])
    )
    rows = sft.Rows.of(examples, BYTES, seq_len=8).arrays
    text = lambda row: bytes(row.tolist()).rstrip(b"\0").decode()
    assert [text(r) for r in rows["inputs"]] == ["abcd", "xyzw"]
    assert [text(r) for r in rows["targets"]] == ["bcd\n", "yzw\n"]  # the end marker: a newline for bytes
    np.testing.assert_array_equal(rows["loss_mask"], [[0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0]])
    assert sorted(rows) == ["inputs", "loss_mask", "targets"]
    # A tokenizer with an end-of-text token ends each response with it instead.
    tok = tokenizer.load(
        str(tokenizer.train_bpe([write(tmp_path / "t.txt", ["ab cd xyz w"] * 20)], 300, tmp_path / "tok"))
    )
    ids, trained = sft.encode(examples[0], tok)
    assert ids[-1] == tok.eos_id and trained[-1] and tok.decode(ids[trained][:-1]) == "cd"


def test_packed_rows_hold_whole_examples_with_their_segments_and_positions(tmp_path):
    train, _ = sft_data_cli.make("reverse", 40, 1, seed=3)
    examples = sft.read(write(tmp_path / "a.jsonl", train))
    plain = sft.Rows.of(examples, BYTES, seq_len=48).arrays
    packed = sft.Rows.of(examples, BYTES, seq_len=48, pack=True, seed=5).arrays
    assert len(packed["inputs"]) < len(plain["inputs"]) // 2
    assert packed["loss_mask"].sum() == plain["loss_mask"].sum()
    found = []
    for r in range(len(packed["inputs"])):
        for s in range(1, packed["segment_ids"][r].max() + 1):
            at = packed["segment_ids"][r] == s
            np.testing.assert_array_equal(packed["positions"][r][at], np.arange(at.sum()))
            found.append(bytes(packed["inputs"][r][at].tolist()) + bytes(packed["targets"][r][at][-1:].tolist()))
    want = [bytes(f"{e['prompt']}{e['response']}\n", "utf-8") for e in train]
    assert sorted(found) == sorted(want)
    assert (packed["loss_mask"][packed["segment_ids"] == 0] == 0).all()


@pytest.mark.parametrize(
    "line, field",
    [
        ("{not json", "not JSON"),
        ({"prompt": "a"}, "no 'response' field"),
        ({"prompt": "a", "response": 3}, "response must be a string, got int"),
        ({"prompt": "a", "response": "  "}, "response is empty"),
        ({"prompt": "", "response": "b"}, "prompt is empty"),
        (["a", "b"], "must be a JSON object"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no 'assistant' message"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role must be one of 'system', 'user' or"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content must be a string"),
    ],
)
def test_a_bad_line_is_refused_naming_the_file_line_and_field(tmp_path, line, field):
    path = write(tmp_path / "bad.jsonl", [{"prompt": "ok", "response": "fine"}, line])
    with pytest.raises(ConfigError) as e:
        sft.read(path)
    assert f"{path}:2: " in str(e.value) and field in str(e.value), str(e.value)


def test_missing_files_long_examples_and_misplaced_keys_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist .*mpmd sft-data"):
        sft.read(tmp_path / "none.jsonl")
    path = write(tmp_path / "a.jsonl", [{"prompt": "ok", "response": "fine"}, {"prompt": "x" * 30, "response": "y"}])
    with pytest.raises(ConfigError, match=f"{path}:2: the example is 32 tokens .* model.seq_len \\+ 1 = 17"):
        sft.Rows.of(sft.read(path), BYTES, seq_len=16)
    with pytest.raises(ConfigError, match="train.exact_match=5 .* needs data.source='jsonl'"):
        config.load("configs/gpt_tiny.yaml", ["train.exact_match=5"])
    with pytest.raises(ConfigError, match="data.eval_path is only used by data.source='jsonl', got source 'stdlib'"):
        config.load("configs/gpt_tiny.yaml", [f"data.eval_path={path}"])
    with pytest.raises(ConfigError, match="data.path .*mpmd sft-data.* must be given when data.source='jsonl'"):
        config.load("configs/gpt_tiny.yaml", ["data.source=jsonl"])


def test_generated_held_out_prompts_are_none_of_the_training_ones():
    for task in sft_data_cli.TASKS:
        train, held = sft_data_cli.make(task, 300, 50, seed=1)
        assert len(train) == 300 and len(held) == 50
        assert not {e["prompt"] for e in train} & {e["prompt"] for e in held}
        assert sft_data_cli.make(task, 300, 50, seed=1) == (train, held)
    assert sft_data_cli.make("add", 1, 1)[0][0]["response"] == str(
        sum(map(int, sft_data_cli.make("add", 1, 1)[0][0]["prompt"][:-1].split("+")))
    )


STEPS = 3
SFT_STEPS = 200


@pytest.mark.parametrize("pack", [False, True])
def test_the_fine_tuning_step_is_the_token_weighted_mean_over_response_tokens(tmp_path, pack):
    """Examples of very different response lengths, so the 4 microbatches hold different numbers
    of response tokens: a mean of per-microbatch means would be another objective. Packed rows
    are the model's forward with their segment_ids and positions."""
    import jax
    import optax
    from flax import nnx

    from mpmd import models
    from mpmd.recipes import registry
    from mpmd.recipes.data import loaders as data
    from mpmd.recipes.run import generate
    from mpmd.recipes.run import run_log
    from mpmd.recipes.run import train
    from tests.support.reference import assert_leaves_close, descend

    rng = np.random.default_rng(0)
    lines = [{"prompt": f"q{i}:", "response": "r" * int(rng.choice([1, 1, 2, 12]))} for i in range(64)]
    path = write(tmp_path / "train.jsonl", lines)
    overrides = [
        f"data.path={path}",
        "data.eval_path=null",
        "data.eval_fraction=0.25",
        "model.seq_len=20",
        "model.d_model=32",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.num_layers=2",
        "train.batch_size=8",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "train.exact_match=0",
        "train.sample_tokens=0",
        "optimizer.name=sgd",
        "optimizer.lr=0.5",
        "optimizer.b1=0.9",
        "optimizer.weight_decay=0",
        "optimizer.warmup_steps=0",
        "optimizer.max_grad_norm=null",
        "pipeline.num_stages=2",
        "pipeline.num_microbatches=4",
        "cluster.backend=inprocess",
        "log.trace_steps=[]",
        "log.tensorboard=false",
        "log.progress=lines",
        f"data.pack={str(pack).lower()}",
    ]
    cfg = config.load("configs/llama_sft.yaml", [*overrides, f"run_dir={tmp_path / 'run'}"])
    loader = data.make_loaders(cfg)[0]
    batches = [loader.batch_at(i) for i in range(STEPS)]
    per_micro = batches[0]["loss_mask"].reshape(4, -1).sum(axis=1)
    assert len(set(per_micro.tolist())) > 1, per_micro
    summary = train.run(cfg)
    assert summary["steps"] == STEPS

    model = registry.get_model_spec("llama").build(cfg, False)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def objective(params, batch):
        packed = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
        loss_sum, weight = models.masked_lm_loss(nnx.merge(graph, params, rest)(batch["inputs"], **packed), batch)
        return loss_sum / weight

    losses, _, final = descend(objective, params, [(b,) for b in batches], optax.sgd(0.5, momentum=0.9))
    np.testing.assert_allclose([r["loss"] for r in run_log.read(cfg.run_dir)], losses, rtol=1e-5)
    _, _, trained = generate.load_run(cfg.run_dir)
    got = [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(trained, nnx.Param))]
    assert_leaves_close(got, final, rtol=1e-5)
    if pack:
        assert "segment_ids" in batches[0] and batches[0]["segment_ids"].max() > 1
        return

    # model.init_from=run:DIR starts from that run's newest checkpoint: its first loss is the
    # objective at the parameters the run above ended with.
    again = config.load(
        "configs/llama_sft.yaml",
        [*overrides, f"run_dir={tmp_path / 'again'}", "train.steps=1", f"model.init_from=run:{cfg.run_dir}"],
    )
    first = train.run(again)["first_loss"]
    ended = jax.tree.unflatten(jax.tree.structure(params), [np.asarray(a) for a in final])
    np.testing.assert_allclose(first, float(objective(ended, batches[0])), rtol=1e-5)
    with pytest.raises(
        ConfigError, match="model.d_model=48 disagrees with model.init_from='run:.*config.yaml gives model.d_model=32"
    ):
        config.load("configs/llama_sft.yaml", [*overrides, "model.d_model=48", f"model.init_from=run:{cfg.run_dir}"])
    with pytest.raises(ConfigError, match="config.yaml not found; 'run:<directory>' names a run directory"):
        config.load("configs/llama_sft.yaml", [*overrides, f"model.init_from=run:{tmp_path / 'none'}"])


@pytest.mark.slow
def test_llama_sft_raises_held_out_exact_match_and_a_pretrained_start_keeps_it(tmp_path):
    """`mpmd sft-data` then `mpmd train configs/llama_sft.yaml` (fewer steps) on 2 worker
    processes: exact match on held-out prompts rises from 0, and a run started from its export
    (model.init_from=hf:) scores before its first step what the first run scored at its end."""
    from mpmd.recipes.run import run_log
    from tests.support.processes import mpmd_command, mpmd_train

    made = mpmd_command("sft-data", "-o", tmp_path / "data", "--heldout", "50")
    assert made.returncode == 0 and "wrote 4000 examples" in made.stdout, made.stderr[-2000:]
    common = [
        f"data.path={tmp_path / 'data' / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'data' / 'heldout.jsonl'}",
        "train.exact_match=50",
        "log.trace_steps=[]",
        "log.tensorboard=false",
        "checkpoint.every=0",
        "log.progress=lines",
    ]
    first = mpmd_train(
        "configs/llama_sft.yaml",
        *common,
        f"run_dir={tmp_path / 'sft'}",
        f"train.steps={SFT_STEPS}",
        f"train.eval_every={SFT_STEPS}",
        "optimizer.warmup_steps=0",
        "pipeline.num_microbatches=2",
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    records = run_log.read(tmp_path / "sft")
    before, after = records[0]["exact_match_before"], records[-1]["exact_match"]
    assert before == 0 and after >= 0.05, (before, after)
    assert f"exact match {before:.3f} -> {after:.3f}" in first.stdout
    assert mpmd_command("export", tmp_path / "sft", "--hf", tmp_path / "hf").returncode == 0
    again = mpmd_train(
        "configs/llama_sft.yaml",
        *common,
        f"run_dir={tmp_path / 'again'}",
        "train.steps=1",
        f"model.init_from=hf:{tmp_path / 'hf'}",
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert run_log.read(tmp_path / "again")[0]["exact_match_before"] == after
