"""The Hugging Face families beside Llama 2 (mpmd/recipes/families/hf.py FAMILIES): Llama 3.1's
scaled rotary frequencies, Mistral, Qwen 2.5, Qwen 3 and Gemma 3 (text), each a tiny random model made here by
transformers (tests/support/hf_llama.py FAMILY_CASES; nothing downloaded). Held to
transformers: the logits, greedy decoding with the key-value cache, the export read back by
from_pretrained; held to unpipelined JAX: a 2-stage pipelined fine-tuning step."""

import json

import jax
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import mpmd
from mpmd.recipes import config, registry
from mpmd.recipes.families import hf
from mpmd.recipes.commands.generate import main as generate_main
from mpmd.stages.leaf_paths import path_string
from tests.support import hf_llama, reference

CASES = list(hf_llama.FAMILY_CASES)
KIND = {"llama31": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """case -> (its directory, transformers' float32 model)."""
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case)
        out[case] = d, hf_llama.make(case, d)
    return out


def family_config(case, hf_dir, *overrides):
    return config.load(
        None,
        [f"model.kind={KIND[case]}", f"model.init_from=hf:{hf_dir}", f"model.seq_len={hf_llama.SEQ_LEN}", *overrides],
    )


def built(cfg, params: dict) -> nnx.Module:
    """The recipe's model of `cfg` (unpipelined NNX) holding `params` by model path."""
    model = registry.get_model_spec(cfg.model.kind).build(cfg, False)
    flat, tree = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    assert sorted(path_string(kp) for kp, _ in flat) == sorted(params), "every parameter, once"
    nnx.update(model, jax.tree.unflatten(tree, [params[path_string(kp)] for kp, _ in flat]))
    return model


@pytest.mark.parametrize("case", CASES)
def test_config_json_gives_the_family_and_its_switches(families, case):
    hf_dir, _ = families[case]
    m = family_config(case, hf_dir).model
    assert m.kind == KIND[case] and hf.family_of(hf_dir).kind == KIND[case]
    switches = {
        "llama31": dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=0.1, rope_original_max_positions=16),
        "mistral": dict(head_dim=16, sliding_window=6),
        "qwen2": dict(qkv_bias=True, tie_embeddings=True),
        "qwen3": dict(qk_norm=True, head_dim=16),
        "gemma3": dict(global_every=2, query_scale=12.0, sliding_window=6, rope_local_theta=1e4, rope_factor=2.0),
    }[case]
    assert {k: getattr(m, k) for k in switches} == switches


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(families, case):
    hf_dir, reference = families[case]
    _, params = hf.load(hf_dir)
    tokens = hf_llama.tokens()
    got = np.asarray(built(family_config(case, hf_dir), params)(tokens))
    assert hf_llama.relative_error(got, hf_llama.logits(reference, tokens)) < 1e-4


@pytest.mark.parametrize("case", CASES)
def test_export_is_the_family_format_bitwise_and_transformers_reads_it(families, case, tmp_path, capsys):
    hf_dir, reference = families[case]
    keys, params = hf.load(hf_dir)
    out = hf.save(tmp_path / "out", {**keys, "kind": KIND[case]}, params)
    written = json.loads((out / hf.CONFIG).read_text())
    family = hf.FAMILIES[KIND[case]]
    assert written["model_type"] == family.model_type and written["architectures"] == [family.architecture]
    again_keys, again = hf.load(out)
    assert again_keys == keys and sorted(again) == sorted(params)
    assert all(again[p].tobytes() == params[p].tobytes() for p in params), "import -> export -> import is bitwise"
    tokens = hf_llama.tokens()
    assert hf_llama.relative_error(hf_llama.load_logits(out, tokens), hf_llama.logits(reference, tokens)) < 1e-5
    # transformers' greedy continuation of the export is mpmd's of it.
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype="float32").eval()
    exported.generation_config.eos_token_id = None
    prompt = "def f(x"
    want = exported.generate(torch.tensor([list(prompt.encode())]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    args = [f"hf:{out}", "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0"]
    capsys.readouterr()
    assert generate_main(args) == 0
    assert capsys.readouterr().out == bytes(want[0].tolist()).decode("utf-8", errors="replace") + "\n"


@pytest.mark.parametrize("case", CASES)
def test_greedy_generate_draws_transformers_tokens(families, case, capsys):
    """27 positions: past Mistral's and Gemma's window of 6, so the cache's window is exercised."""
    hf_dir, reference = families[case]
    prompt, new = "def f(x", 20
    reference.generation_config.eos_token_id = None
    want = reference.generate(
        torch.tensor([list(prompt.encode())]), max_new_tokens=new, do_sample=False, pad_token_id=0
    )[0].tolist()
    args = [f"hf:{hf_dir}", "--prompt", prompt, "--max-new-tokens", str(new), "--temperature", "0"]
    assert generate_main(args) == 0
    assert capsys.readouterr().out == bytes(want).decode("utf-8", errors="replace") + "\n"


@pytest.mark.parametrize("case", CASES)
def test_a_pipelined_fine_tuning_step_equals_the_unpipelined_one(families, case):
    """2 stages (1F1B, m=2) from the directory's weights, two SGD-with-momentum steps: losses
    and every updated parameter as jax.grad of the whole model gives them."""
    from mpmd.recipes.run import build

    hf_dir, _ = families[case]
    cfg = family_config(case, hf_dir, "pipeline.num_stages=2")
    keys, params = hf.load(hf_dir)
    sgd = optax.sgd(0.05, momentum=0.9)
    rng = np.random.default_rng(3)
    data = [rng.integers(0, hf_llama.VOCAB, (4, hf_llama.SEQ_LEN + 1), dtype=np.int32) for _ in range(2)]
    batches = [(d[:, :-1], d[:, 1:]) for d in data]

    stages, loss_fn = build.build_model(cfg, batches[0][0][:2], abstract=True)
    pipe = mpmd.Pipeline(stages, loss_fn, sample_input=batches[0][0][:2])
    init = registry.get_model_spec(cfg.model.kind).init_params(cfg)
    with mpmd.Trainer(pipe, sgd, schedule="1f1b", num_microbatches=2, init_params=init) as trainer:
        losses = [trainer.step(x, y)["loss"] for x, y in batches]
        got = {
            path: np.asarray(leaf)
            for paths, state in zip(pipe.param_paths, trainer.params())
            for path, leaf in zip(paths, jax.tree.leaves(state))
        }

    model = built(cfg, params)
    graph, state, rest = nnx.split(model, nnx.Param, ...)
    objective = lambda p, x, y: mpmd.models.lm_loss(nnx.merge(graph, p, rest)(x), y)
    opt_state = sgd.init(state)
    want_losses = []
    for x, y in batches:
        loss, grads = jax.value_and_grad(objective)(state, x, y)
        updates, opt_state = sgd.update(grads, opt_state, state)
        state = optax.apply_updates(state, updates)
        want_losses.append(float(loss))
    want = {path_string(kp): np.asarray(v) for kp, v in jax.tree_util.tree_flatten_with_path(state)[0]}
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert set(got) == set(want)
    paths = sorted(want)  # each within 1e-5 of its leaf's largest magnitude (reference.assert_leaves_close)
    reference.assert_leaves_close([got[p] for p in paths], [want[p] for p in paths], 1e-5)


def test_a_directory_of_another_family_names_the_kind_to_use(families):
    hf_dir, _ = families["qwen2"]
    with pytest.raises(config.ConfigError, match=r"is a Qwen2ForCausalLM \(model_type 'qwen2'\): set model.kind=qwen2"):
        config.load(None, ["model.kind=llama", f"model.init_from=hf:{hf_dir}", "model.seq_len=16"])


@pytest.mark.parametrize(
    "change, says",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope type 'linear' without a 'factor'"),
        ({"use_sliding_window": True}, "use_sliding_window=True; models/llama.py computes only"),
        ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "mpmd imports model_type 'llama'"),
        ({"head_dim": 7}, "head_dim=7 must be an even integer"),
    ],
)
def test_what_the_decoder_cannot_compute_is_refused_by_name(families, tmp_path, change, says):
    import shutil

    hf_dir, _ = families["qwen2"]
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    c = json.loads((broken / hf.CONFIG).read_text())
    c.update(change)
    (broken / hf.CONFIG).write_text(json.dumps(c))
    with pytest.raises(hf.HFError, match=says):
        hf.load(broken)


def test_a_recipe_files_sizes_yield_to_init_from_and_a_typed_one_must_agree(families, capsys):
    """configs/qwen2_tiny.yaml sets d_model 96 for random init; started from a 32-wide Qwen 2.5,
    config.json's sizes win and one line says which; typed on the command line, 96 is refused."""
    hf_dir, _ = families["qwen2"]
    cfg = config.load("configs/qwen2_tiny.yaml", [f"model.init_from=hf:{hf_dir}", "model.seq_len=16"])
    assert (cfg.model.d_model, cfg.model.num_heads, cfg.model.rope_theta) == (32, 4, 1_000_000.0)
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "gives model.d_model, model.num_heads, model.num_kv_heads" in said
    assert "configs/qwen2_tiny.yaml's values for them are not used" in said
    with pytest.raises(config.ConfigError, match=r"model.d_model=96 disagrees with model.init_from"):
        config.load("configs/qwen2_tiny.yaml", [f"model.init_from=hf:{hf_dir}", "model.seq_len=16", "model.d_model=96"])


def test_an_export_above_the_shard_size_is_sharded_as_save_pretrained_does(families, tmp_path):
    """20 KB shards: several files and an index; transformers loads it, hf.load reads it back
    bitwise; `mpmd export --max-shard-size` takes the same sizes transformers does."""
    from mpmd.recipes.commands.export import byte_size

    hf_dir, reference = families["qwen3"]
    keys, params = hf.load(hf_dir)
    out = hf.save(tmp_path / "out", keys, params, max_shard_bytes=byte_size("20KB"))
    index = json.loads((out / hf.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / hf.WEIGHTS).exists()
    shared = [f for f in files if list(index["weight_map"].values()).count(f) > 1]
    assert shared and all((out / f).stat().st_size <= 20_000 + 4096 for f in shared)  # + its header
    again_keys, again = hf.load(out)
    assert again_keys == keys and all(again[p].tobytes() == params[p].tobytes() for p in params)
    tokens = hf_llama.tokens()
    assert hf_llama.relative_error(hf_llama.load_logits(out, tokens), hf_llama.logits(reference, tokens)) < 1e-5
    with pytest.raises(Exception, match="is not a size"):
        byte_size("5XB")


def test_generate_starts_the_prompt_as_the_models_tokenizer_does(tmp_path, capsys):
    """A Llama 3.1 whose tokenizer.json puts <|begin_of_text|> first (its post-processor):
    `mpmd generate hf:DIR` feeds the prompt with it, as transformers' tokenizer does, draws
    transformers' greedy tokens, and prints the text without it."""
    import sysconfig

    import tokenizers
    from transformers import AutoTokenizer

    from mpmd.recipes.commands import tokenizer as tokenizer_cli

    stdlib = sysconfig.get_paths()["stdlib"]
    assert tokenizer_cli.main(["train", f"{stdlib}/textwrap.py", "--vocab-size", "300", "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens(["<|begin_of_text|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    hf_dir = tmp_path / "model"
    reference = hf_llama.make("llama31", hf_dir, vocab=320)
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    prompt, new = "def wrap(text", 12
    ids = theirs(prompt)["input_ids"]
    assert ids[0] == bos
    reference.generation_config.eos_token_id = None
    # mpmd draws among the tokenizer's ids only; the model's rows past them are padding.
    beyond = list(range(len(theirs), 320))
    want = reference.generate(
        torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0, suppress_tokens=beyond
    )[0].tolist()
    args = [f"hf:{hf_dir}", "--prompt", prompt, "--max-new-tokens", str(new), "--temperature", "0"]
    assert generate_main(args) == 0
    assert capsys.readouterr().out == theirs.decode(want[1:], skip_special_tokens=False) + "\n"


@pytest.mark.slow  # five whole `mpmd train` runs (in-process), ~10 s each
@pytest.mark.parametrize("case", CASES)
def test_each_familys_fine_tuning_recipe_starts_from_its_checkpoint(families, case, tmp_path, capsys):
    """configs/<kind>_finetune.yaml with model.init_from=hf:DIR: config.json sets the sizes (the
    recipe's seq_len stays), and its first step's loss is the objective at the imported
    weights: the run's first loss equals the unpipelined model's on the same batch."""
    from mpmd.recipes.data import loaders as data
    from mpmd.recipes.run import run_log, train

    hf_dir, _ = families[case]
    lines = [{"prompt": f"rev {w}:", "response": w[::-1]} for w in ("abc", "kqz", "mpd", "fla")]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = config.load(
        f"configs/{KIND[case]}_finetune.yaml",
        [
            f"model.init_from=hf:{hf_dir}",
            f"data.path={tmp_path / 'train.jsonl'}",
            "data.eval_path=null",
            "data.eval_fraction=0.5",
            f"model.seq_len={hf_llama.SEQ_LEN}",
            "train.steps=1",
            "train.batch_size=2",
            "train.exact_match=0",
            "train.eval_every=0",
            "pipeline.num_microbatches=2",
            "cluster.backend=inprocess",
            "log.trace_steps=[]",
            "log.tensorboard=false",
            "checkpoint.every=0",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    assert (cfg.model.kind, cfg.model.d_model) == (KIND[case], 32)
    batch = data.make_loaders(cfg)[0].batch_at(0)
    train.run(cfg)
    _, params = hf.load(hf_dir)
    logits = built(cfg, params)(batch["inputs"])
    loss_sum, weight = mpmd.models.masked_lm_loss(logits, batch)
    assert run_log.read(cfg.run_dir)[0]["loss"] == pytest.approx(float(loss_sum / weight), rel=1e-5)
