"""model.kind='custom': `model.module = "pkg.mod:fn"`, called as fn(cfg), builds the model:
it returns `(stages, loss_fn)`, `(model, loss_fn)` or a bare model, where a model exposes
`.layers()` and is split like the built-in ones; a bare model's loss is next-token
cross-entropy on the tokens it trains on (stdlib, files or synthetic tokens). Its section
holds the keys such a builder may read (recipes/examples/custom_stages.py reads vocab_size,
d_model and mlp_ratio). A family used more than once deserves a spec of its own (see
recipes/families/gpt.py and the config's `imports:`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from mpmd.recipes.config import Config, ConfigError
from mpmd.recipes.families.gpt import GPTSection, byte_vocab_problems, lm_loss, seq_len, LM_READS
from mpmd.recipes.families.llama import ComputeSection
from mpmd.recipes.families.mlp import WidthsSection
from mpmd.recipes.registry import ModelSpec, import_module, register_model_spec

_MODULE_FN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class CustomSection(GPTSection, ComputeSection, WidthsSection):
    kind: Literal["custom"] = Field("custom", description="which model to build")
    num_layers: int = Field(4, gt=0, le=2**12, description="layers, for the builder to read")
    module: str | None = Field(None, description="'package.module:function' that builds a list of nnx stages")


def _problems(cfg: Config) -> list[str]:
    m = cfg.model
    out = byte_vocab_problems(cfg)
    if not (m.module and _MODULE_FN.match(m.module)):
        out.append(f"model.kind='custom' needs model.module='package.module:function', got {m.module!r}")
    return out


def _build(cfg: Config, abstract: bool):
    spec = cfg.model.module
    module_name, fn_name = spec.split(":")  # the config schema already checked the shape
    module = import_module(module_name, f"model.module={spec!r}")
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"model.module={spec!r}: {module_name} has no function {fn_name!r}")
    return fn(cfg)


def _split(cfg: Config, built, sample_input):
    """None (the usual split), after saying which key to change when the builder's own list
    of stages is not pipeline.num_stages long."""
    num_stages = cfg.pipeline.num_stages
    if not callable(getattr(built, "layers", None)) and cfg.pipeline.cuts is None and len(built) != num_stages:
        raise ConfigError(
            f"model.module={cfg.model.module!r} returned {len(built)} stages but "
            f"pipeline.num_stages={num_stages}; set pipeline.num_stages="
            f"{len(built)} or return a model with .layers() to be split"
        )
    return None


SPEC = register_model_spec(
    ModelSpec(
        "custom",
        CustomSection,
        build=_build,
        loss=lm_loss,
        reads=LM_READS,
        tokens_per_example=seq_len,
        split=_split,
        problems=_problems,
    )
)
