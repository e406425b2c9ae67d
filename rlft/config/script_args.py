"""TRL's script-side surface: `ScriptArguments`, dataset mixtures (`DatasetMixtureConfig`,
`get_dataset`) and `TrlParser`, an `HfArgumentParser` that also reads one `--config recipe.yaml`
mixing the fields of every dataclass it parses.

Semantics follow TRL 1.16's documentation: YAML values become the parser's defaults, command-line
options win over them, an `env:` mapping in the YAML sets environment variables, and keys no
dataclass has are returned or refused. rlft adds a "did you mean" to that refusal.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from rlft.errors import ConfigError


@dataclass
class ScriptArguments:
    """Dataset arguments shared by TRL's scripts (`trl grpo`, `trl reward`, recipes)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "a hub dataset id or a local dataset folder "
            "(datasets.load_dataset); ignored with datasets"
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "the dataset's configuration (subset) name"}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "the split to train on"})
    dataset_test_split: str = field(default="test", metadata={"help": "the split to evaluate on"})
    dataset_streaming: bool = field(default=False, metadata={"help": "stream the dataset (needs max_steps)"})
    ignore_bias_buffers: bool = field(
        default=False, metadata={"help": "TRL's DDP debug switch for bool buffers"}
    )

    def __post_init__(self):
        from rlft.config.recipe_types import check_field_types

        # subclasses' fields too (rlft grpo's reward_funcs, train_dataset, ...)
        check_field_types(self)


@dataclass
class DatasetConfig:
    """One dataset of a mixture: the arguments of `datasets.load_dataset`, plus the columns to keep
    and the share of the mixture it should make up."""

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None

    def __post_init__(self):
        from rlft.config.recipe_types import check_field_types

        check_field_types(self)


@dataclass
class DatasetMixtureConfig:
    """Several datasets concatenated into one (a YAML `datasets:` list of DatasetConfig fields)."""

    datasets: list[DatasetConfig] = field(
        default_factory=list, metadata={"help": "the datasets of the mixture"}
    )
    streaming: bool = field(default=False, metadata={"help": "stream every dataset of the mixture"})
    test_split_size: float | None = field(
        default=None, metadata={"help": "hold out this share (or count) as 'test'"}
    )

    def __post_init__(self):
        from rlft.config.recipe_types import check_field_types

        if not isinstance(self.datasets, list | tuple):
            raise ConfigError(f"datasets={self.datasets!r} is a {type(self.datasets).__name__}; it "
                              "takes a list of datasets (a YAML list of mappings with path:, "
                              "split:, ...)")
        self.datasets = [_dataset_config(index, entry) for index, entry in enumerate(self.datasets)]
        check_field_types(self)


def _dataset_config(index: int, entry) -> DatasetConfig:
    """A YAML `datasets:` entry (a mapping) as a DatasetConfig; an unknown key or a missing path is
    named."""
    if not isinstance(entry, dict):
        return entry
    unknown = sorted(set(entry) - set(DatasetConfig.__dataclass_fields__))
    if unknown or "path" not in entry:
        raise ConfigError(
            f"datasets[{index}]: {'unknown keys ' + str(unknown) if unknown else 'no path'}; a "
            f"dataset takes {list(DatasetConfig.__dataclass_fields__)}"
        )
    try:
        return DatasetConfig(**entry)
    except ConfigError as err:
        raise ConfigError(f"datasets[{index}]: {err}") from err


class TrlParser(HfArgumentParser):
    """`HfArgumentParser` plus `--config recipe.yaml`: `parse_args_and_config()` returns one
    instance per dataclass, with the YAML's values as defaults and the command line's on top."""

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        for dataclass_type in dataclass_types:
            if "config" in getattr(dataclass_type, "__dataclass_fields__", {}):
                raise ValueError(
                    f"{dataclass_type.__name__} has a field named 'config', which TrlParser keeps "
                    "for the --config YAML path; rename the field"
                )
        super().__init__(dataclass_types=dataclass_types, **kwargs)

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ):
        args = list(sys.argv[1:] if args is None else args)
        from_yaml: list[str] = []
        if "--config" in args:
            at = args.index("--config")
            if at + 1 >= len(args):
                raise ConfigError("--config needs a YAML file path")
            path = args[at + 1]
            del args[at : at + 2]
            from_yaml = self.set_defaults_with_config(**read_recipe(path))
        output = self.parse_args_into_dataclasses(
            args=args, return_remaining_strings=return_remaining_strings
        )
        if return_remaining_strings:
            from_args = output[-1]
            if separate_remaining_strings:
                return (*output[:-1], from_yaml, from_args)
            return (*output[:-1], from_yaml + from_args)
        if fail_with_unknown_args and from_yaml:
            raise ConfigError(self.unknown_message(from_yaml[::2]))
        return output

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        """Make the values the parser's defaults (required ones optional); returns ['--key',
        'value', ...] for the keys no argument takes."""
        used = set()

        def apply(parser: argparse.ArgumentParser) -> None:
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for sub in action.choices.values():
                        apply(sub)
                elif action.dest in kwargs:
                    action.default, action.required = kwargs[action.dest], False
                    used.add(action.dest)

        apply(self)
        return [item for key, value in kwargs.items() if key not in used for item in (f"--{key}", str(value))]

    def unknown_message(self, options: list[str]) -> str:
        known = [a.dest for a in self._actions if a.dest != "help"]
        hints = []
        for option in options:
            key = option.lstrip("-")
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hints.append(repr(key) + (f" (did you mean {close[0]!r}?)" if close else ""))
        return (
            f"unknown field(s) in the config file: {', '.join(hints)}; remove them or add them to "
            f"one of the dataclasses parsed ({', '.join(t.__name__ for t in self.dataclass_types)})"
        )


def read_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML mapping of field: value; an `env:` mapping in it is applied to os.environ and
    removed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{where}: not valid YAML ({getattr(err, 'problem', err)})") from err
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got "
                          f"{type(values).__name__}")
    env = values.pop("env", {}) or {}
    if not isinstance(env, dict):
        raise ConfigError(f"{path}: env must be a mapping of VARIABLE: value")
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    return values
