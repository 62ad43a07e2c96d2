"""`--help-config`: every key with its default and description, as YAML."""

from __future__ import annotations

import typing
from typing import Literal

import yaml
from pydantic import BaseModel

from mpmd.recipes import registry
from mpmd.recipes.config.loading import sections_of
from mpmd.recipes.config.schema import VARIANTS, Config
from mpmd.schedules import core as schedules


def _choices(field) -> list[str] | None:
    """The values a str key may take when a registry or an option record holds them."""
    source = (field.json_schema_extra or {}).get("one_of") if isinstance(field.json_schema_extra, dict) else None
    if source == "model":
        return list(registry.model_specs())
    if source == "cluster":
        return list(registry.backend_specs())
    if source == "data":
        return list(registry.data_sources())
    if source == "schedule":
        return list(schedules.SCHEDULES)
    if source == "on_loss":
        from mpmd.train.options import ON_LOSS

        return list(ON_LOSS)
    if source == "on_nonfinite":
        from mpmd.train.options import ON_NONFINITE

        return list(ON_NONFINITE)
    if typing.get_origin(field.annotation) is Literal:
        return list(typing.get_args(field.annotation))
    return None


def _allowed(field) -> str:
    choices = _choices(field)
    return " (one of: " + ", ".join(map(str, choices)) + ")" if choices else ""


def _describe_field(name: str, field, indent: str) -> str:
    value = yaml.safe_dump(field.default, default_flow_style=True).strip()
    value = value.removesuffix("\n...").removesuffix("...").strip()
    return f"{indent}{name}: {value}  # {field.description}{_allowed(field)}"


def describe(model: type[BaseModel] = Config, indent: str = "", base: type[BaseModel] | None = None) -> str:
    """Every key with its default and description, as YAML (the defaults file nobody edits);
    model.* and cluster.* as the default family and backend take them, and as comments what
    each other registered one adds."""
    lines = []
    for name, field in model.model_fields.items():
        sections = sections_of(model, name)
        if not sections:
            # A variant's kind (backend) is described as its base section's: every registered one.
            choice = base.model_fields[name] if base is not None and name in base.model_fields else None
            if choice is not None and _choices(choice):
                field = field.merge_field_infos(
                    field, description=choice.description, json_schema_extra=choice.json_schema_extra
                )
            lines.append(_describe_field(name, field, indent))
            continue
        lines.append(f"{indent}{name}:")
        lines.append(
            describe(sections[0], indent + "  ", VARIANTS[name][1] if model is Config and name in VARIANTS else None)
        )
        for other in sections[1:]:
            key = VARIANTS[name][0]
            added = [(k, f) for k, f in other.model_fields.items() if k not in sections[0].model_fields]
            lacks = [k for k in sections[0].model_fields if k not in other.model_fields]
            lines.append(
                f"{indent}  # {key}: {other.model_fields[key].default}"
                + (f" takes none of {', '.join(lacks)}" if lacks else "")
                + (("," if lacks else "") + " adds:" if added else "")
            )
            for k, f in added:
                inner = sections_of(other, k)  # a section of its own (model.moe)
                if inner:
                    lines.append(f"{indent}  #   {k}:  # {f.description}")
                    lines += [f"{indent}  #   {line}" for line in describe(inner[0], "  ").splitlines()]
                else:
                    lines.append(f"{indent}  #   " + _describe_field(k, f, ""))
    return "\n".join(lines)
