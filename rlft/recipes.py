"""What `rlft grpo`, `rlft rloo`, `rlft reward` and `rlft distillation` run: TRL's `trl grpo` / `trl rloo` /
`trl reward` / `trl distillation` scripts' arguments and steps.

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

from rlft.config import DistillationConfig, GRPOConfig, RewardConfig, RLOOConfig
from rlft.errors import ConfigError
from rlft.model_config import ModelConfig, get_peft_config, get_quantization_config
from rlft.script_args import DatasetMixtureConfig, ScriptArguments, TrlParser, get_dataset, read_recipe

# Fields that hold a path, read from the YAML's folder when they do not exist from the working directory.
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
class GRPOScriptArguments(ScriptArguments):
    """`trl grpo`'s script arguments, plus rlft's train_dataset / eval_dataset."""

    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "a reward model (folder or hub id) used as the first reward "
                                        "function"})
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "reward functions: built-in names, module:function, or a reward "
                                        "model folder"})
    train_dataset: str | None = field(
        default=None, metadata={"help": "training data: a .jsonl/.json/.csv/.parquet file, a dataset "
                                        "folder, or a hub id"})
    eval_dataset: str | None = field(
        default=None, metadata={"help": "evaluation data, same forms as train_dataset; a mapping name: "
                                        "data evaluates each"})


@dataclass
class RewardScriptArguments(ScriptArguments):
    """`trl reward`'s (and `trl distillation`'s) script arguments, plus rlft's train_dataset /
    eval_dataset."""

    train_dataset: str | None = field(
        default=None, metadata={"help": "training data: a .jsonl/.json/.csv/.parquet file, a dataset "
                                        "folder, or a hub id"})
    eval_dataset: str | None = field(
        default=None, metadata={"help": "evaluation data, same forms as train_dataset; a mapping name: "
                                        "data evaluates each"})


KINDS = {"grpo": (GRPOScriptArguments, GRPOConfig), "reward": (RewardScriptArguments, RewardConfig),
         "rloo": (GRPOScriptArguments, RLOOConfig),
         "distillation": (RewardScriptArguments, DistillationConfig)}


def make_parser(kind: str, **kwargs) -> TrlParser:
    script, config = KINDS[kind]
    return TrlParser((script, config, ModelConfig, DatasetMixtureConfig), **kwargs)


def resolve_paths(values: dict[str, Any], base: Path, notes: list[str]) -> dict[str, Any]:
    """Relative paths that do not exist from the working directory but do from `base` (the YAML's folder)."""
    out = dict(values)
    for name in PATH_FIELDS:
        value = out.get(name)
        if not isinstance(value, str) or Path(value).is_absolute() or Path(value).exists():
            continue
        candidate = base / value
        if candidate.exists():
            out[name] = str(candidate)
            notes.append(
                f"{name}: {value!r} does not exist from {Path.cwd()}; using {candidate} (relative to the "
                "config file)"
            )
    return out


def parse_run(
    kind: str,
    argv: list[str] | None = None,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
):
    """(script_args, training_args, model_args, mixture_args, notes) from a YAML and/or options. `overrides`
    (a dict of field: value) win over both, for callers other than the command line."""
    parser = make_parser(kind, allow_abbrev=False)  # a misspelt option is an error, never a prefix match
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


def _loading_kwargs(model_args: ModelConfig) -> dict[str, Any]:
    """Attention and dtype from ModelConfig, as TRL's scripts pass them to both models."""
    kwargs: dict[str, Any] = {}
    if model_args.attn_implementation is not None:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.dtype not in (None, "auto"):
        kwargs["dtype"] = model_args.dtype
    return kwargs


def model_init_kwargs(model_args: ModelConfig, training_args) -> dict | None:
    """TRL's scripts' model_init_kwargs: revision, attention, dtype from ModelConfig, then training_args'."""
    kwargs = _loading_kwargs(model_args)
    if model_args.model_revision != "main":
        kwargs["revision"] = model_args.model_revision
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs or None


def teacher_init_kwargs(model_args: ModelConfig, training_args) -> dict | None:
    """`trl distillation`'s teacher kwargs: attention and dtype from ModelConfig, then
    teacher_model_init_kwargs (the revision is teacher_model_revision's); a served teacher loads none."""
    if training_args.teacher_model_server_url:
        return training_args.teacher_model_init_kwargs
    kwargs = {**_loading_kwargs(model_args), **(training_args.teacher_model_init_kwargs or {})}
    return kwargs or None


def recipe_datasets(script_args, training_args, mixture_args):
    """(train, eval) from train_dataset/eval_dataset, dataset_name or the mixture (TRL's precedence)."""
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
            "no training data: set train_dataset (a file, a folder or a hub id), dataset_name, or a "
            "datasets: list"
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
    if kind == "reward":
        from rlft.train.reward import RewardTrainer

        return RewardTrainer(model_args.model_name_or_path, **common)
    if kind == "distillation":
        from rlft.train.distillation import DistillationTrainer

        training_args.teacher_model_init_kwargs = teacher_init_kwargs(model_args, training_args)
        return DistillationTrainer(model_args.model_name_or_path, training_args.teacher_model_name_or_path,
                                   **common)
    from rlft.train.grpo import GRPOTrainer
    from rlft.train.rloo import RLOOTrainer

    rewards = (
        [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    ) + list(script_args.reward_funcs or [])
    trainer = RLOOTrainer if kind == "rloo" else GRPOTrainer
    return trainer(model_args.model_name_or_path, reward_funcs=rewards, **common)
