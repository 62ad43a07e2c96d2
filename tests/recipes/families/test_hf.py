"""mpmd.recipes.families.hf and model.init_from: Hugging Face Llamas made here with transformers (tests/support/
hf_llama.py: GQA with a non-default RoPE theta, tied embeddings, a sharded bfloat16 checkpoint)
read into mpmd, held to transformers' own logits; unpipelined here, pipelined on real worker
processes in the slow tests (tests/recipes/commands/test_export.py holds the way out)."""

import json
import re
import os
import time

import jax
import numpy as np
import pytest
from flax import nnx

from mpmd.recipes import config, registry
from mpmd.recipes.families import hf
from mpmd.stages.leaf_paths import path_string
from tests.support import hf_llama
from tests.support.processes import sigkill_at_marker


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """case -> (its directory, transformers' float32 model)."""
    out = {}
    for case in hf_llama.CASES:
        d = tmp_path_factory.mktemp(case)
        out[case] = d, hf_llama.make(case, d)
    return out


def llama_config(hf_dir, *overrides):
    return config.load(
        None, ["model.kind=llama", f"model.init_from=hf:{hf_dir}", f"model.seq_len={hf_llama.SEQ_LEN}", *overrides]
    )


def unpipelined(cfg, params: dict) -> nnx.Module:
    """The recipe's Llama of `cfg` (unpipelined NNX) holding `params` by model path."""
    model = registry.get_model_spec("llama").build(cfg, False)
    state = nnx.state(model, nnx.Param)
    flat, tree = jax.tree_util.tree_flatten_with_path(state)
    assert sorted(path_string(kp) for kp, _ in flat) == sorted(params), "every parameter, once"
    nnx.update(model, jax.tree.unflatten(tree, [params[path_string(kp)] for kp, _ in flat]))
    return model


def test_config_json_sets_the_model_keys(hf_models):
    cfg = llama_config(hf_models["gqa"][0]).model
    assert (cfg.vocab_size, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers, cfg.mlp_dim) == (
        256,
        32,
        4,
        2,
        3,
        48,
    )
    assert (cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (500_000.0, 1e-6, False)
    assert llama_config(hf_models["tied"][0]).model.tie_embeddings is True
    assert llama_config(hf_models["sharded_bf16"][0], "model.num_kv_heads=1").model.num_kv_heads == 1  # agrees


@pytest.mark.parametrize("case", list(hf_llama.CASES))
def test_unpipelined_logits_equal_transformers(hf_models, case):
    hf_dir, reference = hf_models[case]
    keys, params = hf.load(hf_dir)
    tokens = hf_llama.tokens()
    got = np.asarray(unpipelined(llama_config(hf_dir), params)(tokens))
    assert hf_llama.relative_error(got, hf_llama.logits(reference, tokens)) < 1e-4


def test_bfloat16_shards_read_exactly(hf_models):
    hf_dir, reference = hf_models["sharded_bf16"]
    assert (hf_dir / hf.INDEX).is_file(), "the case is sharded"
    _, params = hf.load(hf_dir)
    want = reference.state_dict()
    np.testing.assert_array_equal(
        params["blocks.1.attn.k.kernel"], want["model.layers.1.self_attn.k_proj.weight"].numpy().T
    )
    np.testing.assert_array_equal(params["head.lm_head.kernel"], want["lm_head.weight"].numpy().T)


def test_weights_not_in_float32_are_said_in_one_line(hf_models, capsys):
    for case, says in (("sharded_bf16", "holds BF16 weights: read as float32"), ("gqa", None)):
        registry.get_model_spec("llama").init_params(llama_config(hf_models[case][0]))
        out = capsys.readouterr().out
        assert (says in out and out.count("\n") == 1) if says else out == ""


def test_save_then_load_is_bitwise(hf_models, tmp_path):
    from safetensors.numpy import load_file

    hf_dir, _ = hf_models["gqa"]
    keys, params = hf.load(hf_dir)
    assert keys["seq_len"] == 2 * hf_llama.SEQ_LEN, "max_position_embeddings"
    section = registry.get_model_spec("llama").section.model_validate({"kind": "llama", **keys})
    assert (section.num_kv_heads, section.rope_theta) == (2, 500_000.0)
    out = hf.save(tmp_path / "out", keys, params)
    again_keys, again = hf.load(out)
    assert again_keys == keys
    for path in params:
        assert again[path].tobytes() == params[path].tobytes(), path
    original, written = load_file(str(hf_dir / hf.WEIGHTS)), load_file(str(out / hf.WEIGHTS))
    assert sorted(written) == sorted(original)
    assert all(written[n].tobytes() == original[n].tobytes() for n in original), "the very tensors"


KILLED_SAVE = """
import sys, time
from pathlib import Path
import safetensors.numpy
from mpmd.recipes.families import hf

save_file = safetensors.numpy.save_file
def save_then_wait(*args, **kwargs):
    save_file(*args, **kwargs)
    Path(sys.argv[3]).write_text("weights written")
    time.sleep(60)  # killed here: before the rename
safetensors.numpy.save_file = save_then_wait
keys, params = hf.load(sys.argv[1])
hf.save(sys.argv[2], keys, params)
"""


def test_an_export_killed_before_its_rename_leaves_no_output_and_the_next_cleans_up(hf_models, tmp_path):
    hf_dir, _ = hf_models["gqa"]
    out, marker = tmp_path / "out", tmp_path / "marker"
    sigkill_at_marker(KILLED_SAVE, [hf_dir, out, marker], marker)
    assert not out.exists()
    (stale,) = tmp_path.glob(".out.partial-*")
    live = tmp_path / f".out.partial-{os.getppid()}"  # a writer still running: left alone
    live.mkdir()
    keys, params = hf.load(hf_dir)
    hf.save(out, keys, params)
    assert not stale.exists() and live.is_dir()
    assert hf.load(out)[0] == keys
    # A symbolic link as the output, dangling or to an empty directory, is refused by name.
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "nowhere", tmp_path / "empty"):
        link = tmp_path / f"link_{target.name}"
        link.symlink_to(target)
        with pytest.raises(hf.HFError, match=rf"{link} is a symbolic link; name a new directory"):
            hf.save(link, keys, params)
    assert not any((tmp_path / "empty").iterdir())


def test_a_key_that_disagrees_with_config_json_is_refused(hf_models):
    hf_dir = hf_models["gqa"][0]
    with pytest.raises(config.ConfigError, match=r"model.d_model=64 disagrees with model.init_from=.*hidden_size=32"):
        llama_config(hf_dir, "model.d_model=64")
    with pytest.raises(config.ConfigError, match=r"model.seq_len=64 exceeds max_position_embeddings=32"):
        llama_config(hf_dir, "model.seq_len=64")


def test_bad_directories_are_refused_by_name(hf_models, tmp_path):
    with pytest.raises(config.ConfigError, match=r"model.init_from must be 'hf:<directory>'.*got 'some/dir'"):
        config.load(None, ["model.kind=llama", "model.init_from=some/dir"])
    with pytest.raises(config.ConfigError, match=r"model.init_from='hf:.*nowhere': .*config.json not found"):
        llama_config(tmp_path / "nowhere")
    with pytest.raises(config.ConfigError, match=r"model.init_from is only used by model.kind='llama'"):
        config.load(None, ["model.kind=gpt", f"model.init_from=hf:{hf_models['gqa'][0]}"])
    base = json.loads((hf_models["gqa"][0] / hf.CONFIG).read_text())
    for change, message in [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "set model.kind=mistral, not 'llama'"),
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "mpmd imports model_type 'llama'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope type 'llama3' without a 'factor'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"head_dim": 7}, "head_dim=7"),
        ({"hidden_size": 6e8}, "hidden_size=600000000.0 must be a positive integer"),
        ({"num_hidden_layers": "many"}, "num_hidden_layers='many' must be a positive integer"),
    ]:
        d = tmp_path / re.sub(r"\W+", "_", message)
        d.mkdir()
        (d / hf.CONFIG).write_text(json.dumps({**base, **change}))
        with pytest.raises(config.ConfigError, match=message):
            llama_config(d)
    # config.json alone: the weights are missing, said when they are read.
    with pytest.raises(hf.HFError, match=r"has neither model.safetensors nor model.safetensors.index.json"):
        hf.open(d)


def test_a_missing_tensor_names_the_parameter(hf_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_dir = hf_models["gqa"][0]
    tensors = load_file(str(hf_dir / hf.WEIGHTS))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / hf.WEIGHTS))
    (tmp_path / hf.CONFIG).write_bytes((hf_dir / hf.CONFIG).read_bytes())
    with pytest.raises(
        hf.HFError,
        match=r"no tensor 'model.layers.2.mlp.up_proj.weight' \(model parameter "
        r"blocks.2.mlp.up.kernel\)",
    ):
        hf.open(tmp_path).read(["blocks.2.mlp.up.kernel"])


def broken_copy(hf_dir, to, config_change=None, tensors_change=None):
    """A copy of a Hugging Face directory with config.json and/or its tensors changed."""
    from safetensors.numpy import load_file, save_file

    to.mkdir()
    c = json.loads((hf_dir / hf.CONFIG).read_text())
    (to / hf.CONFIG).write_text(json.dumps({**c, **(config_change or {})}))
    tensors = load_file(str(hf_dir / hf.WEIGHTS))
    if tensors_change:
        tensors_change(tensors)
    save_file(tensors, str(to / hf.WEIGHTS), metadata={"format": "pt"})
    return to


def test_tensors_are_checked_against_config_json_before_any_model_is_built(hf_models, tmp_path):
    hf_dir = hf_models["gqa"][0]
    up = "model.layers.1.mlp.up_proj.weight"
    cases = [
        ({"num_hidden_layers": 10**6}, None, r"says num_hidden_layers=1000000, but .* tensors are of 3 layers"),
        (
            {"hidden_size": 600_000_000, "head_dim": None},
            None,
            r"'model.embed_tokens.weight' .* has shape \[256, 32\], but .* implies \[256, 600000000\]",
        ),
        (
            None,
            lambda t: t.update({up: t[up][:, :-1]}),
            rf"tensor '{up}' .* has shape \[48, 31\], but .* implies \[48, 32\]",
        ),
        (None, lambda t: t.update({up: t[up].astype(np.int32)}), rf"tensor '{up}' .* is I32; a weight must be one of"),
    ]
    for k, (config_change, tensors_change, message) in enumerate(cases):
        d = broken_copy(hf_dir, tmp_path / f"case{k}", config_change, tensors_change)
        t0 = time.perf_counter()
        with pytest.raises(config.ConfigError, match=message):
            llama_config(d)
        assert time.perf_counter() - t0 < 5, "refused from the headers, no model built"
    truncated = broken_copy(hf_dir, tmp_path / "truncated")
    raw = (truncated / hf.WEIGHTS).read_bytes()
    (truncated / hf.WEIGHTS).write_bytes(raw[:40])
    with pytest.raises(config.ConfigError, match=r"cannot read .*model.safetensors"):
        llama_config(truncated)


def test_non_finite_weights_are_refused_naming_the_tensor(hf_models, tmp_path):
    hf_dir = hf_models["gqa"][0]
    q = "model.layers.0.self_attn.q_proj.weight"

    def poison(t):
        t[q] = t[q].copy()
        t[q][3, 5], t[q][0, 0] = np.nan, np.inf

    d = broken_copy(hf_dir, tmp_path / "nan", tensors_change=poison)
    llama_config(d)  # the headers are fine: the values are read stage by stage, and checked then
    with pytest.raises(config.ConfigError, match=rf"tensor '{q}' in .* holds 2 NaN or infinite value\(s\) of 1024"):
        hf.open(d).read(["blocks.0.attn.q.kernel"])
    with pytest.raises(config.ConfigError, match=rf"tensor '{q}' .* holds 2 NaN"):
        hf.load(d)


@pytest.mark.slow  # starts `mpmd train` and `mpmd generate` four times
def test_train_and_generate_refuse_damaged_weights_in_one_line_exit_2(hf_models, tmp_path):
    from tests.support.processes import mpmd_command

    hf_dir = hf_models["gqa"][0]
    q = "model.layers.1.self_attn.q_proj.weight"
    nan = broken_copy(hf_dir, tmp_path / "nan", tensors_change=lambda t: t.update({q: t[q] * np.nan}))
    short = broken_copy(hf_dir, tmp_path / "short", tensors_change=lambda t: t.update({q: t[q][:-1]}))
    (tmp_path / "llama.yaml").write_text("model:\n  kind: llama\n")
    run = [
        tmp_path / "llama.yaml",
        f"model.seq_len={hf_llama.SEQ_LEN}",
        "data.source=synthetic",
        "train.steps=1",
        "train.sample_tokens=0",
        "cluster.num_workers=2",
    ]
    for d, message in [
        (nan, rf"tensor '{q}' in .* holds 1024 NaN"),
        (short, rf"tensor '{q}' in .* has shape \[31, 32\]"),
    ]:
        for command, args in [
            ("train", [*run, f"model.init_from=hf:{d}", f"run_dir={tmp_path / ('run_' + d.name)}"]),
            ("generate", [f"hf:{d}", "--prompt", "x"]),
        ]:
            proc = mpmd_command(command, *args)
            lines = proc.stderr.strip().splitlines()
            errors = [line for line in lines if line.startswith("error: ")]
            assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            assert re.search(message, errors[0]), errors[0]


FROM_CONFIG = "from model.init_from"


def pipelined_trainer(cfg, cluster, run_dir, init_params=FROM_CONFIG):
    """The recipe's pipeline of `cfg` (2 stages; abstract where it can be) on `cluster`, its
    parameters read from model.init_from stage by stage (the Trainer's init_params), or
    `init_params` (None: the model's seeded init)."""
    import mpmd
    from mpmd.recipes.run import build

    sample = hf_llama.tokens(2)
    if init_params == FROM_CONFIG:
        init_params = registry.get_model_spec("llama").init_params(cfg)
    stages, loss_fn = build.build_model(cfg, sample, abstract=True)
    pipe = mpmd.Pipeline(stages, loss_fn, sample_input=sample)
    return mpmd.Trainer(
        pipe,
        build.build_optimizer(cfg),
        schedule="1f1b",
        num_microbatches=2,
        cluster=cluster,
        run_dir=run_dir,
        init_params=init_params,
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gqa", "tied"])
def test_pipelined_on_workers_equals_transformers_and_exports_bitwise(hf_models, case, workers, tmp_path):
    """2 slices on real worker processes: the imported model's logits are transformers'; its
    step-0 checkpoint exported is the very tensors imported, and loads in transformers."""
    from mpmd.recipes.commands.export import export_hf
    from safetensors.numpy import load_file

    hf_dir, reference = hf_models[case]
    cfg = llama_config(hf_dir, "pipeline.num_stages=2", f"run_dir={tmp_path / 'run'}")
    tokens = hf_llama.tokens()
    trainer = pipelined_trainer(cfg, workers, cfg.run_dir)
    try:
        (got,) = trainer.predict(tokens)
        trainer.save(wait=True)
    finally:
        trainer.close(close_cluster=False)
    want = hf_llama.logits(reference, tokens)
    assert hf_llama.relative_error(got, want) < 1e-4
    config.dump(cfg, tmp_path / "run" / "config.yaml")
    out = export_hf(tmp_path / "run", tmp_path / "exported")
    original, written = load_file(str(hf_dir / hf.WEIGHTS)), load_file(str(out / hf.WEIGHTS))
    original.pop("lm_head.weight", None) if case == "tied" else None  # tied: the embedding is the head
    assert sorted(written) == sorted(original)
    assert all(written[n].tobytes() == original[n].tobytes() for n in original), "import -> export is bitwise"
    assert hf_llama.relative_error(hf_llama.load_logits(out, tokens), want) < 1e-4


def test_the_trainer_refuses_init_params_of_another_shape(hf_models):
    """Weights of another model (here: another key/value head count) are refused naming the
    parameter, before any step."""
    from mpmd.runtime.control.inprocess import InProcessCluster

    gqa_dir, other_dir = hf_models["gqa"][0], hf_models["sharded_bf16"][0]
    cfg = llama_config(gqa_dir, "pipeline.num_stages=2")
    with pytest.raises(
        ValueError,
        match=r"init_params gave blocks.0.attn.k.kernel as float32\[32, 8\]; stage 0 "
        r"holds it as float32\[32, 16\]",
    ):
        pipelined_trainer(cfg, InProcessCluster(), None, init_params=hf.open(other_dir).read)


def test_an_abstract_stage_with_state_gets_its_state_made_and_its_params_given(hf_models):
    """Dropout streams (stage state) of an abstract model are still made on the slice by its
    seeded init, as without init_params; the parameters are the imported tensors, bitwise."""
    from mpmd.runtime.control.inprocess import InProcessCluster

    hf_dir = hf_models["gqa"][0]
    cfg = llama_config(hf_dir, "pipeline.num_stages=2", "model.dropout=0.1")
    _, want = hf.load(hf_dir)
    with pipelined_trainer(cfg, InProcessCluster(), None) as trainer:
        params, state = trainer.params(), trainer.state()
        paths = trainer.pipeline.param_paths
    seeded = pipelined_trainer(cfg, InProcessCluster(), None, init_params=None)
    with seeded:
        assert seeded.pipeline.fns[0].state is not None, "the case has stage state"
        seeded_state = seeded.state()
        seeded_embedding = np.asarray(jax.tree.leaves(seeded.params()[0])[0])
    assert not np.array_equal(seeded_embedding, want[paths[0][0]]), "the reference is the seeded init"
    for k, stage in enumerate(params):
        for path, leaf in zip(paths[k], jax.tree.leaves(stage)):
            assert np.asarray(leaf).tobytes() == want[path].tobytes(), path
        assert state[k].keys() == seeded_state[k].keys()
        assert all(np.array_equal(state[k][p], seeded_state[k][p]) for p in state[k])


def test_a_resumed_run_reads_no_pretrained_weights(hf_models, tmp_path):
    """Its checkpoint replaces them: init_params is not called, and the parameters are the
    checkpoint's (here: the imported ones, saved at step 0)."""
    from mpmd.runtime.control.inprocess import InProcessCluster

    hf_dir = hf_models["gqa"][0]
    cfg = llama_config(hf_dir, "pipeline.num_stages=2")
    with pipelined_trainer(cfg, InProcessCluster(), tmp_path) as first:
        first.predict(hf_llama.tokens())  # compiles, and so makes the optimizer state a save needs
        first.save(wait=True)
        saved = first.params()

    def unread(paths):
        raise AssertionError(f"read {paths[:1]} although a checkpoint restores")

    with pipelined_trainer(cfg, InProcessCluster(), tmp_path, init_params=unread) as resumed:
        assert resumed.resumed[0] == 0
        got = resumed.params()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved)))


def test_pretrained_weights_travel_in_parts_and_land_whole(hf_models, monkeypatch):
    """With parts of one leaf each (programs.PUT_BYTES), every stage's parameters reach its
    slice as a first Put and appended ones, and the slices hold the imported tensors bitwise:
    the controller never holds a whole stage (benchmarks/bench_hf_import.py measures it)."""
    from mpmd.runtime.control.inprocess import InProcessCluster
    from mpmd.stages import names
    from mpmd.train import programs

    class Counting(InProcessCluster):
        def __init__(self):
            super().__init__()
            self.puts = []

        def put(self, slice_index, name, arrays, layouts=None, append=False):
            self.puts.append((name, len(arrays), append))
            super().put(slice_index, name, arrays, layouts, append)

    monkeypatch.setattr(programs, "PUT_BYTES", 1)
    hf_dir = hf_models["gqa"][0]
    cfg = llama_config(hf_dir, "pipeline.num_stages=2")
    _, want = hf.load(hf_dir)
    cluster = Counting()
    with pipelined_trainer(cfg, cluster, None) as trainer:
        params, paths = trainer.params(), trainer.pipeline.param_paths
    for k, stage in enumerate(params):
        sent = [p for p in cluster.puts if p[0] == names.params(k)]
        assert len(sent) == len(paths[k]) and all(n == 1 for _, n, _ in sent)
        assert [a for _, _, a in sent] == [False] + [True] * (len(paths[k]) - 1)
        for path, leaf in zip(paths[k], jax.tree.leaves(stage)):
            assert np.asarray(leaf).tobytes() == want[path].tobytes(), path
