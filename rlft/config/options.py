"""One declaration per config field: `option(default, help, check=..., resume=..., rlft=...,
no_effect=..., refused=...)` is the only place a field's facts are written down. Every table the
code needs is a query of the declarations:

- `options(cls)`: name -> `Facts` for every field of a config class that has any. A subclass's
  declaration wins over its base's; a subclass that only changes a default keeps its base's facts.
  Fields transformers declares (TrainingArguments') get theirs from `inherited_facts`, a class
  attribute beside the class that states them (rlft/config/common.py for every config, a subclass
  for its own differences);
- `rlft_fields(cls)`: rlft's additions to TRL's fields (docs/migration.md says why each exists);
- `may_change(cls)`: what a resumed run may change (it does not touch what is computed up to the
  resumed step; a field with no effect may change too);
- `dict_fields(cls)`: the fields the command line and YAML may give as a JSON / YAML mapping string
  (their annotation takes a dict);
- `no_effect(cls)` / `refused(cls)`: TRL's fields rlft does not act on, with the reason (accepted
  and noted at the start / refused away from their default: rlft/config/compat.py);
- `option_problems(cfg)`: each field's own check, one line per problem. The rules that relate
  several fields stay with their class (`_check`, rlft/config/checks.py).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

# the metadata key `option` uses; config_class moves it out (HfArgumentParser passes the
_KEY = "rlft_facts"
# metadata to argparse's add_argument, which takes "help" only)


@dataclass(frozen=True)
class Check:
    """A test of one field's value: `problem(name, value)` is None or the line that says what is
    wrong."""

    test: Callable[[Any], bool]
    says: str | Callable[[], str]
    none_ok: bool = True  # None means "unset" for most fields: only one_of tests it

    def problem(self, name: str, value: Any) -> str | None:
        value = getattr(value, "value", value)  # transformers' str enums
        if (value is None and self.none_ok) or self.test(value):
            return None
        return f"{name}={value!r} {self.says() if callable(self.says) else self.says}"


POSITIVE = Check(lambda v: v > 0, "must be > 0")
NON_NEGATIVE = Check(lambda v: v >= 0, "must be >= 0")


def between(low: float, high: float, *, open_low: bool = False, note: str = "") -> Check:
    """low <= value <= high (low < value where `open_low`); `note` follows the bounds in the
    message."""
    shown = f"{'(' if open_low else '['}{low:g}, {high:g}]"
    return Check(lambda v: (low < v if open_low else low <= v) and v <= high, f"must be in {shown}{note}")


def above(low: float, note: str = "") -> Check:
    return Check(lambda v: v > low, f"must be > {low:g}{note}")


def one_of(allowed: Any) -> Check:
    """The value is one of `allowed`: a collection read at check time (a registry a user may add
    to), or a function returning one."""
    def names() -> tuple:
        return tuple(allowed() if callable(allowed) else allowed)

    return Check(lambda v: v in names(),
                 lambda: "is not allowed; choose one of " + ", ".join(map(repr, names())), none_ok=False)


@dataclass(frozen=True)
class Facts:
    """What rlft knows about a field beside its type, default and help."""

    check: Check | None = None
    resume: bool = False  # True: a resumed run may change it
    rlft: bool = False  # True: rlft's own field, not TRL's or transformers'
    # why it changes nothing in rlft (accepted at any value, noted at the start)
    no_effect: str | None = None
    refused: str | None = None  # why a value away from the default is refused


def option(default: Any = MISSING, help: str | None = None, *, default_factory: Any = MISSING,
           check: Check | None = None, resume: bool = False, rlft: bool = False, no_effect: str | None = None,
           refused: str | None = None) -> Any:
    """A dataclass field with its help and its facts (see the module's docstring)."""
    if help is None and (no_effect or refused):
        help = f"no effect: {no_effect}" if no_effect else f"not supported: {refused}"
    metadata: dict[str, Any] = {"help": help} if help else {}
    facts = Facts(check, resume, rlft, no_effect, refused)
    if facts != Facts():  # a declaration with no facts keeps its base class's
        metadata[_KEY] = facts
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def take_facts(cls: type) -> None:
    """Move the facts `option` put in the metadata of the fields `cls` declares to
    `cls._declared_facts` (config_class calls it once the dataclass is made)."""
    declared = {}
    for f in cls.__dataclass_fields__.values():
        if _KEY in f.metadata:
            declared[f.name] = f.metadata[_KEY]
            f.metadata = types.MappingProxyType({k: v for k, v in f.metadata.items() if k != _KEY})
    cls._declared_facts = declared


def _merge(base: Facts | None, new: Facts) -> Facts:
    """A subclass's facts over its base's: what it states replaces, what it leaves unset is kept."""
    if base is None:
        return new
    given = {f.name: getattr(new, f.name) for f in dataclasses.fields(Facts)
             if getattr(new, f.name) not in (None, False)}
    return dataclasses.replace(base, **given)


@functools.cache
def options(cls: type) -> dict[str, Facts]:
    """name -> Facts for each field of `cls` that has facts: the nearest class's own declaration or
    its `inherited_facts` entry, merged down the class hierarchy (`_merge`)."""
    found: dict[str, Facts] = {}
    for klass in reversed(cls.__mro__):
        for table in (klass.__dict__.get("inherited_facts", {}), klass.__dict__.get("_declared_facts", {})):
            for name, facts in table.items():
                found[name] = _merge(found.get(name), facts)
    names = {f.name for f in dataclasses.fields(cls)}
    return {name: facts for name, facts in found.items() if name in names}


def rlft_fields(cls: type) -> frozenset[str]:
    return frozenset(name for name, facts in options(cls).items() if facts.rlft)


def may_change(cls: type) -> frozenset[str]:
    return frozenset(name for name, facts in options(cls).items()
                     if facts.resume or (facts.no_effect and not facts.refused))


def no_effect(cls: type) -> dict[str, str]:
    return {name: facts.no_effect for name, facts in options(cls).items()
            if facts.no_effect and not facts.refused}


def refused(cls: type) -> dict[str, str]:
    return {name: facts.refused for name, facts in options(cls).items() if facts.refused}


# TrainingArguments' fields that __post_init__ turns into transformers' own objects (enums,
# configs).
CONVERTED_BY_TRANSFORMERS = frozenset({
    "accelerator_config", "debug", "include_num_input_tokens_seen", "report_to", "fsdp", "fsdp_config",
    "deepspeed", "parallelism_config", "optim", "lr_scheduler_type", "logging_strategy", "save_strategy",
    "eval_strategy", "hub_strategy",
})


def _takes_dict(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_takes_dict(a) for a in typing.get_args(annotation))
    return (origin or annotation) is dict


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Every init field's annotation (transformers' own included), from the classes' annotations:
    HfArgumentParser rewrites `Field.type` in place when it builds a parser."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


@functools.cache
def dict_fields(cls: type) -> tuple[str, ...]:
    """The fields a JSON / YAML mapping string stands for (their annotation takes a dict), except
    those transformers converts itself (where a string is a file's path)."""
    return tuple(name for name, annotation in field_types(cls).items()
                 if _takes_dict(annotation) and name not in CONVERTED_BY_TRANSFORMERS)


def option_problems(cfg: Any) -> list[str]:
    """One line per field whose value fails its own check."""
    problems = []
    for name, facts in options(type(cfg)).items():
        if facts.check is not None:
            problem = facts.check.problem(name, getattr(cfg, name))
            if problem:
                problems.append(problem)
    return problems
