"""mpmd.recipes.config: defaults, overrides, every kind of bad config and its message, dump/load."""

from pathlib import Path

import pytest
import yaml

from mpmd.recipes import config
from mpmd.recipes.config import Config, ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _leaf_keys(values: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        keys += _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]
    return keys


def test_defaults_are_valid_and_describe_lists_every_key():
    cfg = config.load(None, [])
    assert cfg == Config()
    assert cfg.num_workers == cfg.pipeline.num_stages // cfg.pipeline.virtual_stages == 2
    text = config.describe()
    described = yaml.safe_load(text)  # describe() is itself valid YAML of the defaults
    assert described == cfg.model_dump(mode="json")
    for key in _leaf_keys(cfg.model_dump()):
        # indented as deep as the key is nested: mesh.data is not the data section
        *sections, leaf = key.split(".")
        line = next(line for line in text.splitlines() if line.startswith("  " * len(sections) + leaf + ":"))
        assert "  # " in line and len(line.split("  # ", 1)[1]) > 5, key
    assert "(one of: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v, dualpipe-v)" in text


def test_overrides_parse_nested_lists_null_bools_and_floats():
    cfg = config.load(
        None,
        [
            "train.steps=5",
            "optimizer.max_grad_norm=null",
            "log.trace_steps=[1, 2]",
            "log.tensorboard=false",
            "optimizer.lr=1e-3",
            "seed=7",
            "train.sample_prompt=hello there",
            "model={d_model: 32, num_heads: 4}",
            "optimizer.b1=0",
        ],
    )
    assert cfg.train.steps == 5
    assert cfg.optimizer.max_grad_norm is None
    assert cfg.log.trace_steps == [1, 2]
    assert cfg.log.tensorboard is False
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.seed == 7 and cfg.train.sample_prompt == "hello there"
    assert (cfg.model.d_model, cfg.model.num_heads, cfg.model.num_layers) == (32, 4, 4)
    assert cfg.optimizer.b1 == 0.0


def test_overrides_beat_the_file_and_later_overrides_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# comment\ntrain:\n  steps: 11\n  batch_size: 8\nlog:\n")
    cfg = config.load(path, ["train.steps=12", "train.steps=13"])
    assert (cfg.train.steps, cfg.train.batch_size) == (13, 8)
    assert cfg.log == Config().log  # an empty section in YAML means "no overrides"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["pipeline.num_microbatch=4"],
            "unknown key 'pipeline.num_microbatch'; did you mean 'pipeline.num_microbatches'?",
        ),
        (["num_microbatches=4"], "did you mean 'pipeline.num_microbatches'?"),
        (["train.steps=abc"], "train.steps must be an integer, got 'abc'"),
        (["train.steps=2.5"], "train.steps must be an integer, got 2.5"),
        (["log.tensorboard=3"], "log.tensorboard must be true or false, got 3"),
        (["log.trace_steps=[1, x]"], "log.trace_steps[1] must be an integer, got 'x'"),
        (
            ["model.kind=gtp"],
            "model.kind must be one of 'gpt', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma3', 'moe', 'mlp' or 'custom', got 'gtp'",
        ),
        (
            ["model.kind=llama", "model.num_heads=4", "model.num_kv_heads=3"],
            "model.num_kv_heads=3 must divide model.num_heads=4",
        ),
        (["model.kind=llama", "model.d_model=66"], "model.d_model / model.num_heads = 33 must be even"),
        (
            ["model.dtype=bfloat16"],
            "model.dtype is only used by model.kind='llama', 'mistral', 'qwen2', 'qwen3', 'gemma3', 'moe' or 'custom', got kind 'gpt'",
        ),
        (
            ["model.remat=block"],
            "model.remat is only used by model.kind='llama', 'mistral', 'qwen2', 'qwen3', 'gemma3', 'moe' or 'custom', got kind 'gpt'",
        ),
        (["model.num_kv_heads=1"], "model.num_kv_heads is only used by model.kind='llama'"),
        (["model.kind=llama", "model.dtype=float16"], "model.dtype must be one of 'float32' or 'bfloat16'"),
        (["train.sample_temperature=-1"], "train.sample_temperature must be >= 0"),
        (["seed=-5"], "seed must be >= 0"),
        (["pipeline.schedule=1F1B"], "'gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1', 'zb-v' or 'dualpipe-v'"),
        (
            ["pipeline.schedule=zb-v", "pipeline.num_stages=4", "pipeline.virtual_stages=1"],
            "pipeline.schedule='zb-v' supports only pipeline.virtual_stages=2 (it holds two stages per slice, a V), got 1",
        ),
        (["train.steps=0"], "train.steps must be > 0, got 0"),
        (["model.seq_len=1"], "model.seq_len must be >= 2, got 1"),
        (["data.eval_fraction=1.0"], "data.eval_fraction must be < 1"),
        (["pipeline.num_microbatches=3"], "train.batch_size=16 must be divisible by pipeline.num_microbatches=3"),
        (["pipeline.virtual_stages=2"], "pipeline.schedule='1f1b' supports only pipeline.virtual_stages=1, got 2"),
        (
            ["pipeline.schedule=interleaved-1f1b"],
            "pipeline.schedule='interleaved-1f1b' needs pipeline.virtual_stages >= 2",
        ),
        (
            ["pipeline.num_stages=3", "pipeline.virtual_stages=2", "pipeline.schedule=interleaved-1f1b"],
            "needs pipeline.num_stages divisible by pipeline.virtual_stages (2), got pipeline.num_stages=3",
        ),
        (
            [
                "pipeline.num_stages=8",
                "pipeline.virtual_stages=2",
                "pipeline.schedule=interleaved-1f1b",
                "pipeline.num_microbatches=8",
                "model.num_layers=6",
                "train.batch_size=24",
                "pipeline.num_microbatches=6",
            ],
            "needs pipeline.num_microbatches to be a multiple of the number of pipeline slices (4), got 6",
        ),
        (
            ["pipeline.num_stages=4", "pipeline.num_microbatches=2"],
            "pipeline.schedule='1f1b' needs pipeline.num_microbatches >= number of pipeline slices (4)",
        ),
        (["model.num_heads=3"], "model.d_model=64 must be divisible by model.num_heads=3"),
        (["model.dropout=1.0"], "model.dropout must be < 1.0, got 1.0"),
        (["pipeline.num_stages=7"], "pipeline.num_stages=7 is more than the gpt's 6 layers"),
        (["cluster.num_workers=3"], "cluster.num_workers=3 must equal"),
        (["cluster.backend=static"], "cluster.backend='static' needs cluster.addresses"),
        (["cluster.backend=static"], "cluster.backend='static' needs cluster.token_file"),
        (
            ["cluster.backend=static", "cluster.addresses=[a:1, b]", "cluster.token_file=t"],
            "cluster.addresses entry 'b' must be 'host:port'",
        ),
        (["cluster.addresses=[a:1, b:2]"], "cluster.addresses is only used by cluster.backend"),
        (["cluster.spares=[c:3]"], "cluster.spares is only used by cluster.backend='static', got backend 'local'"),
        (
            ["cluster.backend=static", "cluster.addresses=[a:1, b:2]", "cluster.spares=[b:2]", "cluster.token_file=t"],
            "cluster.addresses and cluster.spares list b:2 more than once",
        ),
        (
            ["cluster.backend=static", "cluster.addresses=[a:1, b:2]", "cluster.spares=[c]", "cluster.token_file=t"],
            "cluster.spares entry 'c' must be 'host:port'",
        ),
        (
            ["cluster.address=auto"],
            "cluster.address is only used by cluster.backend='ray' or 'shared', got backend 'local'",
        ),
        (
            ["cluster.resources={GPU: 1}", "cluster.backend=static"],
            "cluster.resources is only used by cluster.backend='ray'",
        ),
        (["cluster.resources={CPU: -1}", "cluster.backend=ray"], "cluster.resources.CPU=-1 must be >= 0"),
        (["cluster.failure_timeout_s=0"], "cluster.failure_timeout_s must be > 0"),
        (
            ["cluster.failure_timeout_s=3", "cluster.backend=inprocess"],
            "cluster.failure_timeout_s is only used by cluster.backend='local', 'static', 'ray' or 'shared', "
            "got backend 'inprocess'",
        ),
        (["cluster.transport=tcp"], "cluster.transport must be one of 'auto', 'socket' or 'shm', got 'tcp'"),
        (
            ["cluster.transport=shm", "cluster.processes_per_slice=2"],
            "cluster.transport=shm cannot serve slices that are gangs (cluster.processes_per_slice=2)",
        ),
        (
            ["cluster.transport=shm", "cluster.backend=inprocess"],
            "cluster.transport is only used by cluster.backend='local', 'static', 'ray' or 'shared', got backend 'inprocess'",
        ),
        (["log.level=quiet"], "log.level must be one of"),
        (["checkpoint.keep=0"], "checkpoint.keep must be a positive integer"),  # mpmd.Checkpointing's rule
        (["checkpoint.memory_every=-1"], "checkpoint.memory_every must be a non-negative integer"),
        (["cluster.on_loss=never"], "cluster.on_loss must be one of 'replace', 'shrink', 'auto'"),  # mpmd.Recovery's
        (["cluster.replace_timeout_s=-1"], "cluster.replace_timeout_s must be a finite number of seconds >= 0"),
        (["cluster.slice_memory_bytes=0"], "cluster.slice_memory_bytes must be a positive integer"),
        (["data.source=files"], "data.paths must name at least one file, directory or glob when data.source='files'"),
        (
            ["model.kind=mlp"],
            "model.kind='mlp' does not read (it reads regression pairs): data.source must be 'synthetic'",
        ),
        (["model.kind=custom"], "model.kind='custom' needs model.module='package.module:function'"),
        (["model.vocab_size=100"], "model.vocab_size must be >= 256, got 100"),
        (["optimizer.name=sgd"], "optimizer.weight_decay=0.01 only applies to 'adamw'"),
        (
            ["cluster.devices_per_worker=2", "mesh.stages=[{data: 2}, {data: 2, tensor: 2}]"],
            "mesh.stages[1]: data=2 x fsdp=1 x tensor=2 = 4 devices, but cluster.devices_per_worker=2",
        ),
        (
            ["cluster.devices_per_worker=4", "mesh.tensor=3"],
            "mesh: data=1 x fsdp=1 x tensor=3 = 3 devices, but cluster.devices_per_worker=4",
        ),
        (["mesh.data=2"], "mesh: data=2 x fsdp=1 x tensor=1 = 2 devices, but cluster.devices_per_worker=1"),
        (["mesh.stages=[{tensor: 2}]"], "mesh.stages lists 1 slice shape(s) but there are 2 slices"),
        (["mesh.stages=[{}, {tensr: 2}]"], "unknown key 'mesh.stages[1].tensr'; did you mean 'mesh.stages[1].tensor'?"),
        (["mesh.fsdp=0"], "mesh.fsdp must be > 0, got 0"),
        (["mesh.rules.embed=tensr"], "mesh.rules.embed='tensr': a rule maps a logical axis name to a mesh axis"),
        (["model=3"], "'model' is a section, not a value"),
        (["train.steps.x=1"], "'train.steps' is a value, not a section"),
        (["train.steps"], "override 'train.steps' must look like key=value"),
        (["=5"], "must look like key=value"),
        (["train steps=5"], "must look like key=value"),
    ],
)
def test_bad_config_is_rejected_with_a_message_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        config.load(None, overrides)
    assert message in str(error.value)


def test_config_error_is_a_value_error_and_lists_every_problem():
    with pytest.raises(ValueError) as error:
        config.load(None, ["train.steps=0", "model.num_heads=3"])
    assert "train.steps" in str(error.value)
    with pytest.raises(ValueError) as error:
        config.load(None, ["cluster.backend=static", "pipeline.num_microbatches=3"])
    assert str(error.value).count("\n") == 2  # three problems, one per line


def test_valid_static_and_custom_configs_pass():
    cfg = config.load(
        None,
        [
            "cluster.backend=static",
            "cluster.addresses=[10.0.0.1:7001, h:7002]",
            "cluster.token_file=/tmp/token",
            "cluster.num_workers=2",
        ],
    )
    assert cfg.cluster.addresses == ["10.0.0.1:7001", "h:7002"]
    cfg = config.load(
        None,
        [
            "cluster.backend=static",
            "cluster.addresses=[a:1, b:2]",
            "cluster.spares=[c:3, d:4]",
            "cluster.token_file=t",
            "cluster.failure_timeout_s=2.5",
        ],
    )
    assert cfg.cluster.spares == ["c:3", "d:4"] and cfg.cluster.failure_timeout_s == 2.5
    cfg = config.load(None, ["cluster.backend=ray", "cluster.address=auto", "cluster.resources.GPU=1"])
    assert cfg.cluster.address == "auto" and cfg.cluster.resources == {"GPU": 1.0}
    cfg = config.load(None, ["pipeline.schedule=dualpipe-v", "pipeline.num_stages=4"])  # 2 stages per slice by default
    assert cfg.num_workers == 2
    cfg = config.load(None, ["model.kind=custom", "model.module=my_pkg.models:build_stages"])
    assert cfg.model.module == "my_pkg.models:build_stages"


def test_mesh_defaults_to_data_over_every_device_and_stages_give_unlike_slices():
    cfg = config.load(None, ["cluster.devices_per_worker=4"])
    assert cfg.slice_shapes() == [{"data": 4, "fsdp": 1, "tensor": 1}] * 2
    cfg = config.load(None, ["cluster.devices_per_worker=4", "mesh.tensor=2"])  # data takes the rest
    assert cfg.slice_shapes() == [{"data": 2, "fsdp": 1, "tensor": 2}] * 2
    cfg = config.load(
        None,
        [
            "cluster.devices_per_worker=2",
            "mesh.stages=[{tensor: 2}, {data: 2}]",
            "mesh.rules.mlp=[tensor, fsdp]",
            "mesh.rules.embed=null",
        ],
    )
    assert cfg.slice_shapes() == [{"data": 1, "fsdp": 1, "tensor": 2}, {"data": 2, "fsdp": 1, "tensor": 1}]
    assert cfg.mesh.rules == {"mlp": ["tensor", "fsdp"], "embed": None}
    # In one process a slice takes as many devices as its mesh, whatever devices_per_worker says.
    cfg = config.load(None, ["cluster.backend=inprocess", "mesh.stages=[{tensor: 2}, {data: 2, fsdp: 2}]"])
    assert cfg.num_devices == 6


def test_mesh_axes_are_mpmd_sharding_axes():
    from mpmd.stages import sharding

    assert config.MESH_AXES == sharding.AXES == tuple(config.SliceShape.model_fields)
    cfg = config.load(
        None, ["cluster.devices_per_worker=4", "mesh.stages=[{fsdp: 2, tensor: 2}, {}]", "mesh.rules.embed=tensor"]
    )
    assert sharding.slice_meshes(cfg.slice_shapes(), cfg.num_workers, 4)[0].size == 4
    assert sharding.check_rules(cfg.mesh.rules)["embed"] == "tensor"


def test_mesh_and_devices_are_not_in_the_math_hash():
    """A run may resume on another mesh (the same math spread over other devices)."""
    a = config.load(None, [])
    b = config.load(
        None,
        ["cluster.devices_per_worker=4", "mesh.stages=[{data: 2, tensor: 2}, {fsdp: 4}]", "mesh.rules.embed=tensor"],
    )
    assert a.math_hash() == b.math_hash() and a.math() == b.math()
    assert not any(k.startswith(("mesh", "cluster")) for k in b.math())
    assert a.hash() != b.hash()  # the full hash, in the resolved config's header, does see it


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*nope.yaml' not found"):
        config.load(tmp_path / "nope.yaml", [])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of keys to values, got a list"):
        config.load(tmp_path / "list.yaml", [])
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        config.load(tmp_path / "bad.yaml", [])
    (tmp_path / "typo.yaml").write_text("optimiser:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="unknown key 'optimiser'; did you mean 'optimizer'"):
        config.load(tmp_path / "typo.yaml", [])
    with pytest.raises(ConfigError, match="cannot read config file"):
        config.load(tmp_path, [])  # a directory


def test_resolved_config_round_trips_through_dump_and_load(tmp_path):
    cfg = config.load(
        CONFIGS / "gpt_small.yaml",
        [
            "optimizer.max_grad_norm=null",
            "log.trace_steps=[5]",
            "optimizer.lr=3e-5",
            "cluster.devices_per_worker=2",
            "mesh.stages=[{tensor: 2}, {data: 2}]",
            "mesh.rules.mlp=[tensor, fsdp]",
        ],
    )
    path = config.dump(cfg, tmp_path / "run" / "config.yaml")
    again = config.load(path, [])
    assert again == cfg and again.hash() == cfg.hash()
    assert path.read_text().startswith(f"# resolved mpmd config (hash {cfg.hash()})")


def test_hash_is_stable_short_and_sensitive():
    a, b = config.load(None, []), config.load(None, ["train.steps=201"])
    assert a.hash() == Config().hash() and len(a.hash()) == 12
    assert a.hash() != b.hash()
    assert a.hash(exclude=["train.steps"]) == b.hash(exclude=["train.steps"])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads_and_holds_only_overrides(path):
    cfg = config.load(path, [])
    assert path.read_text().startswith("#")  # says what it is
    # The defaults of the file's own model family and backend (their sections differ by kind).
    defaults = Config().model_dump()
    defaults["model"] = {**type(cfg.model)().model_dump(), "kind": defaults["model"]["kind"]}
    defaults["cluster"] = {**type(cfg.cluster)().model_dump(), "backend": defaults["cluster"]["backend"]}
    defaults["data"] = {**type(cfg.data)().model_dump(), "source": defaults["data"]["source"]}
    for key in _leaf_keys(yaml.safe_load(path.read_text())):
        *sections, leaf = key.split(".")
        default, value = defaults, cfg.model_dump()
        for section in sections:
            default, value = default[section], value[section]
        assert value[leaf] != default[leaf], f"{path.name}: {key} restates its default"


def test_shipped_configs_exist():
    assert {p.name for p in CONFIGS.glob("*.yaml")} >= {
        "gpt_tiny.yaml",
        "gpt_small.yaml",
        "mlp.yaml",
        "llama_tiny.yaml",
        "llama_1b.yaml",
    }


def test_a_flat_resolved_config_from_before_per_kind_sections_still_loads_and_resumes(tmp_path):
    """Before model.* and cluster.* were per family and backend, a resolved config (and every
    manifest's math) listed every family's keys; at their defaults they mean nothing else."""
    old = Config().model_dump(mode="json")
    old["model"].update(
        num_kv_heads=None,
        mlp_dim=None,
        tie_embeddings=False,
        dtype="float32",
        remat="none",
        in_features=16,
        hidden_features=64,
        out_features=4,
        module=None,
    )
    old["cluster"].update(addresses=[], spares=[], address=None, file=None, share=False, lease_s=None, resources={})
    path = tmp_path / "config.yaml"
    path.write_text("# resolved mpmd config\n" + yaml.safe_dump(old))
    assert config.load(path, []) == Config()
    math = {f"model.{k}": v for k, v in old["model"].items()}
    assert config.math_changes({**Config().math(), **math}, Config().math()) == []
    assert config.math_changes({**Config().math(), "model.num_kv_heads": 2}, Config().math()) == [
        "model.num_kv_heads: 2 -> '(unset)'"
    ]
    with pytest.raises(
        ConfigError,
        match="model.dtype is only used by model.kind='llama', 'mistral', 'qwen2', 'qwen3', 'gemma3', 'moe' or 'custom'",
    ):
        config.load(path, ["model.dtype=bfloat16"])
