"""The end-of-run sample's model made from the run's own (generate.template_of), not built again:
the same parameters give the same model as model_with's fresh build, for every family a config
ships, dropout's RNG state included; and the template holds shapes, not weights."""

import jax
import numpy as np
import pytest
from flax import nnx

from mpmd.recipes import config
from mpmd.recipes.run import build, generate
from mpmd.stages.leaf_paths import path_string

CONFIGS = {
    "gpt+dropout": ("configs/gpt_tiny.yaml", ["model.dropout=0.1"]),
    "llama": ("configs/llama_tiny.yaml", []),
    "gemma3": ("configs/gemma3_tiny.yaml", []),
    "moe": ("configs/moe_tiny.yaml", []),
}


def _trained(model) -> dict:
    """{path: array} of new values for every parameter, as a trained run's would be."""
    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(0)
    return {path_string(kp): rng.normal(size=leaf.shape).astype(leaf.dtype) for kp, leaf in flat}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_template_gives_the_model_a_fresh_build_gives(name):
    path, overrides = CONFIGS[name]
    cfg = config.load(path, overrides)
    built, _ = build.built_model(cfg, abstract=False)
    template = generate.template_of(built)
    assert template is not None
    _, params, _ = template
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params))
    trained = _trained(built)
    fresh, kept = generate.model_with(cfg, trained), generate.model_with(cfg, trained, template)
    assert kept is not built
    a, b = nnx.state(fresh), nnx.state(kept)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(x) if _is_key(x) else x), _host(y))
    tokens = np.arange(2 * 8, dtype=np.int32).reshape(2, 8) % 200
    fresh.eval(), kept.eval()
    np.testing.assert_array_equal(np.asarray(fresh(tokens)), np.asarray(kept(tokens)))


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _host(y):
    return np.asarray(jax.random.key_data(y) if _is_key(y) else y)


def test_a_model_built_as_shapes_with_rng_state_has_no_template():
    """Shapes only (model.init_from's build) and dropout's RNG streams: nothing to make the
    sample's model from, so model_with builds it (None)."""
    cfg = config.load("configs/gpt_tiny.yaml", ["model.dropout=0.1"])
    built, _ = build.built_model(cfg, abstract=True)
    assert generate.template_of(built) is None
