"""What `rlft grpo`, `rlft rloo`, `rlft reward` and `rlft distillation` run: TRL's `trl grpo` / `trl
rloo` / `trl reward` / `trl distillation` scripts' arguments and steps.

One YAML (`--config run.yaml`) and `--field value` options fill four dataclasses, as in TRL:
the script arguments (data, reward functions), the training config, `ModelConfig` and
`DatasetMixtureConfig`. rlft's script arguments add `train_dataset` / `eval_dataset` (a file, a
folder or a hub id) to TRL's `dataset_name`. A relative path in the YAML that does not exist from
the working directory is read from the YAML's folder (and the run says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlft.config.model_config import (
    ModelConfig,
    get_peft_config,
    get_quantization_config,
    model_init_kwargs,
    teacher_init_kwargs,
)
from rlft.config.script_args import DatasetMixtureConfig, ScriptArguments, TrlParser, read_recipe
from rlft.data.mixtures import get_dataset
from rlft.errors import ConfigError
from rlft.kinds import KINDS, load

# Fields that hold a path, read from the YAML's folder when they do not exist from the working
# directory.
PATH_FIELDS = (
    "model_name_or_path",
    "train_dataset",
    "eval_dataset",
    "dataset_name",
    "chat_template_path",
    "reward_model_name_or_path",
    "teacher_model_name_or_path",
)


@dataclass
class RewardScriptArguments(ScriptArguments):
    """`trl reward`'s (and `trl distillation`'s) script arguments, plus rlft's train_dataset /
    eval_dataset."""

    train_dataset: str | None = field(
        default=None, metadata={"help": "training data: a .jsonl/.json/.csv/.parquet file, a "
                                        "dataset folder, or a hub id"})
    eval_dataset: str | None = field(
        default=None, metadata={"help": "evaluation data, same forms as train_dataset; a mapping "
                                        "name: data evaluates each"})


@dataclass
class GRPOScriptArguments(RewardScriptArguments):
    """`trl grpo`'s script arguments, plus rlft's train_dataset / eval_dataset
    (RewardScriptArguments')."""

    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "a reward model (folder or hub id) used as the first "
                                        "reward function"})
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "reward functions: built-in names, module:function, or a "
                                        "reward model folder"})


def make_parser(kind: str, **kwargs) -> TrlParser:
    """The four argument groups of `rlft <kind>` (rlft/kinds.py)."""
    row = KINDS[kind]
    return TrlParser((load(row.script_args), load(row.config), ModelConfig, DatasetMixtureConfig), **kwargs)


def resolve_paths(values: dict[str, Any], base: Path, notes: list[str]) -> dict[str, Any]:
    """Relative paths that do not exist from the working directory but do from `base` (the YAML's
    folder)."""
    out = dict(values)
    for name in PATH_FIELDS:
        value = out.get(name)
        if not isinstance(value, str) or Path(value).is_absolute() or Path(value).exists():
            continue
        candidate = base / value
        if candidate.exists():
            out[name] = str(candidate)
            notes.append(
                f"{name}: {value!r} does not exist from {Path.cwd()}; using {candidate} (relative "
                "to the config file)"
            )
    return out


def parse_run(
    kind: str,
    argv: list[str] | None = None,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
):
    """(script_args, training_args, model_args, mixture_args, notes) from a YAML and/or options.
    `overrides` (a dict of field: value) win over both, for callers other than the command line."""
    # a misspelt option is an error, never a prefix match
    parser = make_parser(kind, allow_abbrev=False)
    notes: list[str] = []
    values: dict[str, Any] = {}
    if config is not None:
        values = resolve_paths(read_recipe(config), Path(config).resolve().parent, notes)
    values.update(overrides or {})
    unknown = parser.set_defaults_with_config(**values)
    if unknown:
        raise ConfigError(parser.unknown_message(unknown[::2]))
    *parsed, rest = parser.parse_args_into_dataclasses(args=list(argv or []), return_remaining_strings=True)
    if rest:
        raise ConfigError(parser.unknown_message([r for r in rest if r.startswith("--")] or rest))
    return (*parsed, notes)


def recipe_datasets(script_args, training_args, mixture_args):
    """(train, eval) from train_dataset/eval_dataset, dataset_name or the mixture (TRL's
    precedence)."""
    from rlft.data.prompts import load_named_dataset, pick_split

    wants_eval = training_args.eval_strategy != "no"
    if script_args.train_dataset:
        if script_args.dataset_name or mixture_args.datasets:
            raise ConfigError("train_dataset and dataset_name/datasets are both set: give one")
        return script_args.train_dataset, script_args.eval_dataset
    if mixture_args.datasets:
        loaded = get_dataset(mixture_args)
    elif script_args.dataset_name:
        loaded = load_named_dataset(
            script_args.dataset_name, script_args.dataset_config, script_args.dataset_streaming
        )
    else:
        raise ConfigError(
            "no training data: set train_dataset (a file, a folder or a hub id), dataset_name, or "
            "a datasets: list"
        )
    train = pick_split(loaded, script_args.dataset_train_split, "dataset_train_split")
    evaluation = script_args.eval_dataset
    if evaluation is None and wants_eval:
        evaluation = pick_split(
            loaded, script_args.dataset_test_split, "dataset_test_split", " (or eval_strategy: no)"
        )
    return train, evaluation


def build_trainer(kind: str, script_args, training_args, model_args, mixture_args):
    """The trainer `trl grpo` / `trl reward` would build from these arguments."""
    if not model_args.model_name_or_path:
        raise ConfigError("model_name_or_path is not set: give a hub id or a local model folder")
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    train, evaluation = recipe_datasets(script_args, training_args, mixture_args)
    common = dict(
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    row = KINDS[kind]
    build = load(row.recipe) if row.recipe else plain
    return build(load(row.trainer), script_args, training_args, model_args, **common)


def plain(trainer, script_args, training_args, model_args, **common):
    """`trl reward`'s trainer: the model and the common arguments (args, datasets, peft and
    quantization)."""
    return trainer(model_args.model_name_or_path, **common)


def with_rewards(trainer, script_args, training_args, model_args, **common):
    """`trl grpo`'s / `trl rloo`'s trainer: the reward model (reward_model_name_or_path) first, then
    reward_funcs."""
    rewards = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    return trainer(model_args.model_name_or_path, reward_funcs=rewards + list(script_args.reward_funcs or []),
                   **common)


def with_teacher(trainer, script_args, training_args, model_args, **common):
    """`trl distillation`'s trainer: the teacher from teacher_model_name_or_path, loaded with
    ModelConfig's attention and dtype, then teacher_model_init_kwargs (a served teacher loads
    none)."""
    training_args.teacher_model_init_kwargs = teacher_init_kwargs(model_args, training_args)
    return trainer(model_args.model_name_or_path, training_args.teacher_model_name_or_path, **common)
