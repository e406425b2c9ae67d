"""Configs from YAML files and `--field value` overrides, and back to YAML.

Values are coerced to each field's type (YAML reads '1e-5' as a string); an unknown key is an error
with the nearest known key and its one-line help.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlft.config import ConfigError, TrainConfig, field_types
from rlft.config_help import FIELD_HELP


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Turn YAML/CLI values into the field's type (YAML reads '1e-5' as a string)."""
    if value is None:
        return None
    if annotation is Any:
        return yaml.safe_load(value) if isinstance(value, str) else value
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if is_union else [annotation]
    if isinstance(value, str):
        if value.lower() in ("null", "none", "~") and type(None) in typing.get_args(annotation):
            return None
        if str in args:
            return value
        for target in args:
            if target is bool and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if target in (int, float):
                try:
                    return target(value)
                except ValueError:
                    continue
            if typing.get_origin(target) in (list, dict) or target in (list, dict):
                parsed = yaml.safe_load(value)
                if isinstance(parsed, list | dict):
                    return parsed
                return [x for x in value.split(",") if x]
        raise ConfigError(f"{name}={value!r} cannot be read as {annotation}")
    if float in args and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if any(typing.get_origin(a) is list for a in args) and isinstance(value, str | tuple):
        return list(value) if isinstance(value, tuple) else [value]
    return value


def from_dict(cls: type[TrainConfig], values: dict[str, Any]) -> TrainConfig:
    """Build and validate a config; unknown keys raise with the nearest known key."""
    types_ = field_types(cls)
    unknown = [key for key in values if key not in types_]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(types_), n=1, cutoff=0.6)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}: {FIELD_HELP.get(close[0], 'a TRL field')}?)"
                                        if close else ""))
        raise ConfigError(f"unknown {cls.__name__} field(s): {', '.join(hints)}")
    kwargs = {key: _coerce(key, value, types_[key]) for key, value in values.items()}
    return cls(**kwargs)


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """['--learning_rate', '1e-5', '--beta=0.04'] -> {'learning_rate': '1e-5', 'beta': '0.04'}."""
    overrides: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: overrides look like --field value")
        key = token[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value, i = tokens[i + 1], i + 2
        else:
            value, i = "true", i + 1
        overrides[key] = value
    return overrides


def load_config(cls: type[TrainConfig], path: str | Path | None, overrides: dict[str, Any] | None = None):
    """YAML file (optional) + overrides -> validated config."""
    values: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"{path}:{where}: not valid YAML ({getattr(err, 'problem', err)})") from err
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of field: value, got {type(loaded).__name__}")
        values.update(loaded)
    values.update(overrides or {})
    return from_dict(cls, values)


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The fields rlft implements plus any TRL field set away from its default."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("trl_compat") and value == (f.default if f.default is not dataclasses.MISSING
                                                       else f.default_factory()):
            continue
        out[f.name] = value
    return out


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
