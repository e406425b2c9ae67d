"""Run configuration: `GRPOConfig` and `RewardConfig`, YAML loading, overrides and validation.

Field names and defaults follow TRL's (`GRPOConfig`, `RewardConfig`, `ModelConfig`, and
transformers' `TrainingArguments`), so a TRL user's arguments carry over; docs/migration.md lists
every deliberate difference with its reason. Every TRL field name is accepted (rlft/compat.py): the
implemented ones work, an unimplemented one set to a non-default value is an error naming it.
Configs validate on construction, like TRL's; an error names the field, the value and what is
allowed, and an unknown key gets a "did you mean" suggestion.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from rlft.compat import compat_fields, unimplemented_errors

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static", "offloaded", "offloaded_static")  # transformers' names
IS_LEVELS = ("token", "sequence")
VLLM_MODES = ("colocate", "server")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DTYPES = ("auto", "float32", "bfloat16", "float16")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr", "cosine_with_restarts",
              "polynomial", "inverse_sqrt", "warmup_stable_decay")
TRUNCATION = ("keep_start", "keep_end", "error")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
STRATEGIES = ("no", "steps", "epoch")
# accelerate's tracker names ("all": every one that is installed, as in transformers).
TRACKERS = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")
# Keyword arguments rlft passes to every reward function; a dataset column must not shadow one.
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                    "environments")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which field and what to do."""


def normalize_report_to(value: Any) -> list[str]:
    """transformers' semantics: "none" -> [], "all" -> every installed tracker, a name -> [name], a list as is."""
    if value is None or value == "none":
        return []
    if isinstance(value, str):  # the command line: "tensorboard", "tensorboard,trackio", "[tensorboard, trackio]"
        value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
    names = [str(v) for v in value]
    if "all" in names:
        from accelerate.utils import is_tensorboard_available, is_trackio_available, is_wandb_available

        found = {"tensorboard": is_tensorboard_available(), "wandb": is_wandb_available(),
                 "trackio": is_trackio_available()}
        return [name for name, ok in found.items() if ok]
    return [n for n in names if n != "none"]


@dataclass
class _TrainFields:
    """Fields shared by GRPO and reward-model training (TRL / transformers names)."""

    model_name_or_path: str | None = None
    output_dir: str = "runs/rlft"
    overwrite_output_dir: bool = False  # a new run into a folder holding an earlier run: replace it (else refused)
    train_dataset: str | None = None  # a local file, a dataset folder or a hub dataset id
    eval_dataset: str | None = None
    # TRL's script arguments (trl grpo / trl reward): datasets.load_dataset(dataset_name, dataset_config)
    dataset_name: str | None = None
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    dataset_test_split: str = "test"
    dataset_streaming: bool = False
    seed: int = 42
    learning_rate: float = 1e-6
    optim: str = "adamw_torch"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | None = None
    warmup_ratio: float = 0.0
    warmup_steps: float = 0  # below 1: a fraction of the total steps, as in transformers
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_steps: int = -1
    num_train_epochs: float = 3.0
    logging_strategy: str = "steps"
    logging_steps: float = 10  # below 1: a fraction of the total steps
    logging_first_step: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    eval_on_start: bool = False
    report_to: str | list[str] = "none"
    run_name: str | None = None
    gradient_checkpointing: bool | None = True
    gradient_checkpointing_kwargs: dict | None = None
    activation_checkpointing: bool | None = None  # transformers 5's name for gradient_checkpointing; wins when set
    activation_checkpointing_kwargs: dict | None = None
    ddp_timeout: int = 1800  # seconds a collective may wait for another process (transformers' default)
    dtype: str = "auto"
    bf16: bool | None = None
    fp16: bool | None = None
    disable_tqdm: bool | None = False
    dataloader_num_workers: int = 0
    trust_remote_code: bool = False
    model_init_kwargs: dict | None = None
    chat_template_path: str | None = None
    pad_token: str | None = None
    eos_token: str | None = None
    pad_to_multiple_of: int | str | None = "auto"
    max_nonfinite_steps: int = 3
    # LoRA, as TRL's ModelConfig names it.
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | str = "all-linear"
    lora_task_type: str | None = None

    def __post_init__(self):
        # TRL/transformers spellings normalised to one form; then every check runs.
        self.report_to = normalize_report_to(self.report_to)
        self.disable_tqdm = bool(self.disable_tqdm)
        if self.activation_checkpointing is not None:
            self.gradient_checkpointing = self.activation_checkpointing
        if self.activation_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
        self.gradient_checkpointing = bool(self.gradient_checkpointing)
        if self.eval_steps is not None and self.eval_strategy == "no":
            logging.getLogger("rlft").warning("eval_steps=%s is set but eval_strategy='no': no evaluation will run "
                                              "(set eval_strategy='steps')", self.eval_steps)
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps  # transformers' rule
        validate(self)


@dataclass
class _GRPOFields(_TrainFields):
    """GRPO run. `per_device_train_batch_size` counts completions, as in TRL."""

    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None
    num_generations: int = 8
    num_generations_eval: int | None = None
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    max_prompt_length: int | None = 512
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None
    chat_template_kwargs: dict | None = None
    cache_implementation: str | None = None  # passed to generate, e.g. "static"; None: transformers' dynamic cache
    shared_prompt_prefill: bool = True  # dynamic cache: prefill each prompt once, not num_generations times
    shuffle_dataset: bool = True
    disable_dropout: bool = False
    cast_lm_head_to_fp32: bool = False
    beta: float = 0.0
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = True
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    scale_rewards: str | bool = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    allow_nan_rewards: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    delta: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    off_policy_mask_threshold: float | None = None
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    logprob_chunk_size: int | None = None  # None: sized to the device (rlft.core.logprobs.default_chunk_size)
    log_completions: bool = False
    num_completions_to_log: int = 8
    zero_signal_warning_steps: int = 5
    # vLLM rollouts (docs/vllm.md); TRL's names and defaults, plus the engine dtype and eager switch
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int = 1
    vllm_enable_sleep_mode: bool = False
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_cap: float | None = None  # TRL's deprecated name for clip_max; wins when set
    vllm_dtype: str = "auto"  # the engine's weights: "auto" = the trainer's; bfloat16 generates ~2x faster
    vllm_enforce_eager: bool | None = None  # None: eager on CPU (compiling costs ~25 s at start), compiled on GPU
    # Tool-calling rollouts (docs/agents.md). `tools`: "module:function" names, for configs (the trainer also takes
    # callables); max_tool_calling_iterations: TRL's (None: until no tool call or the completion budget is spent)
    tools: list[str] = field(default_factory=list)
    max_tool_calling_iterations: int | None = None
    tool_call_timeout: float = 30.0  # seconds one tool call may run before the policy reads a timeout error

    def __post_init__(self):
        if isinstance(self.scale_rewards, str) and self.scale_rewards.lower() in ("true", "false"):
            self.scale_rewards = self.scale_rewards.lower() == "true"
        if isinstance(self.scale_rewards, bool):  # TRL's spellings: True = "group", False = "none"
            self.scale_rewards = "group" if self.scale_rewards else "none"
        super().__post_init__()


@dataclass
class _RewardFields(_TrainFields):
    """Bradley-Terry reward-model run on chosen/rejected pairs."""

    learning_rate: float = 1e-4
    max_length: int | None = 1024
    truncation: str = "keep_start"
    center_rewards_coefficient: float | None = None
    disable_dropout: bool = True


def _with_trl_names(base: type, kind: str, doc: str) -> type:
    implemented = {f.name for f in dataclasses.fields(base)}
    cls = dataclasses.make_dataclass(kind, compat_fields(kind, implemented), bases=(base,))
    cls.__module__, cls.__doc__ = __name__, doc
    return cls


TrainConfig = _TrainFields
GRPOConfig = _with_trl_names(_GRPOFields, "GRPOConfig", _GRPOFields.__doc__)
RewardConfig = _with_trl_names(_RewardFields, "RewardConfig", _RewardFields.__doc__)


def _enum(errors: list[str], cfg: Any, name: str, allowed: tuple) -> None:
    value = getattr(cfg, name)
    value = getattr(value, "value", value)  # transformers' str enums
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
    for name, allowed in [("dtype", DTYPES), ("lr_scheduler_type", SCHEDULERS), ("optim", OPTIMIZERS),
                          ("logging_strategy", STRATEGIES), ("save_strategy", STRATEGIES),
                          ("eval_strategy", STRATEGIES)]:
        _enum(errors, cfg, name, allowed)
    _positive(errors, cfg, "learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size",
              "gradient_accumulation_steps", "logging_steps", "save_steps", "num_train_epochs", "lora_r",
              "max_nonfinite_steps", "ddp_timeout")
    _positive(errors, cfg, "weight_decay", "max_grad_norm", "warmup_ratio", "warmup_steps", "dataloader_num_workers",
              "eval_delay", allow_zero=True)
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        errors.append(f"max_steps={cfg.max_steps!r} must be > 0, or -1 to run num_train_epochs")
    if cfg.bf16 and cfg.fp16:
        errors.append("bf16=True and fp16=True together: pick one (or set dtype)")
    if not 0 <= cfg.lora_dropout < 1:
        errors.append(f"lora_dropout={cfg.lora_dropout!r} must be in [0, 1)")
    if cfg.eval_steps is not None and cfg.eval_steps <= 0:
        errors.append(f"eval_steps={cfg.eval_steps!r} must be > 0 or null")
    unknown = [r for r in cfg.report_to if r not in TRACKERS]
    if unknown:
        errors.append(f"report_to has unknown tracker(s) {unknown}; use 'none', 'all' or any of {list(TRACKERS)}")
    if not (cfg.pad_to_multiple_of in (None, "auto") or (isinstance(cfg.pad_to_multiple_of, int)
                                                         and cfg.pad_to_multiple_of > 0)):
        errors.append(f"pad_to_multiple_of={cfg.pad_to_multiple_of!r} must be a positive int, 'auto' or null")
    if cfg.dataset_name and cfg.train_dataset:
        errors.append(f"dataset_name={cfg.dataset_name!r} and train_dataset={cfg.train_dataset!r} are both set: "
                      "give one (dataset_name picks its split with dataset_train_split)")
    errors.extend(unimplemented_errors(cfg))


def _validate_generation_batch(cfg, errors: list[str]) -> None:
    if cfg.steps_per_generation is not None and cfg.generation_batch_size is not None:
        errors.append("steps_per_generation and generation_batch_size are both set: give one (TRL's rule)")
    _positive(errors, cfg, "steps_per_generation", "generation_batch_size", "num_generations_eval")
    spg = cfg.steps_per_generation or cfg.gradient_accumulation_steps
    if spg % cfg.gradient_accumulation_steps:
        errors.append(f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps="
                      f"{cfg.gradient_accumulation_steps}: one generation must feed whole optimiser steps")
    rollout = cfg.per_device_train_batch_size * spg
    if cfg.num_generations >= 2 and cfg.generation_batch_size is None and rollout % cfg.num_generations:
        valid = [cfg.num_generations * k for k in range(1, 5)]
        errors.append(
            f"per_device_train_batch_size * steps_per_generation = {rollout} completions is not divisible by "
            f"num_generations={cfg.num_generations}; use a multiple such as {valid} (steps_per_generation "
            "defaults to gradient_accumulation_steps)")


def _validate_grpo(cfg, errors: list[str]) -> None:
    for name, allowed in [("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                          ("importance_sampling_level", IS_LEVELS), ("kl_estimator", KL_ESTIMATORS),
                          ("multi_objective_aggregation", AGGREGATIONS),
                          ("cache_implementation", CACHE_IMPLEMENTATIONS)]:
        _enum(errors, cfg, name, allowed)
    if cfg.num_generations < 2:
        errors.append(f"num_generations={cfg.num_generations!r} must be >= 2: group-relative advantages "
                      "compare completions of the same prompt, so a group of 1 has no signal")
    _positive(errors, cfg, "max_completion_length", "max_prompt_length", "temperature", "num_iterations",
              "logprob_chunk_size", "num_completions_to_log", "sapo_temperature_pos", "sapo_temperature_neg",
              "tool_call_timeout")
    _positive(errors, cfg, "beta", "epsilon", "epsilon_high", "top_k", "min_p", "max_tool_calling_iterations",
              allow_zero=True)
    if not 0 < cfg.top_p <= 1:
        errors.append(f"top_p={cfg.top_p!r} must be in (0, 1]")
    if cfg.reward_weights is not None and cfg.reward_funcs and len(cfg.reward_weights) != len(cfg.reward_funcs):
        errors.append(f"reward_weights has {len(cfg.reward_weights)} values but reward_funcs has "
                      f"{len(cfg.reward_funcs)}: give one weight per reward function")
    _validate_generation_batch(cfg, errors)
    _validate_vllm(cfg, errors)
    _validate_algorithm_options(cfg, errors)


def _validate_algorithm_options(cfg, errors: list[str]) -> None:
    _positive(errors, cfg, "entropy_coef", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
              "entropy_target", "off_policy_mask_threshold", "vespo_lambda_pos", "vespo_lambda_neg", allow_zero=True)
    _positive(errors, cfg, "ref_model_sync_steps")
    if cfg.delta is not None and cfg.delta <= 1:
        errors.append(f"delta={cfg.delta!r} must be > 1 (INTELLECT-2 caps the ratio of negative-advantage tokens "
                      f"from above; it should exceed 1 + epsilon_high)")
    if not 0 <= cfg.top_entropy_quantile <= 1:
        errors.append(f"top_entropy_quantile={cfg.top_entropy_quantile!r} must be in [0, 1] (1 keeps every token)")
    if cfg.entropy_coef_min > cfg.entropy_coef_max:
        errors.append(f"entropy_coef_min={cfg.entropy_coef_min} exceeds entropy_coef_max={cfg.entropy_coef_max}")
    if not 0 <= cfg.ref_model_mixup_alpha <= 1:
        errors.append(f"ref_model_mixup_alpha={cfg.ref_model_mixup_alpha!r} must be in [0, 1]")
    if cfg.sync_ref_model and cfg.beta == 0:
        errors.append("sync_ref_model=True with beta=0: there is no reference model to update (the KL term is off); "
                      "set beta > 0 or sync_ref_model: false")
    if cfg.sync_ref_model and cfg.use_peft:
        errors.append("sync_ref_model=True with LoRA: the reference is the base model under the adapters, not a "
                      "separate copy that can move; use full fine-tuning or sync_ref_model: false (TRL's rule)")
    if cfg.loss_type == "vespo" and cfg.use_vllm and cfg.vllm_importance_sampling_correction and \
            cfg.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
        errors.append(f"loss_type vespo folds the sampling correction into its sequence weight token by token: "
                      f"set vllm_importance_sampling_mode to token_truncate or token_mask (not "
                      f"{cfg.vllm_importance_sampling_mode})")


def _validate_vllm(cfg, errors: list[str]) -> None:
    _enum(errors, cfg, "vllm_mode", VLLM_MODES)
    _enum(errors, cfg, "vllm_importance_sampling_mode", VLLM_IS_MODES)
    _enum(errors, cfg, "vllm_dtype", DTYPES)
    _positive(errors, cfg, "vllm_server_timeout", "vllm_tensor_parallel_size", "vllm_importance_sampling_clip_max",
              "vllm_importance_sampling_cap", "vllm_max_model_length")
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low > high:
        errors.append(f"vllm_importance_sampling_clip_min={low} exceeds vllm_importance_sampling_clip_max={high}")
    if not 0 < cfg.vllm_gpu_memory_utilization <= 1:
        errors.append(f"vllm_gpu_memory_utilization={cfg.vllm_gpu_memory_utilization!r} must be in (0, 1]")


def _validate_reward(cfg, errors: list[str]) -> None:
    _enum(errors, cfg, "truncation", TRUNCATION)
    _positive(errors, cfg, "max_length")


def _type_ok(value: Any, annotation: Any) -> bool:
    if annotation is Any or value is None:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation) if a is not type(None))
    target = origin or annotation
    if target is bool:
        return isinstance(value, bool)
    if target is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if target is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if target is list:
        inner = typing.get_args(annotation)
        return isinstance(value, list | tuple) and (not inner or all(_type_ok(v, inner[0]) for v in value))
    return isinstance(value, target) if isinstance(target, type) else True


def _validate_types(cfg, errors: list[str]) -> None:
    for name, annotation in field_types(type(cfg)).items():
        value = getattr(cfg, name)
        if not _type_ok(value, annotation):
            shown = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
            errors.append(f"{name}={value!r} is a {type(value).__name__}; the field takes {shown}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every field; raise one ConfigError listing all problems."""
    errors: list[str] = []
    _validate_types(cfg, errors)
    if errors:  # the checks below assume the types are right
        raise ConfigError(f"invalid {type(cfg).__name__}:\n  - " + "\n  - ".join(errors))
    _validate_common(cfg, errors)
    if hasattr(cfg, "num_generations"):
        _validate_grpo(cfg, errors)
    if hasattr(cfg, "truncation"):
        _validate_reward(cfg, errors)
    if errors:
        raise ConfigError(f"invalid {type(cfg).__name__}:\n  - " + "\n  - ".join(errors))
    return cfg


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


# YAML and command-line reading and writing live in rlft/config_io.py; these names stay importable from here.
from rlft.config_io import from_dict, load_config, parse_overrides, save_config, to_dict  # noqa: E402, F401
