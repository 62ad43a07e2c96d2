"""model.kind='mlp': the MLP regressor (models/mlp.py) on synthetic regression data."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd.recipes.config import Config, ModelSection
from mpmd.recipes.registry import ModelSpec, register_model_spec


class WidthsSection(ModelSection):
    """An MLP's widths (a custom builder may read these too)."""
    in_features: int = Field(16, gt=0, description="input width")
    hidden_features: int = Field(64, gt=0, description="hidden width")
    out_features: int = Field(4, gt=0, description="output width")


class MLPSection(WidthsSection):
    kind: Literal["mlp"] = Field("mlp", description="which model to build")
    num_layers: int = Field(4, gt=0, description="hidden layers")


def _problems(cfg: Config) -> list[str]:
    m, p, d, t = cfg.model, cfg.pipeline, cfg.data, cfg.train
    out = []
    if p.num_stages > m.num_layers + 1:
        out.append(f"pipeline.num_stages={p.num_stages} is more than the mlp's "
                   f"{m.num_layers + 1} layers ({m.num_layers} hidden + output)")
    if d.source != "synthetic":
        out.append(f"model.kind='mlp' regresses synthetic data: data.source must be "
                   f"'synthetic', got '{d.source}'")
    if t.sample_tokens:
        out.append(f"model.kind='mlp' cannot sample text: train.sample_tokens must be 0, "
                   f"got {t.sample_tokens}")
    return out


def _build(cfg: Config, abstract: bool):
    from flax import nnx

    import mpmd
    from mpmd import models
    m = cfg.model

    def make():
        return models.MLP(m.in_features, m.hidden_features, m.num_layers, m.out_features, rngs=nnx.Rngs(cfg.seed))
    return mpmd.abstract(make) if abstract else make()


def _loss(cfg: Config):
    from mpmd import models
    return models.mse_loss


def _sources(cfg: Config):
    from mpmd.recipes import data
    return data.regression_sources(cfg)


SPEC = register_model_spec(ModelSpec(
    "mlp", MLPSection, build=_build, loss=_loss, sources=_sources,
    tokens_per_example=lambda cfg: 1,      # examples, one "token" each
    problems=_problems))
