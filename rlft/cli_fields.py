"""Every config field as a `rlft grpo` / `rlft reward` option, with its type, default and one line of help
(rlft/config_help.py), so `--help` documents what a YAML may hold and any field can be set without one."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

PREFIX = "field__"  # argparse destinations of config fields, apart from the command's own options


def _is_list(annotation: Any) -> bool:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return any(typing.get_origin(a) is list or a is list for a in (typing.get_args(annotation) if union
                                                                    else (annotation,)))


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def add_config_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    from rlft.config import field_types
    from rlft.config_help import SECTIONS

    types_, fields = field_types(cls), {f.name: f for f in dataclasses.fields(cls)}
    for title, helps in SECTIONS.items():
        names = [n for n in helps if n in fields and not fields[n].metadata.get("trl_compat")]
        if not names:
            continue
        group = parser.add_argument_group(title)
        for name in names:
            listed = _is_list(types_[name])
            group.add_argument(f"--{name}", dest=PREFIX + name, default=argparse.SUPPRESS,
                               nargs="+" if listed else "?", const=None if listed else "true",
                               metavar="VALUE", help=f"{helps[name]} [{_type_name(types_[name])}, default "
                                                     f"{_default(fields[name])!r}]".replace("%", "%%"))
    compat = sorted(n for n, f in fields.items() if f.metadata.get("trl_compat"))
    parser.epilog = (f"Also accepted, as --field value or in the YAML: TRL's other {cls.__name__} fields ("
                     f"{len(compat)}), which rlft does not implement; setting one away from TRL's default is an "
                     "error naming it: " + ", ".join(compat))


def field_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields given as options, as strings the config reads like YAML values: a list option's several
    words become one YAML list (`--reward_weights 1 0.5` -> "[1, 0.5]", typed by the field)."""
    values = {}
    for key, value in vars(args).items():
        if key.startswith(PREFIX):
            if isinstance(value, list):
                value = value[0] if len(value) == 1 else "[" + ", ".join(value) + "]"
            values[key[len(PREFIX):]] = value
    return values
