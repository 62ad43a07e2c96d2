"""The registries (mpmd.recipes.registry, mpmd.schedules.register_schedule): a model family, a
data source, a cluster backend and a schedule registered from outside mpmd are accepted by the
config, built by the recipe, searched by the tuner and trained by `mpmd train`, with no other
file changed."""

import json

import numpy as np
import pytest
import yaml

from mpmd import schedules
from mpmd.recipes import config, registry
from mpmd.recipes.config import ConfigError
from mpmd.tuner import search
from tests.support.processes import mpmd_train


@pytest.fixture
def wedge():
    """A schedule registered by this test (GPipe's order under its own name), gone after it."""
    spec = schedules.register_schedule(
        schedules.ScheduleSpec("wedge", lambda S, m, v: schedules.gpipe(S, m)._replace(name="wedge"))
    )
    yield spec
    del schedules.SCHEDULES["wedge"]


def train_registered(path, *sections: str):
    """`mpmd train` a config of tests.support.registrations' names with `sections` (YAML lines)
    into <path's folder>/run: (its finite losses, its resolved config read as YAML: loading it
    here would register them in this process too, and the completed process)."""
    run_dir = path.parent / "run"
    path.write_text("\n".join(["imports: [tests.support.registrations]", f"run_dir: {run_dir}", *sections]) + "\n")
    out = mpmd_train(path)
    assert out.returncode == 0, out.stderr
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(losses)), losses
    return losses, yaml.safe_load((run_dir / "config.yaml").read_text()), out


def test_a_registered_family_backend_and_schedule_train_through_mpmd_train(tmp_path):
    path = tmp_path / "ramp.yaml"
    losses, resolved, _ = train_registered(
        path,
        "model: {kind: ramp, width: 4, depth: 3}",
        "data: {source: synthetic}",
        "train: {steps: 3, batch_size: 8, sample_tokens: 0, eval_every: 0}",
        "pipeline: {schedule: all-forward-first, num_stages: 2}",
        "cluster: {backend: threads, label: here}",
        "log: {tensorboard: false, trace_steps: []}",
    )
    assert len(losses) == 3
    # The resolved config holds the family's and the backend's own sections.
    assert resolved["model"] == {"kind": "ramp", "width": 4, "depth": 3}
    assert resolved["cluster"]["label"] == "here" and "max_workers" not in resolved["cluster"]
    # Without the module nothing knows them: the kind is refused by name, listing the known ones.
    assert "ramp" not in registry.model_specs()
    with pytest.raises(
        ConfigError,
        match="model.kind must be one of 'gpt', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma3', 'moe', 'mlp' or 'custom', got 'ramp'",
    ):
        config.load(path, ["imports=[]"])


def test_a_registered_data_source_trains_through_mpmd_train(tmp_path):
    """A source of counting rows: its own key (data.start) is taken, a gpt trains on it, the
    run ends with a sample (its tokens are not text: text=False) skipped, naming why."""
    path = tmp_path / "counting.yaml"
    losses, resolved, out = train_registered(
        path,
        "model: {kind: gpt, d_model: 16, num_heads: 2, num_layers: 2, seq_len: 8}",
        "data: {source: counting, start: 3}",
        "train: {steps: 4, batch_size: 8, eval_every: 0}",
        "cluster: {backend: inprocess}",
        "log: {tensorboard: false, trace_steps: []}",
    )
    assert len(losses) == 4
    assert "sample skipped: needs model.kind=" in out.stdout + out.stderr
    assert resolved["data"] == {"source": "counting", "tokenizer": "bytes", "start": 3}
    assert "counting" not in registry.data_sources()
    with pytest.raises(
        ConfigError,
        match="data.source must be one of 'stdlib', 'files', 'synthetic', 'tokens' or 'jsonl', got 'counting'",
    ):
        config.load(path, ["imports=[]"])


def test_a_family_or_backend_key_is_refused_naming_who_takes_it():
    with pytest.raises(
        ConfigError,
        match=r"model.tie_embeddings is only used by model.kind='llama', 'mistral', 'qwen2', 'qwen3', 'gemma3' or 'moe', got kind 'mlp'",
    ):
        config.load(
            None, ["model.kind=mlp", "data.source=synthetic", "train.sample_tokens=0", "model.tie_embeddings=true"]
        )
    with pytest.raises(
        ConfigError,
        match=r"cluster.max_workers is only used by cluster.backend='local', "
        r"got backend 'static'",
    ):
        config.load(None, ["cluster.backend=static", "cluster.max_workers=3"])
    with pytest.raises(
        ConfigError, match=r"data.pack is only used by data.source='tokens' or 'jsonl', got source 'files'"
    ):
        config.load(None, ["data.source=files", "data.paths=[configs]", "data.pack=true"])
    with pytest.raises(
        ConfigError,
        match=r"data.source='stdlib' gives token windows, which model.kind='mlp' does not read \(it reads "
        r"regression pairs\): data.source must be 'synthetic'",
    ):
        config.load(None, ["model.kind=mlp", "train.sample_tokens=0"])
    with pytest.raises(ConfigError, match=r"imports: cannot import 'no_such_module_here'|imports\[0\]: cannot import"):
        config.load(None, ["imports=[no_such_module_here]"])


def test_a_registered_schedule_is_made_checked_by_the_config_and_searched_by_the_tuner(wedge):
    schedule = schedules.make("wedge", 4, 8)
    schedules.validate(schedule)
    assert schedule.placement == (0, 1, 2, 3) and not schedule.split_backward
    cfg = config.load(None, ["pipeline.schedule=wedge", "tune.schedule_names=[wedge, 1f1b]"])
    assert cfg.pipeline.schedule == "wedge" and cfg.pipeline.virtual_stages == 1
    assert "wedge" in config.describe()
    with pytest.raises(ConfigError, match="pipeline.schedule='wedge' supports only pipeline.virtual_stages=1"):
        config.load(None, ["pipeline.schedule=wedge", "pipeline.virtual_stages=2"])
    profile = _flat_profile(num_units=4, sizes=(4, 8))
    assert {(n, v) for n, v, m in search.space(profile, 2, 16)} >= {("wedge", 1), ("interleaved-1f1b", 2)}
    ranked, _ = search.search(profile, 2, 16, schedule_names=["wedge"], keep=None)
    assert ranked and {c.schedule for c in ranked} == {"wedge"}


def test_a_schedule_spec_with_traits_that_do_not_hold_together_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        schedules.register_schedule(schedules.ScheduleSpec("1f1b", schedules.SCHEDULES["1f1b"].build))
    with pytest.raises(ValueError, match="placement 'loop' or 'v'"):
        schedules.register_schedule(
            schedules.ScheduleSpec("sideways", schedules.SCHEDULES["1f1b"].build, placement="sideways")
        )
    assert "sideways" not in schedules.SCHEDULES


def _flat_profile(num_units: int, sizes):
    """A Profile with every unit costing the same at every microbatch size."""
    from mpmd.tuner.profile import Profile

    n, u = len(sizes), num_units
    ones = np.ones((n, u))
    return Profile(
        microbatch_sizes=tuple(sizes),
        forward_s=ones * 1e-3,
        input_grad_s=ones * 1e-3,
        weight_grad_s=ones * 1e-3,
        update_s=ones * 1e-4,
        residual_bytes=ones * 1e3,
        kept_bytes=ones * 1e2,
        boundary_bytes=np.ones((n, u + 1)) * 1e3,
        param_bytes=np.ones(u) * 1e3,
        optimizer_bytes=np.ones(u) * 2e3,
        latency_s=1e-4,
        bytes_per_s=1e9,
        task_gap_s=1e-5,
        step_overhead_s=1e-3,
    )
