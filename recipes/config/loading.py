"""Reading a config: the YAML file's overrides, then `key=value` ones, checked key by key
against the schema (an unknown key is refused with the nearest valid one suggested, a key
another family or backend takes names those that take it), then validated, every problem
in one ConfigError; and the resolved config written back (`dump`).
"""

from __future__ import annotations

import copy
import difflib
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mpmd.recipes import registry
from mpmd.recipes.config.schema import MODULE, VARIANTS, Config, ConfigError, default_elsewhere, variant


# PyYAML follows YAML 1.1, where "3e-3" (no dot) is a string; accept it as the float it means.
# Parsed by libyaml where PyYAML has it (8x faster: a config loads in ~0.06 ms, not ~0.5), and
# by the pure-Python parser on an error, whose message shows the line and a caret.
class _Loader(yaml.SafeLoader):
    pass


class _FastLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    pass


for _loader in (_Loader, _FastLoader):
    _loader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d[\d_]*)(?:\.[\d_]*)?[eE][-+]?\d+$"), list("-+0123456789")
    )


def _yaml(text: str) -> Any:
    """`text` parsed as YAML 1.1 (and 3e-3 a float); yaml.YAMLError, as the pure-Python parser
    words it, when it is not YAML."""
    try:
        return yaml.load(text, Loader=_FastLoader)
    except yaml.YAMLError:
        return yaml.load(text, Loader=_Loader)  # raises again, with the line and a caret


def _parse_value(text: str) -> Any:
    return _yaml(text)


def sections_of(model: type[BaseModel], name: str) -> list[type[BaseModel]]:
    """The section classes field `name` of `model` may hold: every registered variant of model
    and cluster (the default one first), one class for another section, none for a value."""
    if model is Config and name in VARIANTS:
        default = variant(name, {})
        return [default] + [spec.section for spec in VARIANTS[name][2]().values() if spec.section is not default]
    annotation = model.model_fields[name].annotation
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def leaf_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included: ['run_dir', 'model', 'model.kind', ..]
    (every family's and backend's); the keys of a list of sections' entries as 'mesh.stages[].data'."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for section in sections_of(model, name):
            keys += [k for k in leaf_keys(section, f"{prefix}{name}.") if k not in keys]
        for arg in typing.get_args(field.annotation):  # list[Section] | None
            entry = (typing.get_args(arg) or (None,))[0] if typing.get_origin(arg) is list else None
            if isinstance(entry, type) and issubclass(entry, BaseModel):
                keys += leaf_keys(entry, f"{prefix}{name}[].")
    return keys


def _not_taken(section: str, chosen: type[BaseModel], values: dict) -> list[str]:
    """'model.num_kv_heads is only used by model.kind='llama', got kind 'gpt'' for each key of
    values that the chosen family's (backend's) section lacks and another one has, unless the
    value is that one's default (then the key is dropped from values)."""
    key, _, specs = VARIANTS[section]
    out = []
    for name in list(values):
        if name in chosen.model_fields:
            continue
        users = [n for n, spec in specs().items() if name in spec.section.model_fields]
        if users and default_elsewhere(section, name, values[name]):
            del values[name]
        elif users:
            out.append(
                f"{section}.{name} is only used by {section}.{key}={registry.one_of(users)}, "
                f"got {key} '{chosen.model_fields[key].default}'"
            )
    return out


def _unknown_key(key: str) -> ConfigError:
    index = re.search(r"\[\d+\]", key)  # an entry of a list of sections: mesh.stages[1].x
    close = difflib.get_close_matches(re.sub(r"\[\d+\]", "[]", key), leaf_keys(), n=1, cutoff=0.6)
    close = [c.replace("[]", index.group(0)) for c in close] if index else close
    hint = f"; did you mean '{close[0]}'?" if close else "; run with --help-config for all keys"
    return ConfigError(f"unknown key '{key}'{hint}")


def _check_keys(values: dict, model: type[BaseModel] = Config, prefix: str = "") -> None:
    """Rejects unknown keys anywhere in values, before pydantic, so the suggestion is ours; and
    the keys of model.* (cluster.*) that model.kind's family (cluster.backend's) does not take,
    naming those that do."""
    for key, value in values.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            raise _unknown_key(f"{prefix}{key}")
        sections = sections_of(model, key)
        if not sections:
            if isinstance(value, dict) and typing.get_origin(field.annotation) is not dict:
                raise ConfigError(
                    f"'{prefix}{key}' is a value, not a section: cannot set '{prefix}{key}.{next(iter(value), '')}'"
                )
            continue
        if not isinstance(value, dict):
            raise ConfigError(
                f"'{prefix}{key}' is a section, not a value: set its keys, "
                f"e.g. {prefix}{key}.{next(iter(sections[0].model_fields))}=..."
            )
        section = sections[0]
        if model is Config and key in VARIANTS:
            try:
                section = variant(key, value)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            problems = _not_taken(key, section, value)
            if problems:
                raise ConfigError("\n".join(problems))
        _check_keys(value, section, f"{prefix}{key}.")


def _set(values: dict, key: str, value: Any) -> None:
    """values[a][b][c] = value for key 'a.b.c', creating sections; a leaf is never a section."""
    *sections, leaf = key.split(".")
    node = values
    for depth, section in enumerate(sections):
        child = node.setdefault(section, {})
        if child is None:
            child = node[section] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"'{'.'.join(sections[: depth + 1])}' is a value, not a section: cannot set '{key}'")
        node = child
    node[leaf] = value


_TYPE_WORDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "int_from_float": "an integer",
}
_BOUND_WORDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _describe_error(error: dict) -> str:
    """One pydantic error -> 'train.steps must be an integer, got 'abc''."""
    key = ""
    for part in error["loc"]:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    kind, got, ctx = error["type"], error.get("input"), error.get("ctx", {})
    if kind == "value_error":  # our cross-field checks: already full sentences
        return str(ctx.get("error", error["msg"]))
    if kind == "extra_forbidden":
        return str(_unknown_key(key))
    if kind == "int_too_large":  # recipes/config/sections.py's _ints_fit_int64, at the section
        key = f"{key}.{ctx['key']}" if key else ctx["key"]
        return f"{key}={ctx['value']} is beyond any size a run can have (at most 2**63 - 1)"
    if kind in _TYPE_WORDS:
        return f"{key} must be {_TYPE_WORDS[kind]}, got {got!r}"
    if kind == "literal_error":
        return f"{key} must be one of {ctx['expected']}, got {got!r}"
    for bound, word in _BOUND_WORDS.items():
        if kind == bound:
            return f"{key} must be {word} {next(iter(ctx.values()))}, got {got!r}"
    return f"{key}: {error['msg']}, got {got!r}"


def validate(values: dict) -> Config:
    """A nested dict of overrides -> Config, or ConfigError listing every problem. The
    modules under `imports` are imported first: they may register what the rest names."""
    values = copy.deepcopy(values)  # _check_keys drops keys it ignores
    imports = values.get("imports", [])
    if isinstance(imports, list) and all(isinstance(name, str) and MODULE.match(name) for name in imports):
        for i, name in enumerate(imports):
            registry.import_module(name, f"imports[{i}]")
    _check_keys(values)
    try:
        return Config.model_validate(values)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe_error(err) for err in e.errors())) from None


def read_text(path: str | Path, what: str, kind: str = "") -> str:
    """A user's UTF-8 file, or ConfigError saying it is missing, unreadable or not UTF-8 ('config
    file' for `what`; `kind` ends the last message: '; a config is YAML')."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} '{path}': {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {e.start}: {e.reason}){kind}") from None


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    text = read_text(path, "config file", "; a config is YAML")
    try:
        values = _yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
    if values is None:  # an empty file, or only comments: no overrides
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values, got a {type(values).__name__}")
    # A section with all its keys commented out parses as null: treat it as empty.
    return {
        k: ({} if v is None and k in Config.model_fields and k not in ("imports", "run_dir", "seed") else v)
        for k, v in values.items()
    }


def load(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- YAML file at path (if any) <- 'dotted.key=value' overrides, validated.

    Values are parsed as YAML: `train.steps=5`, `optimizer.max_grad_norm=null`,
    `log.trace_steps=[1,2]`, `log.tensorboard=false`, `optimizer.lr=1e-3`.

    With model.init_from set, the model keys that it gives (the family section's FROM_INIT:
    sizes and the like) yield to it where the file wrote them (the file is a recipe for
    random init too); one line on stderr names them. Typed as an override, such a key must
    agree with what init_from gives.
    """
    values = values_of(path, overrides)
    if dropped := yield_to_init_from(values, overrides):
        print(
            f"model.init_from={values['model']['init_from']!r} gives {', '.join(f'model.{k}' for k in dropped)}: "
            f"{path}'s values for them are not used",
            file=sys.stderr,
        )
    return validate(values)


def yield_to_init_from(values: dict, overrides: typing.Sequence[str]) -> list[str]:
    """Removes from `values` the model keys model.init_from gives (its section's FROM_INIT)
    that no override typed; returns them. Nothing without init_from or an unknown kind (the
    validation then says what is wrong)."""
    model = values.get("model")
    if not isinstance(model, dict) or model.get("init_from") is None:
        return []
    try:
        section = variant("model", model)
    except ValueError:
        return []
    typed = {o.partition("=")[0].strip() for o in overrides}
    dropped = [k for k in getattr(section, "FROM_INIT", ()) if k in model and f"model.{k}" not in typed]
    for key in dropped:
        del model[key]
    return dropped


def values_of(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> dict:
    """The nested dict of overrides `load` validates: the YAML file's, then the key=values."""
    values = _read_yaml(path) if path is not None else {}
    for override in overrides:
        key, sep, text = override.partition("=")
        key = key.strip()
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*", key):
            raise ConfigError(f"override {override!r} must look like key=value, e.g. train.steps=100")
        try:
            value = _parse_value(text)
        except yaml.YAMLError:
            raise ConfigError(
                f"override {override!r}: value {text!r} is not valid YAML (quote strings that contain ':' or brackets)"
            ) from None
        _set(values, key, value)
    return values


def dump(config: Config, path: str | Path) -> Path:
    """Writes the fully resolved config as YAML that `load` reads back to an equal Config."""
    from mpmd.recipes.files import publish

    header = f"# resolved mpmd config (hash {config.hash()}); every key, defaults included\n"
    return publish(path, header + yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
