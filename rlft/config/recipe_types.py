"""Type checks for the dataclasses a recipe fills besides the training config (`ModelConfig`, the
script arguments, dataset mixtures), the way the configs check theirs (rlft/config/checks.py): a
YAML value of the wrong type (`use_peft: [false]`, a list, is truthy) is an error naming the field,
not a silent change of run.
"""

from __future__ import annotations

from typing import Any

from rlft.config.checks import field_types, type_ok
from rlft.errors import ConfigError


def _shown(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def field_type_errors(instance, overrides: dict[str, Any] | None = None) -> list[str]:
    """One line per field whose value does not fit its annotation (`overrides`: a wider annotation a
    field accepts than it declares, e.g. peft's string form of target modules)."""
    errors = []
    for name, annotation in field_types(type(instance)).items():
        annotation = (overrides or {}).get(name, annotation)
        value = getattr(instance, name)
        if not type_ok(value, annotation):
            shown = _shown(annotation)
            hint = "; write a list as [a, b]" if isinstance(value, str) and "list" in shown else ""
            errors.append(f"{name}={value!r} is a {type(value).__name__}; the field takes "
                          f"{shown}{hint}")
    return errors


def check_field_types(instance, overrides: dict[str, Any] | None = None) -> None:
    """Raise one ConfigError listing every field of `instance` whose value has the wrong type."""
    errors = field_type_errors(instance, overrides)
    if errors:
        raise ConfigError(f"invalid {type(instance).__name__}:\n  - " + "\n  - ".join(errors))
