"""model.kind='mlp': the MLP regressor (models/mlp.py) on synthetic regression data."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd.recipes.config import Config, ModelSection
from mpmd.recipes.registry import REGRESSION, ModelSpec, flax_build, layers_problems, models_loss, register_model_spec


class WidthsSection(ModelSection):
    """An MLP's widths (a custom builder may read these too)."""

    in_features: int = Field(16, gt=0, le=2**20, description="input width")
    hidden_features: int = Field(64, gt=0, le=2**20, description="hidden width")
    out_features: int = Field(4, gt=0, le=2**20, description="output width")


class MLPSection(WidthsSection):
    kind: Literal["mlp"] = Field("mlp", description="which model to build")
    num_layers: int = Field(4, gt=0, le=2**12, description="hidden layers")


def _problems(cfg: Config) -> list[str]:
    m, t = cfg.model, cfg.train
    out = layers_problems(cfg, m.num_layers + 1, f"{m.num_layers} hidden + output")
    if t.sample_tokens:
        out.append(f"model.kind='mlp' cannot sample text: train.sample_tokens must be 0, got {t.sample_tokens}")
    return out


def _mlp(cfg: Config, rngs):
    from mpmd import models

    m = cfg.model
    return models.MLP(m.in_features, m.hidden_features, m.num_layers, m.out_features, rngs=rngs)


SPEC = register_model_spec(
    ModelSpec(
        "mlp",
        MLPSection,
        build=flax_build(_mlp),
        loss=models_loss("mse_loss"),
        reads=(REGRESSION,),
        tokens_per_example=lambda cfg: 1,  # examples, one "token" each
        problems=_problems,
    )
)
