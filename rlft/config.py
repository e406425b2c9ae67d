"""Run configuration: `GRPOConfig` and `RewardConfig`, YAML loading, overrides and validation.

Field names follow TRL's (`GRPOConfig`, `RewardConfig`, `ModelConfig`) wherever TRL has a
name for the thing, so a TRL user's arguments carry over. Defaults run on a CPU-only
machine. Every check lives in `validate()`; an error names the field, the value and what
is allowed, and an unknown key gets a "did you mean" suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
SCALE_REWARDS = ("group", "batch", "none")
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static", "offloaded", "offloaded_static")  # transformers' names
IS_LEVELS = ("token", "sequence")
DTYPES = ("auto", "float32", "bfloat16", "float16")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr")
TRUNCATION = ("keep_start", "keep_end", "error")
OPTIMIZERS = ("adamw_torch", "sgd")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which field and what to do."""


@dataclass
class TrainConfig:
    """Fields shared by GRPO and reward-model training (TRL / transformers names)."""

    model_name_or_path: str | None = None
    output_dir: str = "runs/rlft"
    train_dataset: str | None = None
    eval_dataset: str | None = None
    seed: int = 42
    learning_rate: float = 1e-6
    optim: str = "adamw_torch"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_steps: int = -1
    num_train_epochs: float = 1.0
    logging_steps: int = 10
    save_steps: int = 500
    save_total_limit: int | None = None
    eval_steps: int | None = None
    eval_on_start: bool = False
    report_to: list[str] = field(default_factory=lambda: ["none"])
    run_name: str | None = None
    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict | None = None
    dtype: str = "auto"
    bf16: bool | None = None
    fp16: bool | None = None
    disable_tqdm: bool = False
    # LoRA, as TRL's ModelConfig names it.
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | str = "all-linear"
    lora_task_type: str | None = None


@dataclass
class GRPOConfig(TrainConfig):
    """GRPO run. `per_device_train_batch_size` counts completions, as in TRL."""

    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None
    num_generations: int = 8
    max_prompt_length: int | None = 512
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None  # passed to generate, e.g. "static"; None: transformers' dynamic cache
    shared_prompt_prefill: bool = True  # dynamic cache: prefill each prompt once, not num_generations times
    beta: float = 0.0
    kl_estimator: str = "k3"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    allow_nan_rewards: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    logprob_chunk_size: int = 1024
    log_completions: bool = True
    num_completions_to_log: int = 8
    zero_signal_warning_steps: int = 5


@dataclass
class RewardConfig(TrainConfig):
    """Bradley-Terry reward-model run on chosen/rejected pairs."""

    learning_rate: float = 1e-4
    max_length: int | None = 1024
    truncation: str = "keep_start"
    center_rewards_coefficient: float | None = None
    max_nonfinite_steps: int = 3
    disable_dropout: bool = True


def _enum(errors: list[str], cfg: Any, name: str, allowed: tuple) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        errors.append(f"{name}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")


def _positive(errors: list[str], cfg: Any, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is None:
            continue
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            errors.append(f"{name}={value!r} must be {bound}")


def _validate_common(cfg: TrainConfig, errors: list[str]) -> None:
    _enum(errors, cfg, "dtype", DTYPES)
    _enum(errors, cfg, "lr_scheduler_type", SCHEDULERS)
    _enum(errors, cfg, "optim", OPTIMIZERS)
    _positive(errors, cfg, "learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size",
              "gradient_accumulation_steps", "logging_steps", "save_steps", "num_train_epochs", "lora_r")
    _positive(errors, cfg, "weight_decay", "max_grad_norm", "warmup_ratio", "warmup_steps", allow_zero=True)
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        errors.append(f"max_steps={cfg.max_steps!r} must be > 0, or -1 to run num_train_epochs")
    if cfg.bf16 and cfg.fp16:
        errors.append("bf16=True and fp16=True together: pick one (or set dtype)")
    if not 0 <= cfg.lora_dropout < 1:
        errors.append(f"lora_dropout={cfg.lora_dropout!r} must be in [0, 1)")
    if cfg.eval_steps is not None and cfg.eval_steps <= 0:
        errors.append(f"eval_steps={cfg.eval_steps!r} must be > 0 or null")


def _validate_grpo(cfg: GRPOConfig, errors: list[str]) -> None:
    for name, allowed in [("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                          ("importance_sampling_level", IS_LEVELS), ("kl_estimator", KL_ESTIMATORS),
                          ("multi_objective_aggregation", AGGREGATIONS),
                          ("cache_implementation", CACHE_IMPLEMENTATIONS)]:
        _enum(errors, cfg, name, allowed)
    if cfg.num_generations < 2:
        errors.append(f"num_generations={cfg.num_generations!r} must be >= 2: group-relative advantages "
                      "compare completions of the same prompt, so a group of 1 has no signal")
    _positive(errors, cfg, "max_completion_length", "max_prompt_length", "temperature", "num_iterations",
              "logprob_chunk_size", "num_completions_to_log", "sapo_temperature_pos", "sapo_temperature_neg")
    _positive(errors, cfg, "beta", "epsilon", "epsilon_high", allow_zero=True)
    if not 0 < cfg.top_p <= 1:
        errors.append(f"top_p={cfg.top_p!r} must be in (0, 1]")
    if cfg.reward_weights is not None and cfg.reward_funcs and len(cfg.reward_weights) != len(cfg.reward_funcs):
        errors.append(f"reward_weights has {len(cfg.reward_weights)} values but reward_funcs has "
                      f"{len(cfg.reward_funcs)}: give one weight per reward function")
    generation_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    if cfg.num_generations >= 2 and generation_batch % cfg.num_generations:
        valid = [cfg.num_generations * k for k in range(1, 5)]
        errors.append(
            f"per_device_train_batch_size * gradient_accumulation_steps = {generation_batch} completions is "
            f"not divisible by num_generations={cfg.num_generations}; use a multiple such as {valid}")


def _validate_reward(cfg: RewardConfig, errors: list[str]) -> None:
    _enum(errors, cfg, "truncation", TRUNCATION)
    _positive(errors, cfg, "max_length", "max_nonfinite_steps")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every field; raise one ConfigError listing all problems."""
    errors: list[str] = []
    _validate_common(cfg, errors)
    if isinstance(cfg, GRPOConfig):
        _validate_grpo(cfg, errors)
    if isinstance(cfg, RewardConfig):
        _validate_reward(cfg, errors)
    if errors:
        raise ConfigError(f"invalid {type(cfg).__name__}:\n  - " + "\n  - ".join(errors))
    return cfg


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Turn YAML/CLI values into the field's type (YAML reads '1e-5' as a string)."""
    if value is None:
        return None
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
            if typing.get_origin(target) is list:
                parsed = yaml.safe_load(value)
                return parsed if isinstance(parsed, list) else [x for x in value.split(",") if x]
        raise ConfigError(f"{name}={value!r} cannot be read as {annotation}")
    if float in args and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if any(typing.get_origin(a) is list for a in args) and isinstance(value, str | tuple):
        return list(value) if isinstance(value, tuple) else [value]
    return value


def from_dict(cls: type[TrainConfig], values: dict[str, Any]) -> TrainConfig:
    """Build and validate a config; unknown keys raise with the nearest known key."""
    types = typing.get_type_hints(cls)
    unknown = [key for key in values if key not in types]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(types), n=1, cutoff=0.6)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"unknown {cls.__name__} field(s): {', '.join(hints)}")
    kwargs = {key: _coerce(key, value, types[key]) for key, value in values.items()}
    return validate(cls(**kwargs))


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
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of field: value, got {type(loaded).__name__}")
        values.update(loaded)
    values.update(overrides or {})
    return from_dict(cls, values)


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
